"""HO-Ring's pipeline scheduler: phases, the chunk tasks they run in issue order, and the handle of a collective.

A collective is a :class:`_Job`: a list of stages, one per phase (intra reduce-scatter, inter reduce-scatter, ...),
each run on every chunk in order. A :class:`_Phase` is a worker thread with its own process groups that runs the chunk
tasks handed to it strictly by a sequence number fixed at issue, up to :data:`CHUNKS_IN_FLIGHT` at a time; a chunk that
finishes one phase is handed to the next, so the phases of different chunks are on the links together. In
single-thread mode the issuing thread runs the whole pipeline itself (:meth:`_Job.run_inline`). What a stage sends is
not this module's business: a stage is a function of the chunk index and the :class:`_Lane` to post on
(:mod:`~lightning_paro.comm.ho_ring.exchanges` builds them).

**Failures.** A failed send, receive or reduction fails its collective: the rest of that collective is neither posted
nor waited for (its chunks still pass through the later phases, unposted, so their sequence numbers keep moving and no
phase waits for a chunk that never comes), and :meth:`HORingWork.wait` raises an error naming the phase and the
chunk. ``wait`` also gives up when no chunk has finished a phase for :attr:`HORingWork.stall_limit` seconds.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

Stage = Callable[[int, "_Lane"], "Callable[[], None] | None"]
"""Posts one chunk's messages of one phase on a lane; returns what completes them (or ``None``)."""

CHUNKS_IN_FLIGHT = 2
"""Chunks one phase has posted at a time (see ``_Phase._loop``)."""


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

    def __init__(self, stages: list[tuple[_Phase, Stage]], num_chunks: int, stall_limit: float | None,
                 inline: bool) -> None:
        self.stages = stages
        self.num_chunks = num_chunks
        self.inline = inline
        self.work = HORingWork([phase for phase, _ in stages], stall_limit)
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


def _tag(slot: int, piece: int) -> int:
    # Exchanges in flight in one phase have different slots, so their messages between the same two ranks never match
    # each other's receives.
    return slot * 4096 + piece


def _then(first: Callable[[], None], then: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        first()
        then()
    return both


def _run(stages: list[tuple[_Phase, Stage]], num_chunks: int, stall_limit: float | None, single_thread: bool | None,
         like: torch.Tensor, async_op: bool) -> HORingWork | None:
    """Issue a collective's pipeline: on the phase threads, or run it here in single-thread mode (then it is complete
    on return)."""
    inline = like.is_cuda if single_thread is None else single_thread
    work = _Job(stages, num_chunks, stall_limit, inline).start()
    if async_op:
        return work
    work.wait()
    return None

