"""All-gather and reduce-scatter of one flat buffer, issued in pieces so the backend's staging copy is one piece.

gloo (the CPU backend) runs ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` through a flat temporary as large
as the whole gathered (or scattered) buffer: gathering one unit of parameters on the CPU briefly holds it twice. The
engine gathers and reduces a unit at a time precisely to bound what is alive, so on the CPU these collectives go in
pieces of ``piece_bytes`` of the full buffer: piece ``[a, b)`` of every rank's shard at once, through the list forms
of the collectives, whose outputs (inputs) are the ranks' slices of the flat buffer. The bytes on the wire and the
result are those of the single call. NCCL writes into the output as it is and gets the single call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_paro import compat

DEFAULT_PIECE_BYTES = 2 * 2**20
"""A piece where no HO-Ring chunk size is configured: the same 2 MiB."""


def _piece_elements(shard_numel: int, ranks: int, element_size: int, piece_bytes: int) -> int:
    """Elements of each rank's shard per piece, so that a piece of the full buffer is at most ``piece_bytes``."""
    return max(1, min(shard_numel, piece_bytes // (ranks * element_size)))


def stages_whole_buffer(tensor: torch.Tensor) -> bool:
    """Whether the backend that carries ``tensor`` stages a flat collective through a full-size copy (gloo: CPU)."""
    return tensor.device.type == "cpu"


def all_gather(out: torch.Tensor, shard: torch.Tensor, group, ranks: int, piece_bytes: int) -> None:
    """``out`` (``ranks`` shards, in rank order) gathered from every rank's ``shard``, in pieces on the CPU."""
    size = shard.numel()
    step = _piece_elements(size, ranks, shard.element_size(), piece_bytes)
    if not stages_whole_buffer(out) or step >= size:
        compat.all_gather_single(out, shard, group=group)
        return
    rows = out.view(ranks, size)
    for a in range(0, size, step):
        b = min(size, a + step)
        dist.all_gather(list(rows[:, a:b].unbind(0)), shard[a:b], group=group)


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, group, ranks: int, piece_bytes: int) -> None:
    """``out``: this rank's shard of ``full`` summed over the ranks, in pieces on the CPU."""
    size = out.numel()
    step = _piece_elements(size, ranks, out.element_size(), piece_bytes)
    if not stages_whole_buffer(full) or step >= size:
        compat.reduce_scatter_single(out, full, group=group)
        return
    rows = full.view(ranks, size)
    for a in range(0, size, step):
        b = min(size, a + step)
        dist.reduce_scatter(out[a:b], list(rows[:, a:b].unbind(0)), group=group)
