"""The int8 hop's edge cases: a non-finite gradient does not stay in the error feedback, and a size the quantized
collectives cannot split is an error naming the size and the divisor (never a tail left unreduced)."""

import pytest
import torch

from lightning_paro.comm import quantize
from comm.test_quantize import _exchange


def test_a_non_finite_block_is_sent_as_nan_and_leaves_no_trace_in_the_error_feedback(monkeypatch):
    """Rank 0's slice for rank 1 holds one inf: that block arrives NaN (as a scaler's inf check would see it), but
    rank 0's error feedback keeps zeros there, not the inf, so its next send of finite values is the one a fresh
    buffer would make for that block, and the other blocks keep the rounding they left out."""
    ranks, s = 2, 512
    g = torch.Generator().manual_seed(3)
    fulls = [torch.randn(ranks * s, generator=g) for _ in range(ranks)]
    fulls[0][s + 10] = float("inf")  # rank 0's slice for rank 1, first block
    errors = [torch.zeros(ranks * s) for _ in range(ranks)]
    outs = [torch.empty(s) for _ in range(ranks)]

    def run(rank, delivering):
        error = errors[rank] if delivering else errors[rank].clone()
        quantize.reduce_scatter(outs[rank], fulls[rank], None, ranks, rank, error)

    _exchange(monkeypatch, ranks, run)
    assert outs[1][:quantize.BLOCK].isnan().all() and outs[1][quantize.BLOCK:].isfinite().all()
    assert all(e.isfinite().all() for e in errors)
    sent_block = errors[0][s:s + quantize.BLOCK]
    assert (sent_block == 0).all()  # the block sent non-finite: nothing carried over
    assert (errors[0][s + quantize.BLOCK:] != 0).any()  # the finite block's rounding is kept

    # the next step's finite values: the block quantizes as from a fresh buffer
    fresh = torch.randn(s, generator=g)
    fed = quantize.quantize_with_feedback(fresh, errors[0][s:].clone())
    alone = quantize.quantize_with_feedback(fresh[:quantize.BLOCK], torch.zeros(quantize.BLOCK))
    assert quantize.dequantize(fed, s)[:quantize.BLOCK].isfinite().all()
    assert torch.equal(quantize.dequantize(fed, s)[:quantize.BLOCK],
                       quantize.dequantize(alone, quantize.BLOCK))


@pytest.mark.parametrize("call, size, divisor", [
    (lambda: quantize.all_reduce(torch.zeros(10), None, 4, 0), 10, 4),
    (lambda: quantize.reduce_scatter(torch.zeros(2), torch.zeros(10), None, 4, 0), 10, 4),
    (lambda: quantize.all_gather(torch.zeros(10), torch.zeros(2), None, 4), 10, 4),
])
def test_a_size_the_ranks_do_not_divide_is_an_error_naming_both(monkeypatch, call, size, divisor):
    """Before any exchange: 10 elements over 4 ranks would leave a tail of 2 unreduced."""
    def no_exchange(*args, **kwargs):
        raise AssertionError("a collective ran on a size it cannot split")

    monkeypatch.setattr(quantize.dist, "all_to_all_single", no_exchange)
    monkeypatch.setattr(quantize.compat, "all_gather_single", no_exchange)
    with pytest.raises(ValueError, match=rf"{size} elements.*multiple of {divisor}|{divisor} ranks.*{size} elements"):
        call()
