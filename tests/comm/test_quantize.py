"""Block-wise int8 quantization (``lightning_paro.comm.quantize``): the error bound, the payload, edge values."""

import math

import pytest
import torch

from lightning_paro.comm import quantize


@pytest.mark.parametrize("numel", [1, 255, 256, 257, 1000])
def test_each_element_comes_back_within_half_a_scale_of_its_block(numel):
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g) * torch.logspace(-3, 2, numel)  # blocks of very different magnitudes
    payload = quantize.quantize(x)
    assert payload.dtype == torch.uint8 and payload.numel() == quantize.payload_bytes(numel)
    assert quantize.payload_bytes(numel) == numel + 4 * math.ceil(numel / quantize.BLOCK)
    y = quantize.dequantize(payload, numel)
    blocks = torch.nn.functional.pad(x, (0, -numel % quantize.BLOCK)).view(-1, quantize.BLOCK)
    half_scale = (blocks.abs().amax(1) / 127 / 2).repeat_interleave(quantize.BLOCK)[:numel]
    assert ((y - x).abs() <= half_scale * (1 + 1e-6)).all()
    assert numel == 1 or (y - x).abs().max() > 0  # lossy (a lone element is its block's largest: exact)


def test_zeros_the_largest_value_and_bf16_inputs():
    x = torch.zeros(300)
    x[7], x[270] = -3.5, 2.0
    y = quantize.dequantize(quantize.quantize(x), 300)
    assert y[7] == pytest.approx(-3.5) and y[270] == pytest.approx(2.0)  # a block's largest value is exact
    assert (y[x == 0] == 0).all()  # zeros stay zeros, an all-zero block too
    b = torch.randn(100, dtype=torch.bfloat16)
    assert quantize.dequantize(quantize.quantize(b), 100).dtype == torch.float32


def test_a_payload_may_start_at_any_byte():
    """Payloads sit back to back in one all-to-all buffer: one starting at an odd offset still reads its scales."""
    x = torch.randn(3)
    both = torch.cat([quantize.quantize(torch.randn(1)), quantize.quantize(x)])
    assert torch.equal(quantize.dequantize(both[quantize.payload_bytes(1):], 3),
                       quantize.dequantize(quantize.quantize(x), 3))


def test_error_feedback_keeps_the_sum_of_many_sends_within_one_rounding():
    """Sending the same values step after step: without feedback the rounding adds up linearly; with it, what arrived
    over all steps differs from what was sent by what the last send left out (at most half a scale per element)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, generator=g)
    steps = 50
    plain = sum(quantize.dequantize(quantize.quantize(x), 512) for _ in range(steps))
    error = torch.zeros(512)
    fed = sum(quantize.dequantize(quantize.quantize_with_feedback(x, error), 512) for _ in range(steps))
    half_scale = (x.view(-1, quantize.BLOCK).abs().amax(1) / 127 / 2).repeat_interleave(quantize.BLOCK)
    assert ((fed - steps * x).abs() <= half_scale * 1.02 + 1e-6).all()
    assert torch.allclose(fed + error, steps * x, atol=1e-4)  # nothing is lost: it is still in the error
    assert (plain - steps * x).abs().max() > 10 * (fed - steps * x).abs().max()


@pytest.mark.parametrize("numel", [1, 256, 300])
def test_rows_quantize_and_dequantize_each_row_as_a_tensor_of_its_own(numel):
    """The collectives quantize all ranks' slices as the rows of one tensor: each row's payload, values and error
    feedback are, bit for bit, those of the row quantized alone."""
    g = torch.Generator().manual_seed(numel)
    rows = torch.randn(3, numel, generator=g) * torch.logspace(-3, 2, 3).unsqueeze(1)
    payloads, values = quantize.quantize_rows(rows)
    assert payloads.shape == (3, quantize.payload_bytes(numel))
    for r in range(3):
        assert torch.equal(payloads[r], quantize.quantize(rows[r]))
        assert torch.equal(values[r], quantize.dequantize(quantize.quantize(rows[r]), numel))
    back = quantize.dequantize_rows(payloads, numel)
    assert all(torch.equal(back[r], quantize.dequantize(payloads[r], numel)) for r in range(3))
    error = torch.randn(3, numel, generator=g) * 1e-3
    alone = [error[r].clone() for r in range(3)]
    fed = quantize.quantize_rows_with_feedback(rows.to(torch.bfloat16), error)
    for r in range(3):
        assert torch.equal(fed[r], quantize.quantize_with_feedback(rows[r].to(torch.bfloat16), alone[r]))
        assert torch.equal(error[r], alone[r])


def _exchange(monkeypatch, ranks, run):
    """Run ``run(rank)`` for every rank in one process, their all-to-all and all-gather exchanging what each rank
    sends: a first pass collects the sends (on copies of the state ``run`` changes), a second delivers them."""
    sent: dict[int, torch.Tensor] = {}
    delivering = False

    def all_to_all_single(recv, send, group=None):
        p = send.numel() // ranks
        if not delivering:
            sent[rank] = send.clone()
        else:
            recv.copy_(torch.cat([sent[r][rank * p:(rank + 1) * p] for r in range(ranks)]))

    def all_gather_single(out, mine, group=None):
        if not delivering:
            sent[rank] = mine.clone()
        else:
            out.copy_(torch.cat([sent[r] for r in range(ranks)]))

    monkeypatch.setattr(quantize.dist, "all_to_all_single", all_to_all_single)
    monkeypatch.setattr(quantize.compat, "all_gather_single", all_gather_single)
    for delivering in (False, True):
        for rank in range(ranks):
            run(rank, delivering)


@pytest.mark.parametrize("feedback", [False, True])
def test_quantized_reduce_scatter_and_all_gather_over_ranks_as_defined_slice_by_slice(monkeypatch, feedback):
    """Each peer's slice goes as its own payload, this rank's is added exact first and the others in rank order
    (the sum in fp32); an all-gather hands every rank every shard's dequantized values. Bit for bit."""
    ranks, s = 4, 300
    g = torch.Generator().manual_seed(1)
    fulls = [torch.randn(ranks * s, generator=g) * torch.logspace(-2, 1, ranks * s) for _ in range(ranks)]
    errors = [torch.randn(ranks * s, generator=g) * 1e-2 if feedback else None for _ in range(ranks)]
    start = [e.clone() if feedback else None for e in errors]
    outs = [torch.empty(s) for _ in range(ranks)]

    def run(rank, delivering):
        error = errors[rank] if delivering or not feedback else errors[rank].clone()
        quantize.reduce_scatter(outs[rank], fulls[rank], None, ranks, rank, error)

    _exchange(monkeypatch, ranks, run)
    expected_errors = [e.clone() if feedback else None for e in start]  # this rank's own slice stays as it was
    for i in range(ranks):
        total = fulls[i][i * s:(i + 1) * s].to(torch.float32)
        for r in range(ranks):
            if r != i:
                piece = fulls[r][i * s:(i + 1) * s]
                payload = (quantize.quantize_with_feedback(piece, expected_errors[r][i * s:(i + 1) * s]) if feedback
                           else quantize.quantize(piece))
                total += quantize.dequantize(payload, s)
        assert torch.equal(outs[i], total)
    if feedback:
        assert all(torch.equal(errors[r], expected_errors[r]) for r in range(ranks))
        assert not any(torch.equal(errors[r], start[r]) for r in range(ranks))

    gathered = [torch.empty(ranks * s, dtype=torch.bfloat16) for _ in range(ranks)]  # written in its dtype
    _exchange(monkeypatch, ranks, lambda rank, _: quantize.all_gather(gathered[rank], outs[rank], None, ranks))
    expected = torch.cat([quantize.dequantize(quantize.quantize(outs[r]), s) for r in range(ranks)]).to(torch.bfloat16)
    assert all(torch.equal(x, expected) for x in gathered)
