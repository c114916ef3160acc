"""HO-Ring: hierarchical collectives whose intra- and inter-group phases overlap, chunk by chunk.

A global collective over n = g groups x m ranks is run as phases over cheaper groups:

* ``all_reduce``: intra reduce-scatter -> inter reduce-scatter -> inter all-gather -> intra all-gather,
* ``reduce_scatter``: intra reduce-scatter -> inter reduce-scatter,
* ``all_gather``: inter all-gather -> intra all-gather,

where "intra" is among the m ranks of a group (one node: fast links) and "inter" is among the g ranks of a rail (the
ranks with the same local index; every rail runs at the same time, each on its own slice). The buffer is cut into
chunks and the phases form a pipeline: while chunk k is on the inter links, chunk k+1 is in its intra reduce-scatter
and chunk k-1 in its intra all-gather. Each phase has its own worker thread and its own process groups, so the phases
of different chunks are in flight at the same time without racing each other or any other communicator. A phase
has one group per direction (lower rank to higher, and back): gloo serialises the two directions of one connection,
and an exchange over a single group would use only half of a full-duplex link. A phase also keeps two chunks in
flight, posting the messages of the next before waiting for those of the previous, so that a slow peer's last
messages do not leave the link idle.

Every phase is built from point-to-point sends of views of the caller's buffers: each rank sends every peer exactly
the slice that peer owns and sums what it receives (a one-step all-to-all). That moves the ideal volume,
``(k-1)/k`` of the data per reduce-scatter or all-gather over k ranks, with no staging copies; gloo's own
``reduce_scatter`` moves twice that. Each element of a reduction is summed by exactly one rank and then copied to the
others, so every rank ends with the same bits.

Buffer layout (the PaRO design, section 4): a flat buffer of L elements is split into m *intra blocks*, each split into
g *sub-blocks*; the rank at position (i, j) (group i, local index j) owns sub-block i of intra block j. When n does not
divide L the splits are as even as possible, the first parts one element longer (like :func:`torch.tensor_split`);
:func:`shard_range` tells each rank where its shard lies.

All ranks must issue the same HO-Ring collectives in the same order (as with any collective). Collectives issued with
``async_op=True`` may be in flight together; each phase runs its work in issue order on every rank.

**Threads.** By default each phase runs on its own thread. In single-thread mode
(:attr:`HORingConfig.single_thread`, the default for CUDA tensors) the calling thread runs the whole pipeline itself,
in one fixed interleaving of chunks and phases (:meth:`_Job.run_inline`), and posts each exchange step as one batch:
every rank then issues the same calls in the same order from one thread, which NCCL needs. Both modes give the same
bits. Do not mix the modes on the same groups while collectives of the other are in flight.

**Failures.** A failed send, receive or reduction fails its collective: the rest of that collective is neither posted
nor waited for (its chunks still pass through the later phases, unposted, so their sequence numbers keep moving and no
phase waits for a chunk that never comes), and :meth:`HORingWork.wait` raises an error naming the phase and the
chunk. Every group is created with the default process group's timeout, so a message from a peer that stopped
issuing collectives fails after that timeout; a peer that died fails its messages at once. ``wait`` also gives up
when no chunk has finished a phase for :attr:`HORingWork.stall_limit` seconds, a margin after that timeout.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from lightning_paro.comm.accounting import INTER, INTRA, TrafficMeter, ring_bytes
from lightning_paro.comm.group_cache import cached_groups, default_timeout, stall_limit
from lightning_paro.comm.topology import Topology

ReduceOp = Literal["sum", "avg"]
Range = tuple[int, int]
Stage = Callable[[int, "_Lane"], "Callable[[], None] | None"]

CHUNKS_IN_FLIGHT = 2
"""Chunks one phase has posted at a time (see ``_Phase._loop``)."""

KiB = 1024
MiB = 1024 * KiB


@dataclass(frozen=True)
class HORingConfig:
    """How HO-Ring cuts a collective into chunks, and when it falls back to a flat one."""

    chunk_bytes: int = 2 * MiB
    """Bytes of the full buffer per pipeline chunk: smaller overlaps better, larger pays less per-message overhead."""
    flat_below_bytes: int = 1 * MiB
    """Buffers smaller than this use one flat collective over the world (one latency step instead of four phases)."""
    single_thread: bool | None = None
    """Run the pipeline on the calling thread, in one fixed interleaving of chunks and phases, instead of on the
    phases' own threads; ``None`` (default): single-thread for CUDA tensors, whose NCCL calls must come from one thread
    in the same order on every rank. The results are the same bits either way."""

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be a positive number of bytes, got {self.chunk_bytes}.")
        if self.flat_below_bytes < 0:
            raise ValueError(f"flat_below_bytes must be >= 0 (0 = never flat), got {self.flat_below_bytes}.")


DEFAULT_CONFIG = HORingConfig()


# ---------------------------------------------------------------------------------------------------------- layout
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


# ---------------------------------------------------------------------------------------------------------- pipeline
class HORingWork:
    """An HO-Ring collective in flight; :meth:`wait` blocks until its result is in the output buffer."""

    def __init__(self, phases: Sequence[_Phase] = (), stall_limit: float | None = None) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._where = ""
        self._phases = tuple(phases)
        self._issued_at = time.monotonic()
        self.stall_limit = stall_limit
        """Seconds without any chunk finishing a phase after which :meth:`wait` declares the collective failed (None:
        wait as long as it takes). The phases' own waits end at the process group's timeout, sooner than this."""

    def wait(self, timeout: float | None = None) -> None:
        """Block until the collective has finished; re-raise its error if it failed.

        Raises ``TimeoutError`` after ``timeout`` seconds, and ``RuntimeError`` (naming the phase and chunk) if the
        collective failed or made no progress for ``stall_limit`` seconds.
        """
        if not self._done.is_set():
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self._done.wait(self._next_check(deadline)):
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise TimeoutError(f"HO-Ring collective not finished after {timeout} s: is every rank issuing it?")
                idle = now - self.progress_at()
                if self.stall_limit is not None and idle >= self.stall_limit:
                    self._fail(TimeoutError(f"no chunk finished a phase for {idle:.0f} s: a peer stopped issuing"
                                            " collectives, or died"), "")
                    break
        if self._error is not None:
            raise RuntimeError(f"HO-Ring collective failed{self._where}: {type(self._error).__name__}: "
                               f"{self._error}") from self._error

    def progress_at(self) -> float:
        """When a chunk last finished one of this collective's phases (any collective's, as they share phases)."""
        return max([self._issued_at] + [p.progress_at for p in self._phases])

    def _next_check(self, deadline: float | None) -> float | None:
        bounds = [] if deadline is None else [deadline - time.monotonic()]
        if self.stall_limit is not None:
            bounds.append(self.progress_at() + self.stall_limit - time.monotonic())
        return max(0.01, min(bounds)) if bounds else None

    def _fail(self, error: BaseException, where: str) -> None:
        if self._error is None:  # the first failure is the one to report; the rest follow from it
            self._error, self._where = error, where


class _Phase:
    """A worker thread that runs the chunk tasks of one phase strictly in issue order.

    Tasks reach a phase from different places (the issuing thread, or an earlier phase finishing a chunk) and at
    different times on different ranks; running them by a sequence number fixed at issue makes the order of messages on
    this phase's process group identical on every rank, so the sends of one collective never meet the receives of
    another. In single-thread mode the issuing thread runs the tasks itself (:meth:`_Job.run_inline`) and the phase
    lends only its groups and scratch buffers.
    """

    def __init__(self, name: str, new_group: Callable[[], object], ring: bool = False) -> None:
        self.name = name
        self.ring = ring
        """Exchange by a ring (k - 1 steps, one peer each way at a time) instead of all-to-all: with more than two
        peers, all-to-all opens k - 1 streams on the same link at once, and they share it less well than one does."""
        # Two groups, one per direction: gloo serialises the two directions of one connection, so an exchange over a
        # single group runs at half the link's duplex rate. Lower rank -> higher rank uses ``up``, the reverse ``down``.
        self.up = new_group()
        self.down = new_group()
        self.progress_at = 0.0
        """When a chunk last finished this phase (monotonic clock), for the waiters' stall check."""
        self._scratch: dict = {}
        self._cv = threading.Condition()
        self._ready: dict[int, tuple[_Job, int, int]] = {}
        self._next_to_run = 0
        self._next_to_reserve = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=f"ho-ring-{name}", daemon=True)
        self._thread.start()

    def scratch(self, numel: int, like: torch.Tensor, slot: int) -> torch.Tensor:
        """A reusable buffer of at least ``numel`` elements of ``like``'s dtype for the task in ``slot``; valid until
        that slot's next task."""
        key = (like.dtype, like.device, slot)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._scratch[key] = buf
        return buf

    def to(self, me: int, peer: int):
        """The group that carries messages from global rank ``me`` to ``peer`` (and that ``peer`` receives them on)."""
        return self.up if me < peer else self.down

    def reserve(self, count: int) -> int:
        """Reserve ``count`` consecutive sequence numbers (called while issuing, on the issuing thread)."""
        with self._cv:
            first = self._next_to_reserve
            self._next_to_reserve += count
            return first

    def put(self, seq: int, job: _Job, stage: int, chunk: int) -> None:
        with self._cv:
            self._ready[seq] = (job, stage, chunk)
            self._cv.notify()

    def stop(self) -> None:
        """End the worker thread once the tasks already handed to it have run."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _loop(self) -> None:
        # Up to CHUNKS_IN_FLIGHT tasks are posted before the oldest is waited for: while the last messages of chunk k
        # trickle in from the slowest peer, those of chunk k+1 already keep the link busy. Waiting for new work on the
        # condition variable is the only unbounded wait here: every task posted is completed (its message waits end
        # at the group's timeout), and a failed job still hands its chunks on, so no later task waits for one that
        # never comes.
        in_flight: collections.deque = collections.deque()
        while True:
            task = None
            with self._cv:
                while task is None:
                    if self._next_to_run in self._ready and len(in_flight) < CHUNKS_IN_FLIGHT:
                        task = self._ready.pop(self._next_to_run)
                        slot = self._next_to_run % CHUNKS_IN_FLIGHT
                        self._next_to_run += 1
                    elif in_flight:
                        break
                    elif self._stopping and not self._ready:
                        return
                    else:
                        self._cv.wait()
            if task is not None:
                job, stage, chunk = task
                in_flight.append((job, stage, chunk, job.post(stage, chunk, _Lane(self, slot, batched=False))))
            else:
                job, stage, chunk, finisher = in_flight.popleft()
                job.finish(stage, chunk, finisher)


INLINE_SLOT = CHUNKS_IN_FLIGHT
"""First slot of single-thread exchanges (one per stage): their tags and scratch never meet the phase threads'."""


class _Lane:
    """Where one exchange posts its messages: a phase's groups, and a slot that keeps the exchange's tags and scratch
    apart from those of the phase's other exchanges in flight.

    ``batched`` (single-thread mode) posts each step of an exchange as one ``batch_isend_irecv`` on the phase's
    ``up`` group: NCCL matches the sends and receives of a batch together, where separate calls to several peers over
    one communicator can wait on each other in a cycle. Otherwise each message goes on the group of its direction.
    """

    __slots__ = ("phase", "slot", "batched")

    def __init__(self, phase: _Phase, slot: int, batched: bool) -> None:
        self.phase, self.slot, self.batched = phase, slot, batched

    def scratch(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        return self.phase.scratch(numel, like, self.slot)

    def post(self, me: int, messages: list[tuple[bool, torch.Tensor, int, int]]) -> list:
        """Post ``(is_send, tensor, peer, piece)`` messages (peers and ``me`` are global ranks); returns the works."""
        if self.batched:
            # c10d's own functions: P2POp accepts no other, even where torch.distributed's names are wrapped.
            ops = [dist.P2POp(c10d.isend if send else c10d.irecv, t, peer, group=self.phase.up,
                              tag=_tag(self.slot, piece)) for send, t, peer, piece in messages]
            return dist.batch_isend_irecv(ops) if ops else []
        return [dist.isend(t, peer, group=self.phase.to(me, peer), tag=_tag(self.slot, piece)) if send else
                dist.irecv(t, peer, group=self.phase.to(peer, me), tag=_tag(self.slot, piece))
                for send, t, peer, piece in messages]


class _Job:
    """One collective: a list of (phase, stage function) pairs, each run on every chunk in order.

    A stage function takes the chunk index and the :class:`_Lane` to post on, posts its messages and returns the
    function that completes them (or ``None``).
    """

    def __init__(self, stages: list[tuple[_Phase, Stage]], num_chunks: int, groups: HORingGroups,
                 inline: bool) -> None:
        self.stages = stages
        self.num_chunks = num_chunks
        self.inline = inline
        self.work = HORingWork([phase for phase, _ in stages], groups.stall_limit)
        self._left = num_chunks
        self._lock = threading.Lock()
        # Sequence numbers are reserved now, at issue, so every rank gives this job the same slots in every phase.
        self._first_seq = [] if inline else [phase.reserve(num_chunks) for phase, _ in stages]

    def start(self) -> HORingWork:
        if not self.stages or self.num_chunks == 0:
            self.work._done.set()
            return self.work
        if self.inline:
            self.run_inline()
            return self.work
        phase = self.stages[0][0]
        for k in range(self.num_chunks):
            phase.put(self._first_seq[0] + k, self, 0, k)
        return self.work

    def run_inline(self) -> None:
        """Single-thread mode: run the whole pipeline on the calling thread, in an order every rank shares.

        Chunk k enters stage s at tick k + s. Each tick posts the messages of all its (stage, chunk) pairs, stage by
        stage, then completes them in the same order: the phases of different chunks are on the links together, and
        every rank issues the same calls in the same sequence from one thread, which NCCL needs.
        """
        num_stages = len(self.stages)
        for tick in range(self.num_chunks + num_stages - 1):
            posted = []
            for s in range(max(0, tick - self.num_chunks + 1), min(num_stages, tick + 1)):
                lane = _Lane(self.stages[s][0], INLINE_SLOT + s, batched=True)
                posted.append((s, tick - s, self.post(s, tick - s, lane)))
            for s, k, finisher in posted:
                self._complete(s, k, finisher)
        self.work._done.set()

    def post(self, stage: int, chunk: int, lane: _Lane) -> Callable[[], None] | None:
        """Start ``stage`` on ``chunk``; returns what completes it (``None`` if nothing is left to do)."""
        if self.work._error is None:
            try:
                return self.stages[stage][1](chunk, lane)
            except BaseException as err:  # surfaced by HORingWork.wait
                self.work._fail(err, self._where(stage, chunk))
        return None

    def finish(self, stage: int, chunk: int, finisher: Callable[[], None] | None) -> None:
        """Complete ``stage`` on ``chunk`` and hand the chunk to the next stage (phase-thread mode)."""
        self._complete(stage, chunk, finisher)
        # A failed job still passes its chunks on, so later phases keep their sequence numbers moving.
        if stage + 1 < len(self.stages):
            self.stages[stage + 1][0].put(self._first_seq[stage + 1] + chunk, self, stage + 1, chunk)
            return
        with self._lock:
            self._left -= 1
            finished = self._left == 0
        if finished:
            self.work._done.set()

    def _complete(self, stage: int, chunk: int, finisher: Callable[[], None] | None) -> None:
        # After a failure the job's remaining messages are neither posted nor waited for: their peers may be gone.
        if finisher is not None and self.work._error is None:
            try:
                finisher()
            except BaseException as err:  # surfaced by HORingWork.wait
                self.work._fail(err, self._where(stage, chunk))
        self.stages[stage][0].progress_at = time.monotonic()

    def _where(self, stage: int, chunk: int) -> str:
        return f" in its {self.stages[stage][0].name} phase, chunk {chunk} of {self.num_chunks}"


# ---------------------------------------------------------------------------------------------------------- groups
class HORingGroups:
    """The process groups and phase threads HO-Ring uses for one topology. Create with :func:`create_groups`."""

    def __init__(self, topology: Topology, rank_order: Sequence[int]) -> None:
        n, m = topology.world_size, topology.group_size
        order = tuple(int(r) for r in rank_order)
        if sorted(order) != list(range(n)):
            raise ValueError(f"rank_order must be a permutation of range({n}) (every rank once), got {list(order)}.")
        self.topology = topology
        self.rank_order = order
        """Global ranks in placement order: ``rank_order[i * m + j]`` is local index j of group i."""
        self.position = order.index(topology.rank)
        """This rank's place in the layout, ``i * m + j``."""
        self.group_index, self.local_index = divmod(self.position, m)
        g = topology.num_groups
        self.intra_peers = [order[self.group_index * m + p] for p in range(m)]
        """Global ranks of this rank's group, by local index."""
        self.rail_peers = [order[q * m + self.local_index] for q in range(g)]
        """Global ranks of this rank's rail, by group index."""

        # The default group's timeout bounds every wait on these groups (torch would give them 30 minutes).
        timeout = default_timeout()
        self.timeout = timeout.total_seconds()
        """Seconds a message may take before the backend gives up on it (the default process group's timeout)."""
        self.stall_limit = stall_limit(self.timeout)
        """Seconds without progress after which a waiter declares a collective failed."""

        def new_group(ranks: list[int]):
            return dist.new_group(ranks, timeout=timeout)

        # new_group is collective over the default group: every rank creates every group, in the same order.
        def one_group_each(members_of: Callable[[int], list[int]], count: int, mine: int) -> Callable[[], object]:
            """A creator of the ``count`` groups ``members_of(c)`` (collective) that returns the one this rank is in."""
            def create():
                chosen = None
                for c in range(count):
                    grp = new_group(members_of(c))
                    if c == mine:
                        chosen = grp
                return chosen
            return create

        def intra_of(i: int) -> list[int]:
            return [order[i * m + p] for p in range(m)]

        def rail_of(j: int) -> list[int]:
            return [order[q * m + j] for q in range(g)]

        self.world = new_group(list(range(n)))
        """A private world group for the flat all-reduce (gloo's ring)."""
        self.flat = _Phase("flat", lambda: new_group(list(range(n))))
        self.intra_scatter = self.inter_scatter = self.inter_gather = self.intra_gather = None
        if m > 1:
            self.intra_scatter = _Phase("intra-scatter", one_group_each(intra_of, g, self.group_index))
            self.intra_gather = _Phase("intra-gather", one_group_each(intra_of, g, self.group_index))
        if g > 1:
            self.inter_scatter = _Phase("inter-scatter", one_group_each(rail_of, m, self.local_index), ring=g > 2)
            self.inter_gather = _Phase("inter-gather", one_group_each(rail_of, m, self.local_index), ring=g > 2)

    @property
    def phases(self) -> list[_Phase]:
        return [p for p in (self.flat, self.intra_scatter, self.inter_scatter, self.inter_gather, self.intra_gather)
                if p is not None]

    def progress_at(self) -> float:
        """When a chunk last finished any phase (monotonic clock; 0 if none has yet)."""
        return max(p.progress_at for p in self.phases)

    def close(self) -> None:
        """Stop the phase threads (after the work already issued). The process groups live until the default group
        is destroyed."""
        for phase in self.phases:
            phase.stop()


def create_groups(topology: Topology, rank_order: Sequence[int] | None = None) -> HORingGroups:
    """Create HO-Ring's process groups for ``topology``; collective: every rank must call it, in the same order.

    ``rank_order`` lists the global ranks in placement order, ``rank_order[i * m + j]`` being the rank that plays local
    index j of group i; the default ``range(n)`` is contiguous placement (``rank = i * m + j``). Pass
    :func:`rank_order_by_node` when a launcher placed ranks on nodes another way (round-robin, for instance), so that
    groups are still the ranks that share a node.
    """
    return HORingGroups(topology, range(topology.world_size) if rank_order is None else rank_order)


def rank_order_by_node(node_id: str | int) -> list[int]:
    """Global ranks grouped by node: nodes in order of their lowest rank, ranks ascending within a node.

    Collective: every rank passes the id of the node it runs on (a hostname, ``NODE_RANK``...).
    """
    ids: list = [None] * dist.get_world_size()
    dist.all_gather_object(ids, node_id)
    first_rank: dict = {}
    for r, node in enumerate(ids):
        first_rank.setdefault(node, r)
    return sorted(range(len(ids)), key=lambda r: (first_rank[ids[r]], r))


def shared_groups(topology: Topology) -> HORingGroups:
    """The contiguous-placement groups for ``topology``, created on first use and shared by every caller in the
    process for as long as the default group lives (collective on first use, like :func:`create_groups`)."""
    key = ("ho-ring", topology.world_size, topology.group_size, topology.rank)
    return cached_groups(key, lambda: create_groups(topology))


def _groups_for(topology: Topology, groups: HORingGroups | None) -> HORingGroups:
    if groups is not None:
        if groups.topology != topology:
            raise ValueError(f"groups were created for {groups.topology}, not for {topology}.")
        return groups
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call init_process_group before HO-Ring collectives.")
    return shared_groups(topology)


# ---------------------------------------------------------------------------------------------------------- exchanges
def _view(buf: torch.Tensor, offset: int, r: Range) -> torch.Tensor:
    """Elements ``r`` of a full buffer, stored in ``buf`` starting at full-buffer index ``offset``."""
    return buf[r[0] - offset:r[1] - offset]


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


def _reduce_exchange(lane: _Lane, peers: list[int], me: int, send_ranges: list[list[Range]],
                     src: torch.Tensor, src_off: int, dst: torch.Tensor, dst_off: int) -> Callable[[], None]:
    """Reduce-scatter by all-to-all: send peer p the ranges ``send_ranges[p]`` of ``src``, receive ``send_ranges[me]``
    from every peer and write own + received (in peer order) into ``dst``. ``dst`` may be ``src`` (in place).

    Posts the messages on ``lane`` and returns the function that waits for them and sums.
    """
    if lane.phase.ring and all(len(r) == 1 for r in send_ranges):
        return _ring_reduce_exchange(lane, peers, me, [r[0] for r in send_ranges], src, src_off, dst, dst_off)
    mine = send_ranges[me]
    messages, received = [], []
    for p, peer in enumerate(peers):
        if p == me:
            continue
        for t, r in enumerate(send_ranges[p]):
            if r[1] > r[0]:
                messages.append((True, _view(src, src_off, r), peer, t))
    # Receive buffers come from the phase's scratch: fresh buffers would cost a page fault per page on every chunk.
    scratch = lane.scratch((len(peers) - 1) * _size(mine), src)
    used = 0
    for p, peer in enumerate(peers):
        if p == me:
            continue
        bufs = []
        for t, r in enumerate(mine):
            buf = scratch[used:used + r[1] - r[0]]
            used += r[1] - r[0]
            if r[1] > r[0]:
                messages.append((False, buf, peer, t))
            bufs.append(buf)
        received.append(bufs)
    ops = lane.post(peers[me], messages)

    def finish() -> None:
        for op in ops:
            op.wait()
        for t, r in enumerate(mine):
            own, out = _view(src, src_off, r), _view(dst, dst_off, r)
            if out.data_ptr() != own.data_ptr():
                out.copy_(own)
            for bufs in received:
                out.add_(bufs[t])

    return finish


def _gather_exchange(lane: _Lane, peers: list[int], me: int, ranges: list[list[Range]],
                     buf: torch.Tensor, off: int) -> Callable[[], None]:
    """All-gather by all-to-all: send ``ranges[me]`` of ``buf`` to every peer, receive ``ranges[p]`` from peer p
    straight into ``buf``. Posts the messages and returns the function that waits for them."""
    if lane.phase.ring and all(len(r) == 1 for r in ranges):
        return _ring_gather_exchange(lane, peers, me, [r[0] for r in ranges], buf, off)
    messages = []
    for p, peer in enumerate(peers):
        if p == me:
            continue
        for t, r in enumerate(ranges[me]):
            if r[1] > r[0]:
                messages.append((True, _view(buf, off, r), peer, t))
        for t, r in enumerate(ranges[p]):
            if r[1] > r[0]:
                messages.append((False, _view(buf, off, r), peer, t))
    ops = lane.post(peers[me], messages)

    def finish() -> None:
        for op in ops:
            op.wait()

    return finish


def _ring_reduce_exchange(lane: _Lane, peers: list[int], me: int, pieces: list[Range],
                          src: torch.Tensor, src_off: int, dst: torch.Tensor, dst_off: int) -> Callable[[], None]:
    """Reduce-scatter by a ring, the same contract as :func:`_reduce_exchange` with one range per peer.

    In step s (0 <= s < k - 1) each rank sends the next one its partial sum of piece ``me - 1 - s`` (its own values
    at s = 0) and receives the previous one's partial sum of piece ``me - 2 - s``, to which it adds its own values; at
    the last step that piece is its own, complete, written to ``dst``. Each rank sends (k - 1)/k of the data, one
    stream each way. The first step is posted now, the rest run in the returned function.
    """
    k = len(peers)
    nxt, prev = peers[(me + 1) % k], peers[(me - 1) % k]
    longest = max(b - a for a, b in pieces)
    scratch = lane.scratch(2 * longest, src)
    partial = (scratch[:longest], scratch[longest:])  # received into one while the other is sent

    def post(step: int) -> tuple[list, int, torch.Tensor]:
        send_piece, recv_piece = pieces[(me - 1 - step) % k], pieces[(me - 2 - step) % k]
        send = _view(src, src_off, send_piece) if step == 0 else partial[(step - 1) % 2][:_size([send_piece])]
        recv = partial[step % 2][:_size([recv_piece])]
        messages = []
        if send.numel():
            messages.append((True, send, nxt, step))
        if recv.numel():
            messages.append((False, recv, prev, step))
        return lane.post(peers[me], messages), (me - 2 - step) % k, recv

    first = post(0)

    def finish() -> None:
        ops, q, recv = first
        for step in range(k - 1):
            if step:
                ops, q, recv = post(step)
            for op in ops:
                op.wait()
            own = _view(src, src_off, pieces[q])
            if step < k - 2:
                recv.add_(own)
            else:  # q == me: the complete sum of this rank's piece
                torch.add(own, recv, out=_view(dst, dst_off, pieces[me]))

    return finish


def _ring_gather_exchange(lane: _Lane, peers: list[int], me: int, pieces: list[Range],
                          buf: torch.Tensor, off: int) -> Callable[[], None]:
    """All-gather by a ring, the same contract as :func:`_gather_exchange` with one range per peer: in step s each
    rank passes piece ``me - s`` on to the next rank and receives piece ``me - 1 - s`` from the previous one, straight
    into ``buf``."""
    k = len(peers)
    nxt, prev = peers[(me + 1) % k], peers[(me - 1) % k]

    def post(step: int) -> list:
        send, recv = _view(buf, off, pieces[(me - step) % k]), _view(buf, off, pieces[(me - 1 - step) % k])
        messages = []
        if send.numel():
            messages.append((True, send, nxt, step))
        if recv.numel():
            messages.append((False, recv, prev, step))
        return lane.post(peers[me], messages)

    first = post(0)

    def finish() -> None:
        ops = first
        for step in range(k - 1):
            if step:
                ops = post(step)
            for op in ops:
                op.wait()

    return finish


def _tag(slot: int, piece: int) -> int:
    # Exchanges in flight in one phase have different slots, so their messages between the same two ranks never match
    # each other's receives.
    return slot * 4096 + piece


def _then(first: Callable[[], None], then: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        first()
        then()
    return both


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


def _flat_1d(tensor: torch.Tensor, what: str) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError(f"HO-Ring needs a contiguous {what} tensor (it sends views of it): call .contiguous() first.")
    return tensor.view(-1)


def _check_op(op: str) -> None:
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}.")


def _record(meter: TrafficMeter | None, op: str, scope: str, nbytes: int) -> None:
    if meter is not None and nbytes:
        meter.record(op, scope, nbytes)


def _run(stages: list[tuple[_Phase, Stage]], num_chunks: int, groups: HORingGroups, single_thread: bool | None,
         like: torch.Tensor, async_op: bool) -> HORingWork | None:
    """Issue a collective's pipeline: on the phase threads, or run it here in single-thread mode (then it is complete
    on return)."""
    inline = like.is_cuda if single_thread is None else single_thread
    work = _Job(stages, num_chunks, groups, inline).start()
    if async_op:
        return work
    work.wait()
    return None


# ---------------------------------------------------------------------------------------------------------- collectives
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

    if n == 1 or numel * es < config.flat_below_bytes:
        _record(meter, "all_reduce", INTER, ring_bytes("all_reduce", numel * es, n))

        def run_flat(_: int, __: _Lane) -> None:
            if n > 1:
                dist.all_reduce(flat, group=grp.world)
            if op == "avg" and n > 1:
                flat.div_(n)

        return _run([(grp.flat, run_flat)], 1, grp, config.single_thread, flat, async_op)

    i, j = grp.group_index, grp.local_index
    chunks = _contiguous_chunks(numel, max(1, config.chunk_bytes // es), m, g)
    stages: list[tuple[_Phase, Stage]] = []

    def divide(k: int) -> None:
        if op == "avg":
            _view(flat, 0, chunks[k][j][i]).div_(n)

    if m > 1:
        def intra_scatter(k: int, lane: _Lane) -> Callable[[], None]:
            blocks = [_merged(c) for c in chunks[k]]
            done = _reduce_exchange(lane, grp.intra_peers, j, blocks, flat, 0, flat, 0)
            return _then(done, lambda: divide(k)) if g == 1 else done

        stages.append((grp.intra_scatter, intra_scatter))
    if g > 1:
        def inter_scatter(k: int, lane: _Lane) -> Callable[[], None]:
            subs = [[r] for r in chunks[k][j]]
            done = _reduce_exchange(lane, grp.rail_peers, i, subs, flat, 0, flat, 0)
            return _then(done, lambda: divide(k))

        def inter_gather(k: int, lane: _Lane) -> Callable[[], None]:
            return _gather_exchange(lane, grp.rail_peers, i, [[r] for r in chunks[k][j]], flat, 0)

        stages += [(grp.inter_scatter, inter_scatter), (grp.inter_gather, inter_gather)]
    if m > 1:
        def intra_gather(k: int, lane: _Lane) -> Callable[[], None]:
            return _gather_exchange(lane, grp.intra_peers, j, [_merged(c) for c in chunks[k]],
                                    flat, 0)

        stages.append((grp.intra_gather, intra_gather))

    if meter is not None:
        intra = sum(_size(c[p]) for c in chunks for p in range(m) if p != j)
        inter = sum(_size([c[j][q]]) for c in chunks for q in range(g) if q != i) + (g - 1) * sum(
            _size([c[j][i]]) for c in chunks)
        own_block = sum(_size(c[j]) for c in chunks)
        _record(meter, "reduce_scatter", INTRA, intra * es)
        _record(meter, "all_reduce", INTER, inter * es)
        _record(meter, "all_gather", INTRA, (m - 1) * own_block * es)
    return _run(stages, len(chunks), grp, config.single_thread, flat, async_op)


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
    grp = _groups_for(topology, groups)
    n, m, g = topology.world_size, topology.group_size, topology.num_groups
    full, out = _flat_1d(input, "input"), _flat_1d(output, "output")
    es, numel = full.element_size(), full.numel()
    i, j = grp.group_index, grp.local_index
    shard = shard_range(numel, topology, grp.position)
    if out.numel() != shard[1] - shard[0] or out.dtype != full.dtype:
        raise ValueError(f"output must hold this rank's shard: {shard[1] - shard[0]} elements of {full.dtype}, got "
                         f"{out.numel()} of {out.dtype}; see shard_range().")

    if n == 1 or numel * es < config.flat_below_bytes:
        owners = layout_ranges(0, numel, m, g)
        by_position = [[owners[p % m][p // m]] for p in range(n)]
        by_rank = [by_position[grp.rank_order.index(r)] for r in range(n)]
        _record(meter, "reduce_scatter", INTER, sum(_size(by_rank[r]) for r in range(n) if r != topology.rank) * es)

        def run_flat(_: int, lane: _Lane) -> Callable[[], None]:
            done = _reduce_exchange(lane, list(range(n)), topology.rank, by_rank, full, 0, out, shard[0])
            return _then(done, lambda: out.div_(n)) if op == "avg" and n > 1 else done

        return _run([(grp.flat, run_flat)], 1, grp, config.single_thread, full, async_op)

    chunks = _layout_chunks(numel, max(1, config.chunk_bytes // es // n), m, g)
    block = layout_ranges(0, numel, m, g)[j]
    # Where the intra phase leaves this rank's summed block: a scratch block, the output itself when the rail is
    # trivial (the block is the shard), or nothing when the group is trivial (the input block is already "summed").
    if m == 1:
        work, work_off = full, 0
    elif g == 1:
        work, work_off = out, shard[0]
    else:
        work, work_off = torch.empty(block[-1][1] - block[0][0], dtype=full.dtype, device=full.device), block[0][0]
    stages: list[tuple[_Phase, Stage]] = []

    def divide(k: int) -> None:
        if op == "avg":
            _view(out, shard[0], chunks[k][j][i]).div_(n)

    if m > 1:
        def intra_scatter(k: int, lane: _Lane) -> Callable[[], None]:
            done = _reduce_exchange(lane, grp.intra_peers, j, [_merged(c) for c in chunks[k]],
                                    full, 0, work, work_off)
            return _then(done, lambda: divide(k)) if g == 1 else done

        stages.append((grp.intra_scatter, intra_scatter))
    if g > 1:
        def inter_scatter(k: int, lane: _Lane) -> Callable[[], None]:
            done = _reduce_exchange(lane, grp.rail_peers, i, [[r] for r in chunks[k][j]], work,
                                    work_off, out, shard[0])
            return _then(done, lambda: divide(k))

        stages.append((grp.inter_scatter, inter_scatter))

    if meter is not None:
        intra = sum(_size(c[p]) for c in chunks for p in range(m) if p != j)
        inter = sum(_size([c[j][q]]) for c in chunks for q in range(g) if q != i)
        _record(meter, "reduce_scatter", INTRA, intra * es)
        _record(meter, "reduce_scatter", INTER, inter * es)
    return _run(stages, len(chunks), grp, config.single_thread, full, async_op)


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
    grp = _groups_for(topology, groups)
    n, m, g = topology.world_size, topology.group_size, topology.num_groups
    full, shard_in = _flat_1d(output, "output"), _flat_1d(input, "input")
    es, numel = full.element_size(), full.numel()
    i, j = grp.group_index, grp.local_index
    shard = shard_range(numel, topology, grp.position)
    if shard_in.numel() != shard[1] - shard[0] or shard_in.dtype != full.dtype:
        raise ValueError(f"input must be this rank's shard: {shard[1] - shard[0]} elements of {full.dtype}, got "
                         f"{shard_in.numel()} of {shard_in.dtype}; see shard_range().")
    own = _view(full, 0, shard)
    if own.data_ptr() != shard_in.data_ptr() and own.numel():
        own.copy_(shard_in)

    if n == 1 or numel * es < config.flat_below_bytes:
        owners = layout_ranges(0, numel, m, g)
        by_rank = [[owners[p % m][p // m]] for p in (grp.rank_order.index(r) for r in range(n))]
        _record(meter, "all_gather", INTER, (n - 1) * _size(by_rank[topology.rank]) * es)

        def run_flat(_: int, lane: _Lane) -> Callable[[], None]:
            return _gather_exchange(lane, list(range(n)), topology.rank, by_rank, full, 0)

        return _run([(grp.flat, run_flat)], 1, grp, config.single_thread, full, async_op)

    chunks = _layout_chunks(numel, max(1, config.chunk_bytes // es // n), m, g)
    stages: list[tuple[_Phase, Stage]] = []
    if g > 1:
        def inter_gather(k: int, lane: _Lane) -> Callable[[], None]:
            return _gather_exchange(lane, grp.rail_peers, i, [[r] for r in chunks[k][j]], full, 0)

        stages.append((grp.inter_gather, inter_gather))
    if m > 1:
        def intra_gather(k: int, lane: _Lane) -> Callable[[], None]:
            return _gather_exchange(lane, grp.intra_peers, j, [_merged(c) for c in chunks[k]],
                                    full, 0)

        stages.append((grp.intra_gather, intra_gather))

    if meter is not None:
        _record(meter, "all_gather", INTER, (g - 1) * sum(_size([c[j][i]]) for c in chunks) * es)
        _record(meter, "all_gather", INTRA, (m - 1) * sum(_size(c[j]) for c in chunks) * es)
    return _run(stages, len(chunks), grp, config.single_thread, full, async_op)


# ---------------------------------------------------------------------------------------------------------- rails
# The inter phase alone, for buffers that already live on one rail (PaRO's level-I blocks): the same point-to-point
# exchanges, duplex groups and chunks in flight as inside a global collective, and the same phase threads, so rail
# and global collectives keep one order on every rank. Rail position q owns sub-block q of the buffer (equal parts
# when g divides it, as the backend's reduce_scatter_tensor / all_gather_into_tensor lay them out).
def _rail_chunks(numel: int, chunk_elems: int, g: int) -> list[list[Range]]:
    return [ranges[0] for ranges in _layout_chunks(numel, max(1, chunk_elems // g), 1, g)]


def _rail_groups(groups: HORingGroups, what: str) -> HORingGroups:
    if groups.inter_scatter is None or groups.inter_gather is None:
        raise ValueError(f"rail {what} needs more than one group; with g = 1 there is no rail to run it on.")
    return groups


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
    full, out = _flat_1d(input, "input"), _flat_1d(output, "output")
    g, i = len(grp.rail_peers), grp.group_index
    own = split_range(0, full.numel(), g)[i]
    if out.numel() != own[1] - own[0] or out.dtype != full.dtype:
        raise ValueError(f"output must hold sub-block {i} of the input: {own[1] - own[0]} elements of {full.dtype}, "
                         f"got {out.numel()} of {out.dtype}.")
    chunks = _rail_chunks(full.numel(), max(1, chunk_bytes // full.element_size()), g)

    def inter_scatter(k: int, lane: _Lane) -> Callable[[], None]:
        done = _reduce_exchange(lane, grp.rail_peers, i, [[r] for r in chunks[k]], full, 0, out,
                                own[0])
        return _then(done, lambda: _view(out, own[0], chunks[k][i]).div_(g)) if op == "avg" else done

    return _run([(grp.inter_scatter, inter_scatter)], len(chunks), grp, single_thread, full, async_op)


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
    full, shard_in = _flat_1d(output, "output"), _flat_1d(input, "input")
    g, i = len(grp.rail_peers), grp.group_index
    own = split_range(0, full.numel(), g)[i]
    if shard_in.numel() != own[1] - own[0] or shard_in.dtype != full.dtype:
        raise ValueError(f"input must be sub-block {i} of the output: {own[1] - own[0]} elements of {full.dtype}, "
                         f"got {shard_in.numel()} of {shard_in.dtype}.")
    dst = _view(full, 0, own)
    if dst.data_ptr() != shard_in.data_ptr() and dst.numel():
        dst.copy_(shard_in)
    chunks = _rail_chunks(full.numel(), max(1, chunk_bytes // full.element_size()), g)

    def inter_gather(k: int, lane: _Lane) -> Callable[[], None]:
        return _gather_exchange(lane, grp.rail_peers, i, [[r] for r in chunks[k]], full, 0)

    return _run([(grp.inter_gather, inter_gather)], len(chunks), grp, single_thread, full, async_op)


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
    step = max(1, chunk_bytes // flat.element_size())
    chunks = [split_range(a, min(a + step, flat.numel()), g) for a in range(0, flat.numel(), step)]

    def inter_scatter(k: int, lane: _Lane) -> Callable[[], None]:
        done = _reduce_exchange(lane, grp.rail_peers, i, [[r] for r in chunks[k]], flat, 0, flat,
                                0)
        return _then(done, lambda: _view(flat, 0, chunks[k][i]).div_(g)) if op == "avg" else done

    def inter_gather(k: int, lane: _Lane) -> Callable[[], None]:
        return _gather_exchange(lane, grp.rail_peers, i, [[r] for r in chunks[k]], flat, 0)

    return _run([(grp.inter_scatter, inter_scatter), (grp.inter_gather, inter_gather)], len(chunks), grp,
                single_thread, flat, async_op)
