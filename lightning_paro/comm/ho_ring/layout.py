"""The PaRO buffer layout and HO-Ring's chunk plans: pure index maths on element ranges, no tensors and no groups.

A flat buffer of L elements is split into m *intra blocks*, each split into g *sub-blocks*; the rank at position
(i, j) (group i, local index j) owns sub-block i of intra block j (the PaRO design, section 4). When n does not
divide L the splits are as even as possible, the first parts one element longer (like :func:`torch.tensor_split`);
:func:`shard_range` tells each rank where its shard lies.

A *chunk plan* cuts a collective into the pieces its pipeline moves one at a time: ``chunks[k][j][i]`` is the part of
sub-block i of intra block j that chunk k carries (rails: ``chunks[k][q]``, the part of sub-block q).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from lightning_paro.comm.topology import Topology

Range = tuple[int, int]
"""Elements ``[start, stop)`` of a flat buffer."""


def split_range(start: int, stop: int, parts: int) -> list[Range]:
    """Split ``[start, stop)`` into ``parts`` contiguous ranges, the first ``(stop - start) % parts`` one longer."""
    size, extra = divmod(stop - start, parts)
    out, a = [], start
    for p in range(parts):
        b = a + size + (1 if p < extra else 0)
        out.append((a, b))
        a = b
    return out


def layout_ranges(start: int, stop: int, group_size: int, num_groups: int) -> list[list[Range]]:
    """The PaRO layout of ``[start, stop)``: ``ranges[j][i]`` is sub-block ``i`` of intra block ``j``."""
    return [split_range(a, b, num_groups) for a, b in split_range(start, stop, group_size)]


def shard_range(numel: int, topology: Topology, position: int | None = None) -> Range:
    """Element range ``(start, stop)`` of the shard owned by ``position`` (default: this rank) in a flat buffer of
    ``numel`` elements: sub-block ``i`` of intra block ``j`` for the rank at position ``i * m + j``.

    The position is the rank itself under contiguous placement; see :func:`create_groups` for other placements.
    """
    m, g = topology.group_size, topology.num_groups
    pos = topology.rank if position is None else position
    return layout_ranges(0, numel, m, g)[pos % m][pos // m]


def _shards_by_rank(numel: int, m: int, g: int, rank_order: Sequence[int]) -> list[Range]:
    """Every global rank's shard of a ``numel``-element buffer, by rank, under placement ``rank_order``."""
    owners = layout_ranges(0, numel, m, g)
    return [owners[p % m][p // m] for p in (rank_order.index(r) for r in range(len(rank_order)))]


def _merged(ranges: list[Range]) -> list[Range]:
    """Adjacent ranges joined, empty ones dropped: fewer, larger messages."""
    out: list[Range] = []
    for a, b in ranges:
        if b <= a:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _size(ranges: list[Range]) -> int:
    return sum(b - a for a, b in ranges)


# ---------------------------------------------------------------------------------------------------------- plans
def _contiguous_chunks(numel: int, chunk_elems: int, m: int, g: int) -> list[list[list[Range]]]:
    """All-reduce chunks: consecutive slices of the buffer, each laid out on its own (blocks stay contiguous)."""
    return [layout_ranges(a, min(a + chunk_elems, numel), m, g) for a in range(0, numel, chunk_elems)]


def _layout_chunks(numel: int, piece_elems: int, m: int, g: int) -> list[list[list[Range]]]:
    """Reduce-scatter / all-gather chunks: chunk k is the k-th piece of every sub-block, so each chunk is a
    self-contained collective with the same owners as the whole buffer."""
    full = layout_ranges(0, numel, m, g)
    longest = max(b - a for blocks in full for a, b in blocks)
    chunks = []
    for k in range(math.ceil(longest / piece_elems)):
        lo = k * piece_elems
        chunks.append([[(min(a + lo, b), min(a + lo + piece_elems, b)) for a, b in blocks] for blocks in full])
    return chunks


def _rail_contiguous_chunks(numel: int, chunk_elems: int, g: int) -> list[list[Range]]:
    """Rail all-reduce chunks: :func:`_contiguous_chunks` of a buffer that is one intra block."""
    return [blocks[0] for blocks in _contiguous_chunks(numel, chunk_elems, 1, g)]


def _rail_chunks(numel: int, chunk_elems: int, g: int) -> list[list[Range]]:
    """Rail reduce-scatter / all-gather chunks: :func:`_layout_chunks` of a buffer that is one intra block."""
    return [blocks[0] for blocks in _layout_chunks(numel, max(1, chunk_elems // g), 1, g)]


@dataclass(frozen=True)
class _Sent:
    """Elements the rank at (i, j) sends in each phase of a chunk plan (times the element size: bytes)."""

    intra_scatter: int
    """Every other rank's intra block, to that rank, in the intra reduce-scatter."""
    inter_scatter: int
    """Every other group's sub-block of its own intra block, to that group, in the inter reduce-scatter."""
    inter_gather: int
    """Its own sub-block, once to each other group, in the inter all-gather."""
    intra_gather: int
    """Its own intra block, once to each other rank of its group, in the intra all-gather."""


def _sent(chunks: list[list[list[Range]]], m: int, g: int, i: int, j: int) -> _Sent:
    """What the rank at (i, j) sends in each phase of ``chunks``, each piece exactly once: the ideal volumes."""
    return _Sent(intra_scatter=sum(_size(c[p]) for c in chunks for p in range(m) if p != j),
                 inter_scatter=sum(_size([c[j][q]]) for c in chunks for q in range(g) if q != i),
                 inter_gather=(g - 1) * sum(_size([c[j][i]]) for c in chunks),
                 intra_gather=(m - 1) * sum(_size(c[j]) for c in chunks))
