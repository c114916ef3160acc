"""The communication thread of a layout: where a process's collectives run, one at a time, and how they fail.

**One thread.** All collectives of one :class:`~lightning_paro.comm.collectives.Communicator` run, in the order they
were issued, on one background thread ("paro-comm"): ranks issue them in the same order, so they match across ranks,
and the caller's thread is free to compute while they run (``async_op=True`` returns a :class:`CommHandle`).
Communicators of the same layout in one process share that thread and their process groups
(:mod:`lightning_paro.comm.group_cache`), so building strategy after strategy adds neither, and work issued by one
never races work issued by another.

The rule for every other collective the strategy issues (Lightning's ``barrier``, ``broadcast`` and ``reduce``, which
``self.log(..., sync_dist=True)`` uses; the set-up broadcasts of parameters and buffers) is the same: it runs on that
thread too (:func:`run_on_comm_thread`), after everything issued before it. NCCL needs this: kernels of different
communicators launched from several host threads, in an order that differs between ranks, can wait on each other
forever.

**Failures.** A collective that fails on this thread raises :class:`CollectiveError` ("PaRO all_gather over scope
'global' failed: ...") from the :meth:`CommHandle.wait` of its own handle and of every handle issued after it; the
work queued behind it never runs (it would read buffers the failed collective did not fill), and every later submit
raises the same error at once. A peer that dies breaks its connections, so the collectives waiting for it fail on
every rank; a peer that stops issuing collectives makes them fail after the process group's timeout (the default
group's, which every group created here shares), and a waiter gives up a margin after that even if a backend call
does not honour it (:func:`~lightning_paro.comm.group_cache.stall_limit`).
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch

from lightning_paro.comm.group_cache import cached_groups, default_timeout, stall_limit
from lightning_paro.comm.topology import Topology

T = TypeVar("T")


class CollectiveError(RuntimeError):
    """A PaRO collective failed: on this rank (the backend raised), or on a peer, which reaches this rank as a lost
    connection or a timeout. After it, the communication thread refuses all further work with this same error."""

    def __init__(self, op: str, scope: str, cause: BaseException | str) -> None:
        self.op, self.scope = op, scope
        detail = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"PaRO {op} over scope '{scope}' failed: {detail}")


class CommHandle:
    """A collective in flight. :meth:`wait` blocks until it has finished and raises :class:`CollectiveError` if it
    (or anything issued before it on the same thread) failed."""

    __slots__ = ("_future", "_worker")

    def __init__(self, future: Future, worker: _Worker) -> None:
        self._future = future
        self._worker = worker

    def wait(self) -> None:
        if not self._future.done():
            started = time.perf_counter()
            self._worker.wait_for(self._future)
            self._worker.waited_seconds += time.perf_counter() - started
        self._future.result()


def _settle(future: Future, result=None, error: BaseException | None = None) -> None:
    # A future may already carry the failure a waiter declared while its work was still running.
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except InvalidStateError:
        pass


class _Worker:
    """The thread that runs a process's collectives for one layout, one at a time, in the order they were issued.

    The first failure is sticky: the work queued behind it is not run (it would read buffers the failed collective
    never filled) and every later submit and wait raises that failure at once.
    """

    def __init__(self, device: torch.device | None, timeout_s: float) -> None:
        self.device = device
        self.timeout_s = timeout_s
        self.stall_limit = stall_limit(timeout_s)
        self.error: CollectiveError | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running: tuple[str, str] | None = None
        self._started_at = 0.0
        self._progress_sources: list = []
        self.waited_seconds = 0.0
        """Seconds callers have spent blocked in :meth:`CommHandle.wait` (the compute thread's exposed communication:
        ``sharding="auto"`` takes it out of a micro-step's wall time)."""
        self._thread = threading.Thread(target=self._run, name="paro-comm", daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    @property
    def busy(self) -> bool:
        """Running or holding work (a snapshot)."""
        return self._running is not None or not self._queue.empty()

    def submit(self, fn: Callable[[], Any], op: str, scope: str) -> Future:
        if self.error is not None:
            raise self.error
        future: Future = Future()
        self._queue.put((fn, future, op, scope))
        if self.error is not None:  # failed meanwhile: the drain in fail() may have run before this put
            self._drain()
        return future

    def add_progress_source(self, source) -> None:
        """Something with a ``progress_at()`` (monotonic seconds) that moves while one long item is running (HO-Ring
        chunks finishing), so that the stall check does not count that time as a stall."""
        with self._lock:
            if all(s is not source for s in self._progress_sources):
                self._progress_sources.append(source)

    def wait_for(self, future: Future) -> None:
        """Block until ``future`` is settled, or declare the running item failed if it made no progress for the stall
        limit. The backend's own timeout (the process group's) normally ends a stuck collective first; this bounds
        the wait even where a backend call does not honour it."""
        while not future.done():
            idle = self._idle_for()
            if idle >= self.stall_limit:
                op, scope = self._running or ("collective", "?")
                self.fail(CollectiveError(op, scope, f"no progress for {idle:.0f} s (timeout {self.timeout_s:.0f} s):"
                                                     " a peer stopped issuing collectives, or died"))
            elif self.error is not None:
                self._drain()
            else:
                try:
                    future.exception(timeout=max(0.05, self.stall_limit - idle))  # once settled: returns, not raises
                except FutureTimeout:
                    pass
                continue
            if not future.done():
                _settle(future, error=self.error)

    def fail(self, error: CollectiveError) -> None:
        with self._lock:
            if self.error is None:
                self.error = error
        self._drain()

    def close(self) -> None:
        """Run what was submitted, then stop the thread (after a failure: stop without waiting for it)."""
        self._queue.put(None)
        if threading.current_thread() is not self._thread and self.error is None:
            self._thread.join()

    def _drain(self) -> None:
        # Work still queued after a failure never runs: settle it now so that nobody waits for it.
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is None:  # close() was called: keep the request to stop
                self._queue.put(None)
                return
            _settle(item[1], error=self.error)

    def _idle_for(self) -> float:
        if self._running is None:
            return 0.0
        latest = max([self._started_at] + [s.progress_at() for s in self._progress_sources])
        return time.monotonic() - latest

    def _run(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            # A new thread starts on device 0: make this rank's device current, so that buffers it allocates and
            # the streams its collectives order against are this rank's.
            torch.cuda.set_device(self.device)
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, future, op, scope = item
            if self.error is not None:
                _settle(future, error=self.error)
                continue
            self._started_at = time.monotonic()
            self._running = (op, scope)
            try:
                result = fn()
            except BaseException as err:  # surfaced to every waiting thread
                self._running = None
                self.fail(err if isinstance(err, CollectiveError) else CollectiveError(op, scope, err))
                _settle(future, error=self.error)
            else:
                self._running = None  # idle before the waiter wakes: it may issue a collective of its own next
                _settle(future, result)


def comm_thread(topology: Topology, device: torch.device | None = None,
                timeout: timedelta | float | None = None) -> _Worker:
    """The communication thread of ``topology``'s layout on ``device``, started on first use; shared by every
    Communicator of that layout (and :func:`run_on_comm_thread`) while the default group lives. Starting it is not
    collective."""
    if timeout is None:
        timeout_s = default_timeout().total_seconds()
    else:
        timeout_s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    key = ("paro-comm", topology.world_size, topology.group_size, topology.rank, device, timeout_s)
    return cached_groups(key, lambda: _Worker(device, timeout_s))


def run_on_comm_thread(worker: _Worker, fn: Callable[[], T], what: str, scope: str = "global") -> T:
    """Run ``fn`` on ``worker``'s thread after everything issued to it so far and return its result (inline when
    called from that thread itself); a failure raises :class:`CollectiveError` naming ``what`` and ``scope``."""
    if threading.current_thread() is worker.thread:
        try:
            return fn()
        except CollectiveError:
            raise
        except Exception as err:
            raise CollectiveError(what, scope, err) from err
    future = worker.submit(fn, what, scope)
    CommHandle(future, worker).wait()
    return future.result()
