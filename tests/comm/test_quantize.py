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
