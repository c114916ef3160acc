"""HO-Ring's public collectives: all-reduce, reduce-scatter and all-gather over the world, and over one rail.

A global collective over n = g groups x m ranks runs as phases over cheaper groups (the intra reduce-scatter, the
inter reduce-scatter and all-gather over the rail, the intra all-gather), chunk by chunk, each phase on its own
groups and thread (:mod:`~lightning_paro.comm.ho_ring.pipeline`); a buffer under
:attr:`~lightning_paro.comm.ho_ring.config.HORingConfig.flat_below_bytes` runs as one flat step over the world. A rail
collective is the inter phase alone, for buffers that already live on one rail (PaRO's level-I blocks): the same
point-to-point exchanges, duplex groups and chunks in flight as inside a global collective, and the same phase
threads, so rail and global collectives keep one order on every rank. Rail position q owns sub-block q of the buffer
(equal parts when g divides it, as the backend's reduce_scatter_tensor / all_gather_into_tensor lay them out).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from lightning_paro.comm.accounting import INTER, INTRA, TrafficMeter, ring_bytes
from lightning_paro.comm.ho_ring.config import DEFAULT_CONFIG, HORingConfig, ReduceOp, _check_op
from lightning_paro.comm.ho_ring.exchanges import _gather_stage, _scatter_stage, _view
from lightning_paro.comm.ho_ring.groups import HORingGroups, _groups_for, _rail_groups
from lightning_paro.comm.ho_ring.layout import (
    Range,
    _contiguous_chunks,
    _layout_chunks,
    _merged,
    _rail_chunks,
    _rail_contiguous_chunks,
    _sent,
    _shards_by_rank,
    _size,
    layout_ranges,
    shard_range,
    split_range,
)
from lightning_paro.comm.ho_ring.pipeline import HORingWork, Stage, _Lane, _Phase, _run
from lightning_paro.comm.topology import Topology


# ---------------------------------------------------------------------------------------------------------- world
def all_reduce(tensor: torch.Tensor, topology: Topology, *, op: ReduceOp = "sum", async_op: bool = False,
               config: HORingConfig = DEFAULT_CONFIG, meter: TrafficMeter | None = None,
               groups: HORingGroups | None = None) -> HORingWork | None:
    """Reduce ``tensor`` in place over all ranks of ``topology``, hierarchically and overlapped.

    Per chunk of ``config.chunk_bytes``: reduce-scatter inside the group (rank j keeps block j of the chunk), all-reduce
    of that block over the rail (reduce-scatter to the rank's sub-block, then all-gather), all-gather inside the group.
    Per rank this sends ``2 (m-1)/m S`` bytes inside the group and ``2 (g-1)/g S/m`` on its rail, so a node's links
    carry ``2 (g-1)/g S`` instead of a flat ring's ``2 (n-1)/n S``.

    Args:
        tensor: contiguous, any shape and size (n need not divide it); overwritten with the result.
        topology: the n = g x m rank layout; every rank passes an equal one (with its own rank).
        op: ``"sum"``, or ``"avg"`` (the sum divided by n, computed once per element by the rank that owns it).
        async_op: return an :class:`HORingWork` at once instead of waiting; do not touch ``tensor`` until ``wait()``.
        config: chunk size and flat threshold; every rank must pass the same.
        meter: records the bytes this rank sends, as ``("reduce_scatter", "intra")``, ``("all_reduce", "inter")`` and
            ``("all_gather", "intra")``; a flat fallback is recorded as ``("all_reduce", "inter")``.
        groups: from :func:`create_groups`; default: contiguous placement, created on first use.

    Returns:
        The work handle when ``async_op``, else ``None``. Every rank gets the same bits.
    """
    _check_op(op)
    grp = _groups_for(topology, groups)
    n, m, g = topology.world_size, topology.group_size, topology.num_groups
    flat = _flat_1d(tensor, "all_reduce")
    es, numel = flat.element_size(), flat.numel()

    if _runs_flat(config, numel * es, n):
        _record(meter, "all_reduce", INTER, ring_bytes("all_reduce", numel * es, n))

        def run_flat(_: int, __: _Lane) -> None:
            if n > 1:
                dist.all_reduce(flat, group=grp.world)
            if op == "avg" and n > 1:
                flat.div_(n)

        return _run([(grp.flat, run_flat)], 1, grp.stall_limit, config.single_thread, flat, async_op)

    chunks = _contiguous_chunks(numel, max(1, config.chunk_bytes // es), m, g)
    stages = (_scatter_stages(grp, chunks, flat, flat, 0, flat, 0, n if op == "avg" else None)
              + _gather_stages(grp, chunks, flat))
    if meter is not None:
        sent = _sent(chunks, m, g, grp.group_index, grp.local_index)
        _record(meter, "reduce_scatter", INTRA, sent.intra_scatter * es)
        _record(meter, "all_reduce", INTER, (sent.inter_scatter + sent.inter_gather) * es)
        _record(meter, "all_gather", INTRA, sent.intra_gather * es)
    return _run(stages, len(chunks), grp.stall_limit, config.single_thread, flat, async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, topology: Topology, *, op: ReduceOp = "sum",
                   async_op: bool = False, config: HORingConfig = DEFAULT_CONFIG, meter: TrafficMeter | None = None,
                   groups: HORingGroups | None = None) -> HORingWork | None:
    """Reduce ``input`` over all ranks and write this rank's shard of the result (:func:`shard_range`) to ``output``.

    Per chunk: an intra-group reduce-scatter into this rank's intra block, then an inter reduce-scatter over the rail
    into its sub-block; chunk k is the k-th piece of every sub-block, so the two phases of different chunks overlap.
    Per rank this sends ``(m-1)/m S`` bytes inside the group and ``(g-1)/g S/m`` on its rail, the ideal volumes.

    Args:
        output: contiguous, ``shard_range(input.numel(), topology)`` long; must not overlap ``input``.
        input: contiguous, any shape and size, read only.
        topology: the n = g x m rank layout.
        op: ``"sum"`` or ``"avg"`` (divided by n).
        async_op: return an :class:`HORingWork` at once; touch neither tensor until ``wait()``.
        config: chunk size (bytes of the full buffer per chunk) and flat threshold; the same on every rank.
        meter: records bytes sent as ``("reduce_scatter", "intra")`` and ``("reduce_scatter", "inter")``; a flat
            fallback (a one-step all-to-all over the world) as ``("reduce_scatter", "inter")``.
        groups: from :func:`create_groups`; default: contiguous placement.
    """
    _check_op(op)
    grp, full, out, shard, by_rank, chunks = _global_operands(topology, groups, output, input, config, gather=False)
    n, m, g = topology.world_size, topology.group_size, topology.num_groups
    es = full.element_size()

    if by_rank is not None:
        _record(meter, "reduce_scatter", INTER, sum(_size(by_rank[r]) for r in range(n) if r != topology.rank) * es)
        run_flat = _scatter_stage(list(range(n)), topology.rank, lambda _: by_rank, full, 0, out, shard[0],
                                  n if op == "avg" and n > 1 else None)
        return _run([(grp.flat, run_flat)], 1, grp.stall_limit, config.single_thread, full, async_op)

    i, j = grp.group_index, grp.local_index
    block = layout_ranges(0, full.numel(), m, g)[j]
    # Where the intra phase leaves this rank's summed block: a scratch block, the output itself when the rail is
    # trivial (the block is the shard), or nothing when the group is trivial (the input block is already "summed").
    if m == 1:
        work, work_off = full, 0
    elif g == 1:
        work, work_off = out, shard[0]
    else:
        work, work_off = torch.empty(block[-1][1] - block[0][0], dtype=full.dtype, device=full.device), block[0][0]
    stages = _scatter_stages(grp, chunks, full, work, work_off, out, shard[0], n if op == "avg" else None)
    if meter is not None:
        sent = _sent(chunks, m, g, i, j)
        _record(meter, "reduce_scatter", INTRA, sent.intra_scatter * es)
        _record(meter, "reduce_scatter", INTER, sent.inter_scatter * es)
    return _run(stages, len(chunks), grp.stall_limit, config.single_thread, full, async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, topology: Topology, *, async_op: bool = False,
               config: HORingConfig = DEFAULT_CONFIG, meter: TrafficMeter | None = None,
               groups: HORingGroups | None = None) -> HORingWork | None:
    """Gather every rank's shard into ``output``, each at its layout position (:func:`shard_range`).

    Per chunk: an all-gather over the rail into this rank's intra block, then an all-gather inside the group; the
    received pieces land in ``output`` directly. Per rank this sends ``(g-1)/g S/m`` bytes on its rail and
    ``(m-1)/m S`` inside the group.

    Args:
        output: contiguous, the full buffer (any size); ``input`` may be a view of it at this rank's shard.
        input: contiguous, this rank's shard, ``shard_range(output.numel(), topology)`` long.
        topology: the n = g x m rank layout.
        async_op: return an :class:`HORingWork` at once; touch neither tensor until ``wait()``.
        config: chunk size and flat threshold; the same on every rank.
        meter: records bytes sent as ``("all_gather", "inter")`` and ``("all_gather", "intra")``; a flat fallback
            (every rank sends its shard to every other) as ``("all_gather", "inter")``.
        groups: from :func:`create_groups`; default: contiguous placement.
    """
    grp, full, _, _, by_rank, chunks = _global_operands(topology, groups, output, input, config, gather=True)
    n, m, g = topology.world_size, topology.group_size, topology.num_groups
    es = full.element_size()

    if by_rank is not None:
        _record(meter, "all_gather", INTER, (n - 1) * _size(by_rank[topology.rank]) * es)
        run_flat = _gather_stage(list(range(n)), topology.rank, lambda _: by_rank, full)
        return _run([(grp.flat, run_flat)], 1, grp.stall_limit, config.single_thread, full, async_op)

    stages = _gather_stages(grp, chunks, full)
    if meter is not None:
        sent = _sent(chunks, m, g, grp.group_index, grp.local_index)
        _record(meter, "all_gather", INTER, sent.inter_gather * es)
        _record(meter, "all_gather", INTRA, sent.intra_gather * es)
    return _run(stages, len(chunks), grp.stall_limit, config.single_thread, full, async_op)


# ---------------------------------------------------------------------------------------------------------- rails
def rail_reduce_scatter(output: torch.Tensor, input: torch.Tensor, groups: HORingGroups, *, op: ReduceOp = "sum",
                        async_op: bool = False, chunk_bytes: int = DEFAULT_CONFIG.chunk_bytes,
                        single_thread: bool | None = None) -> HORingWork | None:
    """Reduce ``input`` over this rank's rail (the g ranks with its local index) and write sub-block ``i`` of the
    result to ``output`` (``i``: this rank's group). Each rank sends ``(g-1)/g`` of the buffer: the ideal volume.

    Args:
        output: contiguous, sub-block ``i`` of ``input`` long; must not overlap ``input``.
        input: contiguous, read only; the same size on every rank of the rail.
        groups: from :func:`create_groups` or :func:`shared_groups`, with g > 1.
        op: ``"sum"`` or ``"avg"`` (divided by g).
        async_op: return an :class:`HORingWork` at once; touch neither tensor until ``wait()``.
        chunk_bytes: bytes of ``input`` per pipeline chunk; the same on every rank.
        single_thread: as :attr:`HORingConfig.single_thread`.
    """
    _check_op(op)
    grp = _rail_groups(groups, "reduce_scatter")
    g, i = len(grp.rail_peers), grp.group_index
    full, out, own = _operands(grp, output, input, gather=False, rail=True)
    chunks = _rail_chunks(full.numel(), max(1, chunk_bytes // full.element_size()), g)
    stage = _scatter_stage(grp.rail_peers, i, _one_each(lambda k: chunks[k]), full, 0, out, own[0],
                           g if op == "avg" else None)
    return _run([(grp.inter_scatter, stage)], len(chunks), grp.stall_limit, single_thread, full, async_op)


def rail_all_gather(output: torch.Tensor, input: torch.Tensor, groups: HORingGroups, *, async_op: bool = False,
                    chunk_bytes: int = DEFAULT_CONFIG.chunk_bytes, single_thread: bool | None = None
                    ) -> HORingWork | None:
    """Gather the sub-blocks of this rank's rail into ``output``, this rank's (``input``) at sub-block ``i``.

    Args:
        output: contiguous, the rail's full buffer; ``input`` may be a view of it at sub-block ``i``.
        input: contiguous, sub-block ``i`` long.
        groups: from :func:`create_groups` or :func:`shared_groups`, with g > 1.
        async_op: return an :class:`HORingWork` at once; touch neither tensor until ``wait()``.
        chunk_bytes: bytes of ``output`` per pipeline chunk; the same on every rank.
        single_thread: as :attr:`HORingConfig.single_thread`.
    """
    grp = _rail_groups(groups, "all_gather")
    g, i = len(grp.rail_peers), grp.group_index
    full, _, _ = _operands(grp, output, input, gather=True, rail=True)
    chunks = _rail_chunks(full.numel(), max(1, chunk_bytes // full.element_size()), g)
    stage = _gather_stage(grp.rail_peers, i, _one_each(lambda k: chunks[k]), full)
    return _run([(grp.inter_gather, stage)], len(chunks), grp.stall_limit, single_thread, full, async_op)


def rail_all_reduce(tensor: torch.Tensor, groups: HORingGroups, *, op: ReduceOp = "sum", async_op: bool = False,
                    chunk_bytes: int = DEFAULT_CONFIG.chunk_bytes, single_thread: bool | None = None
                    ) -> HORingWork | None:
    """Reduce ``tensor`` in place over this rank's rail: per chunk a reduce-scatter, then an all-gather, the two
    phases of different chunks overlapped. Each rank sends ``2 (g-1)/g`` of the buffer; every rank gets the same bits.

    Args:
        tensor: contiguous, any size; overwritten with the result.
        groups: from :func:`create_groups` or :func:`shared_groups`, with g > 1.
        op: ``"sum"`` or ``"avg"`` (divided by g, once per element by the rank that sums it).
        async_op: return an :class:`HORingWork` at once; do not touch ``tensor`` until ``wait()``.
        chunk_bytes: bytes of ``tensor`` per pipeline chunk; the same on every rank.
        single_thread: as :attr:`HORingConfig.single_thread`.
    """
    _check_op(op)
    grp = _rail_groups(groups, "all_reduce")
    flat = _flat_1d(tensor, "tensor")
    g, i = len(grp.rail_peers), grp.group_index
    chunks = _rail_contiguous_chunks(flat.numel(), max(1, chunk_bytes // flat.element_size()), g)
    pieces = _one_each(lambda k: chunks[k])
    stages = [(grp.inter_scatter, _scatter_stage(grp.rail_peers, i, pieces, flat, 0, flat, 0,
                                                 g if op == "avg" else None)),
              (grp.inter_gather, _gather_stage(grp.rail_peers, i, pieces, flat))]
    return _run(stages, len(chunks), grp.stall_limit, single_thread, flat, async_op)


# ---------------------------------------------------------------------------------------------------------- helpers
def _flat_1d(tensor: torch.Tensor, what: str) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError(f"HO-Ring needs a contiguous {what} tensor (it sends views of it): call .contiguous() first.")
    return tensor.view(-1)


def _operands(grp: HORingGroups, output: torch.Tensor, input: torch.Tensor, *, gather: bool,
              rail: bool) -> tuple[torch.Tensor, torch.Tensor, Range]:
    """The opening of a reduce-scatter (``gather=False``) or an all-gather, over the world or (``rail``) one rail:
    the full buffer and this rank's part of it, checked and flat, and the range of the full buffer the part is.

    The full buffer is the reduce-scatter's ``input`` or the all-gather's ``output``. This rank's part is its shard
    (:func:`shard_range`), or on a rail sub-block ``i`` (``i``: this rank's group). An all-gather's part is copied to
    its place in the full buffer, unless it already is a view there.
    """
    (full, full_name), (part, part_name) = ((output, "output"), (input, "input")) if gather else (
        (input, "input"), (output, "output"))
    full, part = _flat_1d(full, full_name), _flat_1d(part, part_name)
    if rail:
        own = split_range(0, full.numel(), len(grp.rail_peers))[grp.group_index]
        whose, see = f"sub-block {grp.group_index} of the {full_name}", ""
    else:
        own = shard_range(full.numel(), grp.topology, grp.position)
        whose, see = "this rank's shard", "; see shard_range()"
    if part.numel() != own[1] - own[0] or part.dtype != full.dtype:
        raise ValueError(f"{part_name} must {'be' if gather else 'hold'} {whose}: {own[1] - own[0]} elements of "
                         f"{full.dtype}, got {part.numel()} of {part.dtype}{see}.")
    if gather:
        dst = _view(full, 0, own)
        if dst.data_ptr() != part.data_ptr() and dst.numel():
            dst.copy_(part)
    return full, part, own


def _global_operands(topology: Topology, groups: HORingGroups | None, output: torch.Tensor, input: torch.Tensor,
                     config: HORingConfig, *, gather: bool
                     ) -> tuple[HORingGroups, torch.Tensor, torch.Tensor, Range,
                                list[list[Range]] | None, list[list[list[Range]]] | None]:
    """The opening of a global reduce-scatter (``gather=False``) or all-gather: the groups, the operands
    (:func:`_operands`), and how it runs: as one flat step over the world (:func:`_runs_flat`), given every rank's
    shard as its one range (``by_rank``, the chunks ``None``), or phase by phase over the layout's chunks
    (``by_rank`` ``None``)."""
    grp = _groups_for(topology, groups)
    n, m, g = topology.world_size, topology.group_size, topology.num_groups
    full, part, own = _operands(grp, output, input, gather=gather, rail=False)
    es, numel = full.element_size(), full.numel()
    if _runs_flat(config, numel * es, n):
        return grp, full, part, own, [[r] for r in _shards_by_rank(numel, m, g, grp.rank_order)], None
    return grp, full, part, own, None, _layout_chunks(numel, max(1, config.chunk_bytes // es // n), m, g)


def _runs_flat(config: HORingConfig, nbytes: int, world_size: int) -> bool:
    """Whether a global collective of ``nbytes`` runs as one flat step over the world instead of phase by phase."""
    return world_size == 1 or nbytes < config.flat_below_bytes


def _record(meter: TrafficMeter | None, op: str, scope: str, nbytes: int) -> None:
    if meter is not None and nbytes:
        meter.record(op, scope, nbytes)


def _one_each(pieces_of: Callable[[int], list[Range]]) -> Callable[[int], list[list[Range]]]:
    """Send ranges of an inter exchange: peer q gets piece q of the chunk (one sub-block each)."""
    return lambda k: [[r] for r in pieces_of(k)]


def _blocks(chunks: list[list[list[Range]]]) -> Callable[[int], list[list[Range]]]:
    """Send ranges of an intra exchange: rank p of the group gets chunk k's part of intra block p, merged."""
    return lambda k: [_merged(c) for c in chunks[k]]


def _scatter_stages(grp: HORingGroups, chunks: list[list[list[Range]]], src: torch.Tensor, work: torch.Tensor,
                    work_off: int, dst: torch.Tensor, dst_off: int,
                    divide_by: int | None) -> list[tuple[_Phase, Stage]]:
    """The reduce-scatter phases of a global collective: inside the group, from ``src`` into this rank's intra block
    (kept in ``work``, which starts at full-buffer index ``work_off``), then over the rail into its sub-block (in
    ``dst``, from index ``dst_off``). The last of them divides what it summed by ``divide_by``."""
    m, g = grp.topology.group_size, grp.topology.num_groups
    stages: list[tuple[_Phase, Stage]] = []
    if m > 1:
        stages.append((grp.intra_scatter, _scatter_stage(grp.intra_peers, grp.local_index, _blocks(chunks), src, 0,
                                                         work, work_off, divide_by if g == 1 else None)))
    if g > 1:
        sub_blocks = _one_each(lambda k: chunks[k][grp.local_index])
        stages.append((grp.inter_scatter, _scatter_stage(grp.rail_peers, grp.group_index, sub_blocks, work, work_off,
                                                         dst, dst_off, divide_by)))
    return stages


def _gather_stages(grp: HORingGroups, chunks: list[list[list[Range]]],
                   buf: torch.Tensor) -> list[tuple[_Phase, Stage]]:
    """The all-gather phases of a global collective, in place in ``buf``: over the rail into this rank's intra block,
    then inside the group."""
    m, g = grp.topology.group_size, grp.topology.num_groups
    stages: list[tuple[_Phase, Stage]] = []
    if g > 1:
        sub_blocks = _one_each(lambda k: chunks[k][grp.local_index])
        stages.append((grp.inter_gather, _gather_stage(grp.rail_peers, grp.group_index, sub_blocks, buf)))
    if m > 1:
        stages.append((grp.intra_gather, _gather_stage(grp.intra_peers, grp.local_index, _blocks(chunks), buf)))
    return stages
