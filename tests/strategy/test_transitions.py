"""The level-transition table is the one source of the strategies' collectives: the engine issues exactly its
collectives, the volume formulas are its bytes, and the cost model's phases are its phases, for all 14 strategies.

The engine's view is read off a :class:`FlatGroup` driven through one optimizer step against a recording
communicator (rank 0 of 2 groups of 2; nothing is sent); the measured traffic of real runs is checked against the
formulas in test_parity.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_paro.comm import quantize
from lightning_paro.comm.topology import Topology
from lightning_paro.planner.inputs import Cluster, Link
from lightning_paro.planner.phases import grad_sync_phases, gather_phases, param_sync_phases, reduce_scatter_phases
from lightning_paro.strategy import transitions
from lightning_paro.strategy.flat import FlatGroup
from lightning_paro.strategy.levels import VALID_STRATEGIES, Level, ShardingSpec
from lightning_paro.strategy.volumes import step_traffic

M, G = 2, 2
NUMEL = 64  # a multiple of n: no padding, so bytes compare exactly


BF16 = torch.bfloat16
COMMS = {"exact": transitions.EXACT, "bf16": transitions.CommDtypes(BF16, BF16),
         "bf16 params": transitions.CommDtypes(params=BF16), "bf16 grads": transitions.CommDtypes(grads=BF16),
         "int8 between groups": transitions.CommDtypes(inter_quant="int8"),
         "bf16, int8 between groups": transitions.CommDtypes(BF16, BF16, "int8")}


class RecordingComm:
    """The calls a FlatGroup makes, as (op, scope, full-side numel, dtype, quantization); no data moves."""

    def __init__(self) -> None:
        self.topology = Topology(world_size=M * G, group_size=M, rank=0)
        self.calls: list[tuple[str, str, int, torch.dtype]] = []

    def all_gather(self, out, shard, scope, async_op=False, quant=None):
        assert shard.dtype == out.dtype
        self.calls.append(("all_gather", scope, out.numel(), out.dtype, quant))

    def reduce_scatter(self, out, full, scope, async_op=False, quant=None, error=None):
        assert out.dtype == full.dtype
        self.calls.append(("reduce_scatter", scope, full.numel(), full.dtype, quant))

    def all_reduce(self, tensor, scope, async_op=False, quant=None, error=None):
        self.calls.append(("all_reduce", scope, tensor.numel(), tensor.dtype, quant))

    def submit(self, fn, *args, **kwargs):
        fn()


def _engine_calls(spec: ShardingSpec, comm_dtypes=transitions.EXACT) -> dict[str, list[tuple]]:
    comm = RecordingComm()
    param = nn.Parameter(torch.randn(NUMEL))
    flat = FlatGroup([("w", param)], trainable=True, spec=spec, comm=comm, comm_dtypes=comm_dtypes)
    seen = {}

    def run(name, fn):
        comm.calls = []
        fn()
        seen[name] = comm.calls

    run("gather_params", lambda: flat.gather_params(async_op=False))
    flat.prepare_grads()
    (param * 2).sum().backward()
    run("reduce_grads", flat.reduce_grads)
    run("grads_to_optim", flat.sync_grads)
    run("optim_to_params", flat.sync_params)
    return seen


def _table_calls(t: transitions.Transition) -> list[tuple]:
    return [(c.op, c.scope, int(NUMEL * c.full_fraction(M)), c.wire_dtype(torch.float32), c.quant) for c in t]


def _wire_full(c: transitions.Collective, p: transitions.LinkPhase, k: int) -> float:
    """Bytes of a phase's full side on the wire, for NUMEL fp32 elements."""
    if c.quant and p.link == "inter":  # k payloads of one slice each: an int8 per element, a scale per block
        numel = p.fraction * NUMEL / k
        return k * (numel + 4 * math.ceil(numel / quantize.BLOCK))
    return p.fraction * NUMEL * (2 if c.dtype == BF16 else 4)


@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("name", VALID_STRATEGIES)
def test_the_engine_the_formulas_and_the_cost_model_read_one_table(name, comm):
    """Also with parameters and gradients travelling in bf16, or the rail collectives int8-quantized: the table says
    the dtype (and the quantization), the engine sends it, the formulas count its bytes (bf16: half of fp32's; int8:
    one byte per element and an fp32 scale per block of each slice)."""
    spec = ShardingSpec.parse(name)
    comm_dtypes = COMMS[comm]
    table = transitions.step_transitions(spec, comm_dtypes)

    # 1. the engine issues exactly the table's collectives, in the table's dtypes
    engine = _engine_calls(spec, comm_dtypes)
    assert engine == {k: _table_calls(t) for k, t in table.items()}

    # 2. the volume formula is the table's bytes: gathers per micro-step, reduction, the two syncs
    nbytes = 4.0 * NUMEL
    ring = {"intra": M, "inter": G}
    sent = {"intra": 0.0, "inter": 0.0}
    count = {"gather_params": 2, "reduce_grads": 1, "grads_to_optim": 1, "optim_to_params": 1}
    for key, t in table.items():
        for c in t:
            for p in transitions.link_phases(c, M, G):
                k = ring[p.link]
                factor = 2 if p.op == "all_reduce" else 1
                sent[p.link] += count[key] * factor * (k - 1) / k * _wire_full(c, p, k)
    formula = step_traffic(spec, nbytes, nbytes, M, G, accumulation=1, comm=comm_dtypes, element_bytes=4)
    assert (formula.intra, formula.inter) == pytest.approx((sent["intra"], sent["inter"]))
    if comm == "bf16":
        exact = step_traffic(spec, nbytes, nbytes, M, G, accumulation=1)
        assert (formula.intra, formula.inter) == pytest.approx((exact.intra / 2, exact.inter / 2))

    # 3. the cost model times the table's phases
    cluster = Cluster(M * G, M, Link(1e9), Link(1e8), device_memory=1e12)
    modelled = {"gather_params": gather_phases(spec.params, nbytes, cluster, comm_dtypes, 4),
                "reduce_grads": reduce_scatter_phases(spec.grads, nbytes, cluster, comm_dtypes, 4),
                "grads_to_optim": grad_sync_phases(spec, nbytes, cluster, comm_dtypes, 4),
                "optim_to_params": param_sync_phases(spec, nbytes, cluster, comm_dtypes, 4)}
    for key, t in table.items():
        ring = {"intra": M, "inter": G}
        phases = [(c, p) for c in t for p in transitions.link_phases(c, M, G)]
        assert [(p.op, p.scope, p.nbytes) for p in modelled[key]] == [
            (p.op, p.link, _wire_full(c, p, ring[p.link])) for c, p in phases], key


def test_every_level_change_has_one_entry():
    """Each transition is empty exactly when the levels do not change, and the G -> OS sync sums once over every
    rank: the scopes it crosses, with the G level's own, cover the whole world."""
    for p in Level:
        assert (transitions.gather_params(p) == ()) == (p == Level.N)
        assert (transitions.reduce_grads(p) == ()) == (p == Level.N)
    for name in VALID_STRATEGIES:
        s = ShardingSpec.parse(name)
        assert (transitions.optim_to_params(s.optim, s.params) == ()) == (s.optim == s.params)
        scopes = {transitions.SCOPE_OF.get(s.grads)} | {c.scope for c in transitions.grads_to_optim(s.grads, s.optim)}
        assert "global" in scopes or {"intra", "inter"} <= scopes, name
