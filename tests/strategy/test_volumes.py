"""The formula module against the PaRO design's worked example (7B on 32 ranks, m = 8, A = 4, bf16 Adam)."""

import pytest

from lightning_paro.strategy.levels import VALID_STRATEGIES, Level, ShardingSpec
from lightning_paro.strategy.volumes import flat_step_traffic, model_state_bytes, step_traffic

PSI = 6.74e9  # LLaMA-7B
TABLE_7B = {  # memory GB / intra GB / inter GB per rank and step, from the design document
    "NNN": (107.8, 0, 26.1), "NNG": (29.5, 0, 26.1), "NGG": (16.4, 0, 65.3), "GGG": (3.4, 0, 156.7),
    "III": (13.5, 141.5, 2.5), "NII": (25.3, 59.0, 2.5), "IIG": (5.9, 141.5, 2.5), "IGG": (4.6, 94.4, 53.5),
}


@pytest.mark.parametrize("name", sorted(TABLE_7B))
def test_worked_example_7b(name):
    spec = ShardingSpec.parse(name)
    mem, intra, inter = TABLE_7B[name]
    t = flat_step_traffic(spec, 2 * PSI, 2 * PSI, m=8, n=32, accumulation=4)
    assert t.intra / 1e9 == pytest.approx(intra, abs=0.06)
    assert t.inter / 1e9 == pytest.approx(inter, abs=0.06)
    m = model_state_bytes(spec, PSI, PSI, m=8, n=32, param_bytes=2, grad_bytes=2, optim_bytes=12)
    assert sum(m.values()) / 1e9 == pytest.approx(mem, abs=0.06)


@pytest.mark.parametrize("name", VALID_STRATEGIES)
def test_hierarchical_total_equals_flat_total(name):
    """Splitting global collectives into intra and inter phases moves the same total bytes as a flat ring."""
    spec = ShardingSpec.parse(name)
    h = step_traffic(spec, 1e6, 7e5, m=4, g=3, accumulation=3)
    f = flat_step_traffic(spec, 1e6, 7e5, m=4, n=12, accumulation=3)
    assert h.intra + h.inter == pytest.approx(f.intra + f.inter)
    if Level.G not in (spec.params, spec.grads, spec.optim) and name != "NNN":  # no global collective at all
        assert h == f


def test_no_inter_traffic_per_micro_step_without_level_g():
    for name in VALID_STRATEGIES:
        spec = ShardingSpec.parse(name)
        a1 = step_traffic(spec, 1e6, 1e6, m=4, g=2, accumulation=1)
        a5 = step_traffic(spec, 1e6, 1e6, m=4, g=2, accumulation=5)
        if spec.params != Level.G and spec.grads != Level.G:
            assert a5.inter == a1.inter  # inter-group bytes do not grow with accumulation
        else:
            assert a5.inter > a1.inter
