"""The start-up link probe: timed all-gathers and reduce-scatters on every link class, fitted to alpha and beta, and
each link's overlap with compute (collective: every rank runs it at once, and every rank gets the same figures).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

from lightning_paro.planner.inputs import UNUSED_LINK, Cluster, Link
from lightning_paro.planner.phases import gather_phases, seconds
from lightning_paro.strategy.levels import Level

OVERLAP_WINDOW_S = 0.1
"""The probe times a link's overlap with compute over at least this long (at most 64 large all-gathers)."""

PILOT_BYTES = 2**20
"""Size of the one all-gather per link class whose time sizes the large ones (well above the buffers a link absorbs
at its full rate: a 256 KiB pilot measured the emulated NIC's token bucket, 7x its rate)."""

TARGET_TRANSFER_S = 0.1
"""A large all-gather moves what the pilot's bandwidth moves in this long (within its bounds)."""

OVERLAP_REPEATS = 3
"""Timings of a link's transfers and compute together; the probe takes the median overlap over them (one varies by
tens of percent on a machine whose processors the ranks share)."""

PILOT_REPEATS = 3
"""Fewest timings of the pilot all-gather per link class; the probe takes their minimum."""

CHECK_REPEATS = 3
"""Timings of the large all-gather per link class in the probe and in a link cache's check (the least counts)."""

PILOT_WINDOW_S = 0.05
"""Pilot gathers are timed until they fill this long (at most 32): a 2 ms pilot on processors the ranks share varied
5x between its median of three in one job and in the next; the least of many is what the link does when nothing
else is in the way."""


@dataclass(frozen=True)
class MeasuredLinks:
    """Links as measured by :func:`probe_links` (the same on every rank)."""

    intra: Link
    """Intra-group links (``UNUSED_LINK`` when m = 1), with the measured ``overlap``."""
    inter: Link
    """Inter-group links (``UNUSED_LINK`` when g = 1), with the measured ``overlap``."""
    reduce_scatter_factor: float = 1.0
    """A large intra-group reduce-scatter's time over the same all-gather's (the backend's collectives; rail ones are
    HO-Ring's); 1 when nothing was measured."""
    hierarchical_factor: float = 1.0
    """A global (HO-Ring) all-gather's time over what the two links predict for it; 1 when not measured (m = 1 or
    g = 1)."""
    check_bytes: tuple[int, int] = (0, 0)
    """Buffer size of the probe's large all-gather on the intra- and inter-group links (0 where unused)."""
    check_seconds: tuple[float, float] = (0.0, 0.0)
    """Least of ``CHECK_REPEATS`` timings of that all-gather (each rank's least, the slowest rank's counting; 0 where
    unused): what a later job times again before it reuses these figures (``link_cache.py``)."""


def overlap_from_times(compute: float, comm: float, both: float) -> float:
    """The share of ``comm`` that hid behind ``compute`` when both ran at once (``both`` seconds), in [0, 1].

    1: ``both`` took as long as the longer of the two (the transfer needs none of the processor the compute runs on);
    0: as long as their sum or longer (it needed it all the time, or the two slowed each other down further).
    """
    shorter = min(compute, comm)
    if shorter <= 0:
        return 1.0
    return min(1.0, max(0.0, (compute + comm - both) / shorter))


def fit_link(ranks: int, small_bytes: float, small_seconds: float, large_bytes: float, large_seconds: float) -> Link:
    """Alpha and beta from the times of two ring all-gathers over ``ranks`` ranks (full buffer sizes in bytes).

    ``t = (k - 1) alpha + (k - 1) / k * S / beta``: the bandwidth from the difference, the latency from the rest
    of the small one. If noise makes the large gather no slower than the small one, the large one alone gives the
    bandwidth and the latency is taken as 0.
    """
    k = ranks
    share = (k - 1) / k
    if large_seconds > small_seconds and large_bytes > small_bytes:
        bandwidth = share * (large_bytes - small_bytes) / (large_seconds - small_seconds)
        latency = max(0.0, small_seconds - share * small_bytes / bandwidth) / (k - 1)
        return Link(bandwidth, latency)
    return Link(share * large_bytes / max(large_seconds, 1e-9), 0.0)


def large_gather_bytes(pilot_bytes: float, pilot_seconds: float, small_seconds: float, target_seconds: float,
                       most_bytes: float) -> int:
    """Buffer size of the probe's large all-gathers: the buffer the pilot's bandwidth (over its time beyond the small
    gather's, all latency) gathers in ``target_seconds``, at least the pilot's size and at most ``most_bytes``. A
    ring all-gather puts the same share of its buffer on each rank's link at every size, so the buffer scales with
    the time directly."""
    per_second = pilot_bytes / max(pilot_seconds - small_seconds, 1e-9)
    return int(min(most_bytes, max(pilot_bytes, per_second * target_seconds)))


def _elements(nbytes: float, ranks: int) -> int:
    """fp32 elements of an all-gather of about ``nbytes`` over ``ranks`` ranks (a multiple of ``ranks``, at least one
    per rank)."""
    return max(1, int(nbytes) // (4 * ranks)) * ranks


@dataclass(frozen=True)
class _MatmulLoop:
    """The probe's stand-in for compute: ``count`` square matmuls; calling it runs them and returns the seconds."""

    x: Any
    y: Any
    count: int

    def __call__(self) -> float:
        import torch

        _synchronize(self.x.device)
        started = time.perf_counter()
        for _ in range(self.count):
            torch.mm(self.x, self.x, out=self.y)
        _synchronize(self.x.device)
        return time.perf_counter() - started


def _matmuls(device, seconds_wanted: float, group) -> _MatmulLoop:
    """A compute loop of square matmuls that takes about ``seconds_wanted`` while every rank of ``group`` runs it at
    once, the slowest rank's time counting; the same loop on every rank (collective: call on every rank of ``group``).

    Sized together, not on one rank alone: ranks that share processors (CPU processes on one machine) each compute
    slower together than alone, and an overlap timed against compute much longer than the transfers it hides reads
    mostly noise.
    """
    import torch
    import torch.distributed as dist

    size = 1024 if device.type == "cuda" else 192
    x = torch.randn(size, size, device=device)
    loop = _MatmulLoop(x, torch.empty_like(x), 1)
    loop()  # warm-up
    one = max(dataclasses.replace(loop, count=4)() / 4, 1e-7)
    # one count for every rank: the largest first guess, then scaled by how long it took with all of them at once
    figure = torch.tensor([float(max(1, round(seconds_wanted / one)))], dtype=torch.float64, device=device)
    dist.all_reduce(figure, op=dist.ReduceOp.MAX, group=group)
    loop = dataclasses.replace(loop, count=int(figure.item()))
    dist.barrier(group=group)
    figure = torch.tensor([loop()], dtype=torch.float64, device=device)
    dist.all_reduce(figure, op=dist.ReduceOp.MAX, group=group)
    return dataclasses.replace(loop, count=max(1, round(loop.count * seconds_wanted / max(figure.item(), 1e-9))))


def _slowest(seconds: float, device, group) -> float:
    """The largest of every rank's ``seconds`` (collective over ``group``)."""
    import torch
    import torch.distributed as dist

    figure = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(figure, op=dist.ReduceOp.MAX, group=group)
    return figure.item()


def _timed(run, count: int, device, group, warm_up: bool = False) -> float:
    """Mean seconds of ``count`` calls of ``run`` on this rank, every rank of ``group`` starting at once."""
    import torch.distributed as dist

    if warm_up:  # connections, allocations
        run()
    _synchronize(device)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(count):
        run()
    _synchronize(device)
    return (time.perf_counter() - start) / count


def _gather_buffers(nbytes: float, ranks: int, device):
    """Output and input of an all-gather of about ``nbytes`` over ``ranks`` ranks."""
    import torch

    elems = _elements(nbytes, ranks)
    return (torch.empty(elems, dtype=torch.float32, device=device),
            torch.ones(elems // ranks, dtype=torch.float32, device=device))


def _pilot(comm, scope: str, ranks: int, device, world) -> float:
    """The least, over ``PILOT_REPEATS`` timings or as many as fill ``PILOT_WINDOW_S`` (at most 32), of the slowest
    rank's time for one ``PILOT_BYTES`` all-gather on ``scope`` (the count from the first timing, the same on every
    rank)."""
    out, shard = _gather_buffers(PILOT_BYTES, ranks, device)

    def once() -> float:
        return _slowest(_timed(lambda: comm.all_gather(out, shard, scope), 1, device, world), device, world)

    first = once()
    count = min(32, max(PILOT_REPEATS, math.ceil(PILOT_WINDOW_S / max(first, 1e-9))))
    return min([first, *(once() for _ in range(count - 1))])


def _link_scopes(topology) -> list[tuple[str, int]]:
    return [("intra", topology.group_size), ("inter", topology.num_groups)]


def _probe_communicator(topology, chunk_bytes: int | None):
    """A communicator of the probe's own (its traffic on a meter of its own), running HO-Ring with ``chunk_bytes``
    chunks (None: the default)."""
    from lightning_paro.comm.accounting import TrafficMeter
    from lightning_paro.comm.collectives import HOR_EXACT_SCOPES, Communicator

    ho_ring = HOR_EXACT_SCOPES if chunk_bytes is None else dataclasses.replace(HOR_EXACT_SCOPES,
                                                                              chunk_bytes=chunk_bytes)
    return Communicator(topology, TrafficMeter(), ho_ring_config=ho_ring)


def check_seconds(topology, check_bytes: tuple[int, int], device=None, chunk_bytes: int | None = None,
                  repeats: int = CHECK_REPEATS) -> tuple[float, float]:
    """The probe's large all-gathers (``check_bytes`` per link class, 0: unused) timed again the way the probe timed
    them (each rank's least of ``repeats``, the slowest rank's counting), after a small gather for the connections and
    one untimed gather of the size on each: the check that links measured earlier still hold (collective: call on
    every rank; every rank gets the same figures). A 10-100 ms gather is timed, not the 1-3 ms pilot: on processors
    the ranks share, the pilot's least time moved up to 2.7x from one job to the next over the same links."""
    import torch
    import torch.distributed as dist

    device = torch.device(device) if device is not None else torch.device("cpu")
    world = topology.groups.world
    comm = _probe_communicator(topology, chunk_bytes)
    figures = []
    try:
        for (scope, k), nbytes in zip(_link_scopes(topology), check_bytes):
            if k == 1 or nbytes <= 0:
                figures.append(0.0)
                continue
            out, shard = _gather_buffers(4 * 2**10, k, device)
            comm.all_gather(out, shard, scope)  # connections
            out, shard = _gather_buffers(nbytes, k, device)
            # one untimed gather of the size first: a job's first large gathers ran 1.2-2x slower than its later ones
            # (8 CPU processes on 2 cores), and the probe's come after its small and pilot gathers
            figures.append(min(_timed(lambda: comm.all_gather(out, shard, scope), 1, device, world, warm_up=i == 0)
                               for i in range(repeats)))
    finally:
        comm.close()
    reduced = torch.tensor(figures, dtype=torch.float64, device=device)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=world)
    intra, inter = reduced.tolist()
    return intra, inter


def probe_links(topology, device=None, large_bytes: int = 4 * 2**20, small_bytes: int = 4 * 2**10,
                repeats: int = 3, chunk_bytes: int | None = None, global_bytes: int | None = None,
                target_seconds: float = TARGET_TRANSFER_S) -> MeasuredLinks:
    """Measure intra- and inter-group links with a few all-gathers (collective: call on every rank).

    All groups (and all rails) gather at the same time, as in training, so the figures are what one rank gets while
    every rank communicates. Per link class: one warm-up gather, then ``repeats`` timed gathers of ``small_bytes``
    and of a large size, the slowest rank's mean counting (each large gather timed alone, every rank starting it at
    once; the least of the first ``CHECK_REPEATS`` is kept as ``check_seconds``). The large size is sized to the link: a pilot gather of
    ``PILOT_BYTES`` (the least of ``PILOT_REPEATS`` timings or more) gives a first bandwidth, and the large gather is what that
    bandwidth moves in ``target_seconds``, at least ``PILOT_BYTES`` and at most ``large_bytes`` (a slow link is timed
    on a smaller buffer, so the probe's cost stays about the same on every cluster). Intra-group, ``repeats``
    reduce-scatters of the large size give the ``reduce_scatter_factor``. A link's ``overlap`` is the median of
    :func:`overlap_from_times` over ``OVERLAP_REPEATS`` timings of a run of large all-gathers issued on the engine's
    communication thread while every rank runs matmuls sized to last as long (``OVERLAP_WINDOW_S`` or more), against
    one timing of each alone, every rank at once. With several groups of several ranks, one warm-up and ``repeats``
    all-gathers of ``global_bytes`` (default: 4 x the inter-group large size, enough chunks for the pipeline to fill)
    over the whole world run as the engine runs them (an HO-Ring with ``chunk_bytes`` chunks), and their time over
    the links' prediction is the ``hierarchical_factor``. The probe's traffic goes to a meter of its own.
    """
    import torch
    import torch.distributed as dist

    device = torch.device(device) if device is not None else torch.device("cpu")
    world = topology.groups.world
    scopes = _link_scopes(topology)
    hierarchical = topology.group_size > 1 and topology.num_groups > 1
    comm = _probe_communicator(topology, chunk_bytes)

    def timed(run, count: int, warm_up: bool = False) -> float:
        return _timed(run, count, device, world, warm_up)

    def slowest(seconds: float) -> float:
        return _slowest(seconds, device, world)

    def beside(compute, count: int, out, shard, scope) -> float:
        """Seconds until ``count`` all-gathers issued on the communication thread (none: 0) and ``compute`` (None:
        nothing) are all done, every rank starting at once."""
        _synchronize(device)
        dist.barrier(group=world)
        start = time.perf_counter()
        handles = [comm.all_gather(out, shard, scope, async_op=True) for _ in range(count)]
        if compute is not None:
            compute()
        for handle in handles:
            handle.wait()
        _synchronize(device)
        return time.perf_counter() - start

    per_scope = 8 + OVERLAP_REPEATS
    times = []  # per scope: large size, pilot, small all-gather, large all-gather (mean, then least), large
    #             reduce-scatter (intra only),
    #             the overlap's gathers alone and compute alone (per gather), then the two together, repeated
    large_sizes = {}
    try:
        for scope, k in scopes:
            if k == 1:
                times += [0.0] * per_scope
                continue
            out, shard = _gather_buffers(small_bytes, k, device)
            small = timed(lambda: comm.all_gather(out, shard, scope), repeats, warm_up=True)
            # sized from the slowest rank's figures, so that every rank gathers the same size
            pilot = _pilot(comm, scope, k, device, world)
            nbytes = large_gather_bytes(4 * _elements(PILOT_BYTES, k), pilot, slowest(small), target_seconds,
                                        large_bytes)
            large_sizes[scope] = nbytes
            out, shard = _gather_buffers(nbytes, k, device)
            each = [timed(lambda: comm.all_gather(out, shard, scope), 1) for _ in range(max(repeats, CHECK_REPEATS))]
            large, least = statistics.fmean(each), min(each[:CHECK_REPEATS])
            # the factor is the intra-group backend's; rail reduce-scatters are HO-Ring's, at the ideal volume
            reduce = timed(lambda: comm.reduce_scatter(shard, out, scope), repeats) if scope == "intra" else 0.0
            times += [float(nbytes), pilot, small, large, least, reduce]
            # overlap: enough large gathers (the same number on every rank) to fill OVERLAP_WINDOW_S
            slowest_gather = slowest(large)
            count = min(64, math.ceil(OVERLAP_WINDOW_S / max(slowest_gather, 1e-9)))
            # as long as the gathers while every rank computes (the same loop on every rank)
            compute = _matmuls(device, count * slowest_gather, group=world)
            times += [beside(None, count, out, shard, scope) / count, beside(compute, 0, out, shard, scope) / count]
            times += [beside(compute, count, out, shard, scope) / count for _ in range(OVERLAP_REPEATS)]
        if hierarchical:
            out, shard = _gather_buffers(global_bytes or 4 * large_sizes["inter"], topology.world_size, device)
            # timed as often as the links: one timing read 0.86-1.63 of the links' prediction where three read 0.82-1.09
            times += [float(out.numel()), timed(lambda: comm.all_gather(out, shard, "global"), repeats, warm_up=True)]
    finally:
        comm.close()
    reduced = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=world)
    t = reduced.tolist()
    links, factors, checks = [], [], []
    for i, (scope, k) in enumerate(scopes):
        if k == 1:
            links.append(UNUSED_LINK)
            checks.append((0, 0.0))
            continue
        nbytes, pilot, small, large, least, reduce, gathers, compute, *together = t[per_scope * i:per_scope * (i + 1)]
        elems_small, elems_large = _elements(small_bytes, k), _elements(nbytes, k)
        overlap = statistics.median(overlap_from_times(compute, gathers, both) for both in together)
        links.append(dataclasses.replace(fit_link(k, 4 * elems_small, small, 4 * elems_large, large), overlap=overlap))
        checks.append((int(nbytes), least))
        if scope == "intra":
            factors.append(reduce / large if large > 0 else 1.0)
    factor = 1.0
    if hierarchical:
        global_elems, measured = t[per_scope * len(scopes):]  # after the timings of each scope
        cluster = Cluster(topology.world_size, topology.group_size, links[0], links[1], 1.0,
                          chunk_bytes=comm.ho_ring_config.chunk_bytes)
        predicted = seconds(gather_phases(Level.G, 4 * int(global_elems), cluster), cluster)
        if predicted > 0 and measured > 0:
            factor = min(4.0, max(0.25, measured / predicted))  # clamped: a noisy probe must not dominate the plan
    return MeasuredLinks(intra=links[0], inter=links[1], reduce_scatter_factor=max(factors, default=1.0),
                         hierarchical_factor=factor, check_bytes=(checks[0][0], checks[1][0]),
                         check_seconds=(checks[0][1], checks[1][1]))


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
