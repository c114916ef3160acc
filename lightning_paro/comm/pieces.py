"""All-gather and reduce-scatter of one flat buffer, issued in pieces so the backend's staging copy is one piece.

gloo (the CPU backend) runs ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` through a flat temporary as large
as the whole gathered (or scattered) buffer: gathering one unit of parameters on the CPU briefly holds it twice. The
engine gathers and reduces a unit at a time precisely to bound what is alive, so on the CPU these collectives go in
pieces of ``piece_bytes`` of the full buffer: piece ``[a, b)`` of every rank's shard at once, through the list forms
of the collectives, whose outputs (inputs) are the ranks' slices of the flat buffer. The bytes on the wire and the
result are those of the single call. NCCL writes into the output as it is and gets the single call.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from lightning_paro import compat

DEFAULT_PIECE_BYTES = 2 * 2**20
"""A piece where no HO-Ring chunk size is configured: the same 2 MiB."""


def _pieces(buffer: torch.Tensor, shard_numel: int, ranks: int, piece_bytes: int) -> list[tuple[int, int]]:
    """The ranges ``[a, b)`` of each rank's shard that make one piece of at most ``piece_bytes`` of the full
    buffer; empty where the single collective is right (not the CPU, or the buffer is one piece)."""
    step = max(1, min(shard_numel, piece_bytes // (ranks * buffer.element_size())))
    if not stages_whole_buffer(buffer) or step >= shard_numel:
        return []
    return [(a, min(shard_numel, a + step)) for a in range(0, shard_numel, step)]


def stages_whole_buffer(tensor: torch.Tensor) -> bool:
    """Whether the backend that carries ``tensor`` stages a flat collective through a full-size copy (gloo: CPU)."""
    return tensor.device.type == "cpu"


def all_gather(out: torch.Tensor, shard: torch.Tensor, group, ranks: int, piece_bytes: int) -> None:
    """``out`` (``ranks`` shards, in rank order) gathered from every rank's ``shard``, in pieces on the CPU."""
    _in_pieces(out, shard, ranks, piece_bytes, lambda: compat.all_gather_single(out, shard, group=group),
               lambda rows, part: dist.all_gather(rows, part, group=group))


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, group, ranks: int, piece_bytes: int) -> None:
    """``out``: this rank's shard of ``full`` summed over the ranks, in pieces on the CPU."""
    _in_pieces(full, out, ranks, piece_bytes, lambda: compat.reduce_scatter_single(out, full, group=group),
               lambda rows, part: dist.reduce_scatter(part, rows, group=group))


def _in_pieces(full: torch.Tensor, shard: torch.Tensor, ranks: int, piece_bytes: int, whole: Callable[[], None],
               piece: Callable[[list[torch.Tensor], torch.Tensor], None]) -> None:
    """One collective over ``full`` (``ranks`` shards of ``shard``'s size, in rank order): ``whole()`` where the
    single call is right (:func:`_pieces`), else ``piece(rows, part)`` for each piece ``[a, b)``, ``rows`` being every
    rank's slice ``[a, b)`` of ``full`` (views, in rank order) and ``part`` that slice of ``shard``."""
    pieces = _pieces(full, shard.numel(), ranks, piece_bytes)
    if not pieces:
        whole()
        return
    rows = full.view(ranks, shard.numel())
    for a, b in pieces:
        piece(list(rows[:, a:b].unbind(0)), shard[a:b])
