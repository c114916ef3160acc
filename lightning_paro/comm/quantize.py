"""Block-wise int8 quantization of the collectives that cross groups (``PaROStrategy(inter_quant="int8")``).

A buffer is cut into blocks of :data:`BLOCK` elements; each block travels as one fp32 scale (its largest magnitude
over 127) and one int8 per element, the element divided by the scale and rounded: an element comes back within half
a scale of its value, so the error is relative to the largest value of its block (at most 1/254 of it). A payload is
the scales followed by the int8 values, in one byte buffer (:func:`quantize`, :func:`dequantize`).

The rail (inter-group) collectives built on it, which are also the hop between groups of a global collective
(``Communicator``), quantize each contribution once, as ZeRO++'s qgZ does: a
reduce-scatter sends each slice of the buffer, quantized, to the rank that owns it (one all-to-all) and the owner sums
the dequantized slices in fp32 with its own exact one, so the error does not compound hop by hop with the number of
groups; an all-gather sends the quantized shard and every rank, the owner included, keeps the dequantized values (all
ranks hold the same numbers); an all-reduce is the two.

Error feedback (for gradients): a sender keeps what quantization left out of each slice it sent and adds it to the
same slice of its next reduction (:func:`quantize_with_feedback`), so the errors of successive steps cancel instead of
adding up: over any number of steps, what arrived differs from what was meant by one step's rounding at most.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from lightning_paro import compat

BLOCK = 256
"""Elements per block: one fp32 scale each, 4/256 of a byte per element on top of the int8 value."""
SCHEMES: tuple[str, ...] = ("int8",)
"""The quantizations the inter-group hop offers."""


def payload_bytes(numel: int) -> int:
    """Bytes of the payload of ``numel`` elements: an fp32 scale per (started) block and an int8 per element."""
    return 4 * math.ceil(numel / BLOCK) + numel


def quantize(x: torch.Tensor) -> torch.Tensor:
    """``x`` (any floating dtype) as a uint8 payload of :func:`payload_bytes` bytes."""
    return _quantize(x)[0]


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The payload of ``x`` and the fp32 values it stands for (what :func:`dequantize` gives back)."""
    n = x.numel()
    blocks = math.ceil(n / BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=x.device)
    padded[:n] = x.reshape(-1)
    rows = padded.view(blocks, BLOCK)
    scale = rows.abs().amax(dim=1) / 127.0
    q = torch.round(rows / scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)).clamp_(-127, 127)
    out = torch.empty(payload_bytes(n), dtype=torch.uint8, device=x.device)
    out[:4 * blocks].view(torch.float32).copy_(scale)
    out[4 * blocks:].view(torch.int8).copy_(q.view(-1)[:n])
    return out, (q * scale.unsqueeze(1)).view(-1)[:n]


def dequantize(payload: torch.Tensor, numel: int) -> torch.Tensor:
    """The fp32 values of a payload of ``numel`` elements."""
    blocks = math.ceil(numel / BLOCK)
    scale = payload[:4 * blocks].clone().view(torch.float32)  # a copy: a payload may start at any byte
    values = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=payload.device)
    values[:numel] = payload[4 * blocks:4 * blocks + numel].view(torch.int8)
    return (values.view(blocks, BLOCK) * scale.unsqueeze(1)).view(-1)[:numel]


def quantize_with_feedback(x: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """The payload of ``x`` plus the ``error`` left by earlier sends (fp32, ``x``'s size), and ``error`` replaced by
    what this payload leaves out."""
    target = x.to(torch.float32) + error
    payload, sent = _quantize(target)
    torch.sub(target, sent, out=error)
    return payload


def all_gather(out: torch.Tensor, shard: torch.Tensor, group, ranks: int) -> None:
    """``out`` (``ranks`` shards in rank order) from every rank's quantized ``shard``; this rank's slot too holds the
    dequantized values, so every rank holds the same. ``shard`` may be a view of ``out``."""
    s = shard.numel()
    mine = quantize(shard)
    gathered = torch.empty(ranks * mine.numel(), dtype=torch.uint8, device=mine.device)
    compat.all_gather_single(gathered, mine, group=group)
    p = mine.numel()
    for r in range(ranks):
        out[r * s:(r + 1) * s].copy_(dequantize(gathered[r * p:(r + 1) * p], s))


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, group, ranks: int, index: int,
                   error: torch.Tensor | None = None) -> None:
    """``out``: slice ``index`` of ``full`` summed over the ranks, each peer's slice sent quantized (one all-to-all),
    this rank's own added exact, the sum in fp32. ``error`` (fp32, ``full``'s size): error feedback for the slices
    sent (:func:`quantize_with_feedback`); this rank's own slice is never rounded."""
    s = out.numel()
    if error is not None and error.numel() != full.numel():
        raise ValueError(f"the error feedback buffer holds {error.numel()} elements, the reduced one {full.numel()}")
    # this rank's own slot travels empty: its slice is added exact, not from what comes back
    send = torch.cat([torch.empty(payload_bytes(s), dtype=torch.uint8, device=full.device) if r == index else
                      quantize(full[r * s:(r + 1) * s]) if error is None else
                      quantize_with_feedback(full[r * s:(r + 1) * s], error[r * s:(r + 1) * s])
                      for r in range(ranks)])
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    p = send.numel() // ranks
    total = full[index * s:(index + 1) * s].to(torch.float32, copy=True)
    for r in range(ranks):
        if r != index:
            total += dequantize(recv[r * p:(r + 1) * p], s)
    out.copy_(total)


def all_reduce(tensor: torch.Tensor, group, ranks: int, index: int, error: torch.Tensor | None = None) -> None:
    """``tensor`` summed over the ranks: a quantized reduce-scatter (with ``error`` feedback), then a quantized
    all-gather of the sums."""
    s = tensor.numel() // ranks
    part = torch.empty(s, dtype=tensor.dtype, device=tensor.device)
    reduce_scatter(part, tensor, group, ranks, index, error)
    all_gather(tensor, part, group, ranks)
