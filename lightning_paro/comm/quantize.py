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
ranks hold the same numbers); an all-reduce is the two. The slices of all ranks are quantized, and dequantized, as
the rows of one tensor.

Error feedback (for gradients): a sender keeps what quantization left out of each slice it sent and adds it to the
same slice of its next reduction (:func:`quantize_with_feedback`), so the errors of successive steps cancel instead of
adding up: over any number of steps, what arrived differs from what was meant by one step's rounding at most.

**Non-finite values.** A block holding an inf or a NaN gets a non-finite scale and arrives all NaN (int8 has no inf),
so the reduced gradient is non-finite wherever an exact reduction's would be, and more: a gradient scaler's inf check,
or the user's own, sees it either way. What error feedback keeps of such a block is no rounding left out but the
non-finite value itself, which would be added to every later send of that slice for good: the sender resets those
entries of its error-feedback buffer to zero instead (:func:`quantize_rows_with_feedback`; no host sync), so the
steps after a non-finite one quantize as if it had never been sent. The step itself is not skipped here: it goes ahead
with the non-finite gradient, as it would without quantization.

**Sizes.** A reduce-scatter splits its buffer into ``ranks`` equal slices, an all-gather fills ``ranks`` equal slots
and an all-reduce is the two: a size that does not split so is a ``ValueError`` naming the size and the divisor
(:func:`check_split`), never a tail left unreduced.
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
    return quantize_rows(x.reshape(1, -1))[0].view(-1)


def dequantize(payload: torch.Tensor, numel: int) -> torch.Tensor:
    """The fp32 values of a payload of ``numel`` elements."""
    return dequantize_rows(payload.reshape(1, -1), numel).view(-1)


def quantize_with_feedback(x: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """The payload of ``x`` plus the ``error`` left by earlier sends (fp32, ``x``'s size), and ``error`` replaced by
    what this payload leaves out."""
    return quantize_rows_with_feedback(x.reshape(1, -1), error.view(1, -1)).view(-1)


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The payload of each row of the 2-D ``rows`` (a uint8 row of :func:`payload_bytes` each) and the fp32 values
    the payloads stand for (what :func:`dequantize_rows` gives back)."""
    k, n = rows.shape
    blocks = math.ceil(n / BLOCK)
    padded = torch.zeros(k, blocks * BLOCK, dtype=torch.float32, device=rows.device)
    padded[:, :n] = rows
    grid = padded.view(k, blocks, BLOCK)
    scale = grid.abs().amax(dim=2) / 127.0
    q = torch.round(grid / scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(2)).clamp_(-127, 127)
    values = q.view(k, blocks * BLOCK)[:, :n].to(torch.int8).view(torch.uint8)
    payloads = torch.cat([scale.view(torch.uint8), values], dim=1)
    return payloads, (q * scale.unsqueeze(2)).view(k, blocks * BLOCK)[:, :n]


def dequantize_rows(payloads: torch.Tensor, numel: int) -> torch.Tensor:
    """The fp32 values of the payloads of ``numel`` elements in the rows of the 2-D ``payloads``, one row each."""
    k = payloads.shape[0]
    blocks = math.ceil(numel / BLOCK)
    # a copy: a payload may start at any byte, and its scales are read as fp32
    scale = payloads[:, :4 * blocks].clone(memory_format=torch.contiguous_format).view(torch.float32)
    values = torch.zeros(k, blocks * BLOCK, dtype=torch.float32, device=payloads.device)
    values[:, :numel] = payloads[:, 4 * blocks:4 * blocks + numel].view(torch.int8)
    return (values.view(k, blocks, BLOCK) * scale.unsqueeze(2)).view(k, blocks * BLOCK)[:, :numel]


def quantize_rows_with_feedback(rows: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """:func:`quantize_with_feedback` for each row of the 2-D ``rows``, with ``error`` (fp32) of the same shape. The
    entries of a block sent non-finite are reset to zero in ``error``: they hold no rounding to carry over."""
    target = rows.to(torch.float32) + error
    payloads, sent = quantize_rows(target)
    torch.sub(target, sent, out=error)
    error.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    return payloads


def check_split(what: str, numel: int, ranks: int, part: int | None = None) -> None:
    """Raise a ``ValueError`` naming ``numel`` and ``ranks`` unless a buffer of ``numel`` elements splits into
    ``ranks`` equal slices (of ``part`` elements, when given)."""
    if numel % ranks != 0 or (part is not None and numel != ranks * part):
        wanted = f"{ranks} slices of {part} elements ({ranks * part})" if part is not None else f"a multiple of {ranks}"
        raise ValueError(f"a quantized {what} over {ranks} ranks splits its buffer into {ranks} equal slices: it"
                         f" holds {numel} elements, which is not {wanted}. Pad the buffer to a multiple of {ranks}.")


def all_gather(out: torch.Tensor, shard: torch.Tensor, group, ranks: int) -> None:
    """``out`` (``ranks`` shards in rank order) from every rank's quantized ``shard``; this rank's slot too holds the
    dequantized values, so every rank holds the same. ``shard`` may be a view of ``out``."""
    s = shard.numel()
    check_split("all-gather", out.numel(), ranks, s)
    mine = quantize(shard)
    gathered = torch.empty(ranks * mine.numel(), dtype=torch.uint8, device=mine.device)
    compat.all_gather_single(gathered, mine, group=group)
    out.view(ranks, s).copy_(dequantize_rows(gathered.view(ranks, mine.numel()), s))


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, group, ranks: int, index: int,
                   error: torch.Tensor | None = None) -> None:
    """``out``: slice ``index`` of ``full`` summed over the ranks, each peer's slice sent quantized (one all-to-all),
    this rank's own added exact, the sum in fp32. ``error`` (fp32, ``full``'s size): error feedback for the slices
    sent (:func:`quantize_with_feedback`); this rank's own slice is never rounded."""
    s = out.numel()
    check_split("reduce-scatter", full.numel(), ranks, s)
    if error is not None and error.numel() != full.numel():
        raise ValueError(f"the error feedback buffer holds {error.numel()} elements, the reduced one {full.numel()}")
    rows = full.view(ranks, s)
    peers = torch.cat([rows[:index], rows[index + 1:]])
    if error is None:
        payloads = quantize_rows(peers)[0]
    else:
        fed = error.view(ranks, s)
        peer_error = torch.cat([fed[:index], fed[index + 1:]])
        payloads = quantize_rows_with_feedback(peers, peer_error)
        fed[:index], fed[index + 1:] = peer_error[:index], peer_error[index:]
    # this rank's own slot travels empty: its slice is added exact, not from what comes back
    own = torch.empty(1, payload_bytes(s), dtype=torch.uint8, device=full.device)
    send = torch.cat([payloads[:index], own, payloads[index:]]).view(-1)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    received = dequantize_rows(recv.view(ranks, payload_bytes(s)), s)
    total = rows[index].to(torch.float32, copy=True)
    # one rank after another, in rank order: one sum over the ranks may add them in another order and round otherwise
    for r in range(ranks):
        if r != index:
            total += received[r]
    out.copy_(total)


def all_reduce(tensor: torch.Tensor, group, ranks: int, index: int, error: torch.Tensor | None = None) -> None:
    """``tensor`` summed over the ranks: a quantized reduce-scatter (with ``error`` feedback), then a quantized
    all-gather of the sums."""
    check_split("all-reduce", tensor.numel(), ranks)
    s = tensor.numel() // ranks
    part = torch.empty(s, dtype=tensor.dtype, device=tensor.device)
    reduce_scatter(part, tensor, group, ranks, index, error)
    all_gather(tensor, part, group, ranks)
