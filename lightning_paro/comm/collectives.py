"""Collectives over a :class:`Topology`: intra-group, inter-group (rail) and hierarchical global ones.

Every collective works on flat, contiguous buffers laid out as in the PaRO design (section 4): a buffer of ``L``
elements (a multiple of n) is split into m *intra blocks*, each split into g *sub-blocks*; rank (i, j) holds intra
block j at level I and sub-block i of intra block j at level G. With that layout a global all-gather is an inter
all-gather followed by an intra all-gather, and a global reduce-scatter is an intra reduce-scatter followed by an
inter one, with no copies.

**One thread.** All collectives of one :class:`Communicator` run, in the order they were issued, on one background
thread ("paro-comm"): ranks issue them in the same order, so they match across ranks, and the caller's thread is free
to compute while they run (``async_op=True`` returns a :class:`CommHandle`). Communicators of the same layout in one
process share that thread and their process groups (:mod:`lightning_paro.comm.group_cache`), so building strategy
after strategy adds neither, and work issued by one never races work issued by another.

The rule for every other collective the strategy issues (Lightning's ``barrier``, ``broadcast`` and ``reduce``, which
``self.log(..., sync_dist=True)`` uses; the set-up broadcasts of parameters and buffers) is the same: it runs on that
thread too (:meth:`Communicator.run`, :meth:`Communicator.broadcast`), after everything issued before it. NCCL needs
this: kernels of different communicators launched from several host threads, in an order that differs between ranks,
can wait on each other forever. Single-thread mode (:attr:`Communicator.single_thread`, the default on CUDA) goes
further: HO-Ring runs its pipeline on this thread too instead of on its phase threads, and a submit returns only once
its collective is issued, so this thread is idle whenever the training thread runs. A collective issued on the
training thread by other code, such as Lightning's per-batch broadcast of its SIGTERM flag or a metric's sync, then
never runs beside the package's. Without single-thread mode (CPU, gloo), such collectives may run beside the
package's, which gloo allows.

**Failures.** A collective that fails on this thread raises :class:`CollectiveError` ("PaRO all_gather over scope
'global' failed: ...") from the :meth:`CommHandle.wait` of its own handle and of every handle issued after it; the
work queued behind it never runs (it would read buffers the failed collective did not fill), and every later submit
raises the same error at once. A peer that dies breaks its connections, so the collectives waiting for it fail on
every rank; a peer that stops issuing collectives makes them fail after the process group's timeout (the default
group's, which every group created here shares), and a waiter gives up a margin after that even if a backend call
does not honour it (:func:`~lightning_paro.comm.group_cache.stall_limit`).

Control tensors (the "parameter used" flags, the gradient norm) and every buffer handed to a collective must live on
the communicator's device: an NCCL group carries no CPU tensor.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any, Callable, Literal, TypeVar

import torch
import torch.distributed as dist

from lightning_paro.comm import ho_ring, pieces, quantize
from lightning_paro.comm.accounting import INTER, INTRA, TrafficMeter, ring_bytes
from lightning_paro.comm.group_cache import cached_groups, default_timeout, stall_limit
from lightning_paro.comm.ho_ring import HORingConfig
from lightning_paro.comm.topology import Topology

Scope = Literal["intra", "inter", "global"]

HOR_EXACT_SCOPES = HORingConfig(flat_below_bytes=0)
"""HO-Ring as the Communicator runs it: never the flat fallback, so every byte crosses the scope it is recorded in."""
ReduceOp = Literal["sum", "avg"]
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


class Communicator:
    """Issues the collectives of one rank over a :class:`Topology` and records their traffic in a meter.

    Args:
        topology: this rank's place in the n = g x m layout.
        meter: where traffic is recorded (a new one by default).
        device: the compute device: control tensors must live there, and on CUDA the communication thread makes
            it current.
        ho_ring_config: how global and rail collectives run as HO-Ring (``None``: plain two-phase collectives). Its
            ``single_thread`` (default: on CUDA) also sets :attr:`single_thread` here.
        timeout: how long a collective may wait for its peers (default: the default process group's timeout); waits
            give up a margin after it (:func:`~lightning_paro.comm.group_cache.stall_limit`).
    """

    def __init__(self, topology: Topology, meter: TrafficMeter | None = None,
                 device: torch.device | None = None, ho_ring_config: HORingConfig | None = HOR_EXACT_SCOPES,
                 timeout: timedelta | float | None = None) -> None:
        self.topology = topology
        self.meter = meter if meter is not None else TrafficMeter()
        self.device = device
        self._groups = topology.groups
        single = ho_ring_config.single_thread if ho_ring_config is not None else None
        if single is None and device is not None:
            single = device.type == "cuda"
        self.single_thread = bool(single)
        """Issue before returning: every submit, ``async_op`` or not, returns once the communication thread has issued
        its collective, so that thread is idle whenever the caller runs and no other thread's collective can come
        between the package's in an order that differs between ranks. On NCCL, issuing only enqueues the work on the
        GPU. On by default for CUDA, with HO-Ring's single-thread mode; on CPU, where gloo completes a collective
        before returning, it would give up the overlap with compute."""
        # Global collectives run as HO-Ring (chunked, intra and inter phases overlapped on their own groups);
        # None keeps the plain two-phase version. Creating the groups is collective, like the ones above.
        self.ho_ring_config = (ho_ring_config if ho_ring_config is None or single is None
                               else dataclasses.replace(ho_ring_config, single_thread=single))
        # Rail (inter) collectives use HO-Ring's inter phase whenever there are several groups: point-to-point sends
        # of the ideal volume (the backend's reduce-scatter moves twice that), both link directions busy.
        self._ho_groups = (ho_ring.shared_groups(topology)
                           if ho_ring_config is not None and topology.num_groups > 1 else None)
        self._ho_global = self._ho_groups is not None and topology.group_size > 1
        self._worker = comm_thread(topology, device, timeout)
        if self._ho_groups is not None:
            self._worker.add_progress_source(self._ho_groups)

    @property
    def error(self) -> CollectiveError | None:
        """The failure that stopped this rank's communication thread, if any."""
        return self._worker.error

    @property
    def thread(self) -> threading.Thread:
        """The thread every collective of this communicator is issued from."""
        return self._worker.thread

    @property
    def waited_seconds(self) -> float:
        """Seconds this process has spent waiting for collectives of this layout to finish, so far."""
        return self._worker.waited_seconds

    # ------------------------------------------------------------------ public collectives
    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, scope: Scope, async_op: bool = False,
                   quant: str | None = None) -> CommHandle | None:
        """Gather ``shard`` from every rank of ``scope`` into ``out`` (in place where ``shard`` is this rank's slot).

        ``global`` gathers 1/n shards at their layout positions: inter all-gather into this rank's intra block, then
        intra all-gather of the blocks. ``quant`` ("int8"): the hop between groups sends the shards block-quantized
        (``comm.quantize``).
        """
        if self._quantized(quant, scope):
            if scope == "global":
                self._account("all_gather", INTRA, out.numel() * out.element_size())
            self._account_quantized("all_gather", shard.numel(), 1)
            return self._submit(lambda: self._quantized_all_gather(out, shard, scope), async_op, "all_gather", scope)
        nbytes = out.numel() * out.element_size()
        if scope == "global":
            self._account("all_gather", INTER, nbytes // self.topology.group_size)
            self._account("all_gather", INTRA, nbytes)
        else:
            self._account("all_gather", scope, nbytes)
        return self._submit(lambda: self._all_gather(out, shard, scope), async_op, "all_gather", scope)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, scope: Scope, op: ReduceOp = "sum",
                       async_op: bool = False, quant: str | None = None,
                       error: torch.Tensor | None = None) -> CommHandle | None:
        """Reduce ``full`` over the ranks of ``scope`` and keep this rank's slice of it in ``out``. ``quant``
        ("int8"): the hop between groups sends each slice block-quantized to its owner (``comm.quantize``), with
        ``error`` feedback when given (fp32, the size of the buffer the hop reduces: 1/m of ``full`` for a global
        reduce-scatter)."""
        if self._quantized(quant, scope):
            if op != "sum":
                raise ValueError("a quantized reduce-scatter sums")
            if scope == "global":
                self._account("reduce_scatter", INTRA, full.numel() * full.element_size())
            self._account_quantized("reduce_scatter", out.numel(), 1)
            return self._submit(lambda: self._quantized_reduce_scatter(out, full, scope, error), async_op,
                                "reduce_scatter", scope)
        nbytes = full.numel() * full.element_size()
        if scope == "global":
            self._account("reduce_scatter", INTRA, nbytes)
            self._account("reduce_scatter", INTER, nbytes // self.topology.group_size)
        else:
            self._account("reduce_scatter", scope, nbytes)
        return self._submit(lambda: self._reduce_scatter(out, full, scope, op), async_op, "reduce_scatter", scope)

    def all_reduce(self, tensor: torch.Tensor, scope: Scope, op: ReduceOp = "sum",
                   async_op: bool = False, quant: str | None = None,
                   error: torch.Tensor | None = None) -> CommHandle | None:
        """Reduce ``tensor`` in place over the ranks of ``scope`` (``global`` runs hierarchically). ``quant``
        ("int8"): the hop between groups is a quantized reduce-scatter (with ``error`` feedback when given, as in
        :meth:`reduce_scatter`) and all-gather (``comm.quantize``)."""
        if self._quantized(quant, scope):
            if op != "sum":
                raise ValueError("a quantized all-reduce sums")
            block = tensor.numel() // (self.topology.group_size if scope == "global" else 1)
            if scope == "global":
                self._account("reduce_scatter", INTRA, tensor.numel() * tensor.element_size())
                self._account("all_gather", INTRA, tensor.numel() * tensor.element_size())
            self._account_quantized("all_reduce", block // self.topology.num_groups, 2)
            return self._submit(lambda: self._quantized_all_reduce(tensor, scope, error), async_op, "all_reduce",
                                scope)
        nbytes = tensor.numel() * tensor.element_size()
        if scope == "global":
            self._account("reduce_scatter", INTRA, nbytes)
            self._account("all_reduce", INTER, nbytes // self.topology.group_size)
            self._account("all_gather", INTRA, nbytes)
        else:
            self._account("all_reduce", scope, nbytes)
        return self._submit(lambda: self._all_reduce(tensor, scope, op), async_op, "all_reduce", scope)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> CommHandle | None:
        """Overwrite ``tensor`` with global rank ``src``'s on every rank (set-up: replicas start identical)."""
        self._check_device(tensor, "broadcast")
        group = self._groups.world
        return self._submit(lambda: dist.broadcast(tensor, src=src, group=group), async_op, "broadcast", "global")

    def submit(self, fn: Callable[[], None], async_op: bool = True, what: str = "work queued after a collective",
               scope: str = "local") -> CommHandle | None:
        """Run ``fn`` on the communication thread after everything issued so far (e.g. consume a result). It does not
        run if anything before it failed."""
        return self._submit(fn, async_op, what, scope)

    def run(self, fn: Callable[[], T], what: str, scope: str = "global") -> T:
        """Run ``fn`` (a collective issued by other code) on the communication thread, after everything issued so far,
        and return its result; a failure raises :class:`CollectiveError` naming ``what`` and ``scope``."""
        return run_on_comm_thread(self._worker, fn, what, scope)

    def scalar_all_reduce(self, tensor: torch.Tensor, scope: Scope) -> None:
        """Sum a small control tensor (a norm, a flag) over ``scope``; its traffic is recorded as ``control``. The
        tensor must live on the communicator's device, like every tensor its groups carry."""
        self._check_device(tensor, "all_reduce")
        group = {"intra": self._groups.intra, "inter": self._groups.rail, "global": self._groups.world}[scope]
        if group is None:
            return
        k = dist.get_world_size(group)
        # A scalar cannot be split into ring chunks: each rank passes it on (k - 1) times in each direction.
        nbytes = 2 * (k - 1) * tensor.numel() * tensor.element_size()
        crosses_groups = scope == "inter" or (scope == "global" and self.topology.num_groups > 1)
        self.meter.record("control", INTER if crosses_groups else INTRA, nbytes)
        self._submit(lambda: dist.all_reduce(tensor, group=group), False, "all_reduce of control values", scope)

    def close(self) -> None:
        """Wait for the work issued so far. The communication thread and groups stay, shared with later
        Communicators of the same layout."""
        self._submit(lambda: None, False, "close", "local")

    # ------------------------------------------------------------------ machinery
    def _submit(self, fn: Callable[[], None], async_op: bool, op: str, scope: str) -> CommHandle | None:
        handle = CommHandle(self._worker.submit(fn, op, scope), self._worker)
        if async_op and not self.single_thread:
            return handle
        handle.wait()
        return handle if async_op else None

    def _check_device(self, tensor: torch.Tensor, op: str) -> None:
        # A cheap guard on the control path: a tensor left on the CPU cannot be carried by an NCCL group.
        if self.device is not None and tensor.device != self.device:
            raise ValueError(f"PaRO {op}: the tensor is on {tensor.device}, the communicator's groups carry "
                             f"{self.device}; allocate control tensors on the compute device.")

    def _quantized(self, quant: str | None, scope: Scope) -> bool:
        """Whether a collective goes quantized between groups: asked for, crossing groups, and there are several."""
        if quant is None:
            return False
        if quant not in quantize.SCHEMES or scope == INTRA:
            raise ValueError(f"PaRO quantizes collectives between groups with {quantize.SCHEMES}, not {quant!r} over"
                             f" {scope!r}")
        return self.topology.num_groups > 1

    # A global collective with its hop between groups quantized runs its phases one after the other, as the plain
    # two-phase version does (not pipelined as an HO-Ring): the phase inside groups in full, the rail one quantized.
    def _quantized_all_gather(self, out: torch.Tensor, shard: torch.Tensor, scope: Scope) -> None:
        rail, g = self._groups.rail, self.topology.num_groups
        if scope != "global":
            quantize.all_gather(out, shard, rail, g)
            return
        block = self._block(out)
        quantize.all_gather(block, shard, rail, g)
        self._phase_all_gather(out, block, INTRA)

    def _quantized_reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, scope: Scope,
                                  error: torch.Tensor | None) -> None:
        rail, g, i = self._groups.rail, self.topology.num_groups, self.topology.group_index
        if scope != "global":
            quantize.reduce_scatter(out, full, rail, g, i, error)
            return
        block = torch.empty(full.numel() // self.topology.group_size, dtype=full.dtype, device=full.device)
        self._phase_reduce_scatter(block, full, INTRA)
        quantize.reduce_scatter(out, block, rail, g, i, error)

    def _quantized_all_reduce(self, tensor: torch.Tensor, scope: Scope, error: torch.Tensor | None) -> None:
        rail, g, i = self._groups.rail, self.topology.num_groups, self.topology.group_index
        if scope != "global":
            quantize.all_reduce(tensor, rail, g, i, error)
            return
        block = torch.empty(tensor.numel() // self.topology.group_size, dtype=tensor.dtype, device=tensor.device)
        self._phase_reduce_scatter(block, tensor, INTRA)
        quantize.all_reduce(block, rail, g, i, error)
        self._phase_all_gather(tensor, block, INTRA)

    def _account_quantized(self, op: str, slice_numel: int, times: int) -> None:
        """A quantized hop between groups sends one payload of a slice to each of the other groups (``times``
        rounds)."""
        sent = times * (self.topology.num_groups - 1) * quantize.payload_bytes(slice_numel)
        self.meter.record(op, INTER, sent)

    def _account(self, op: str, scope: str, nbytes: int) -> None:
        # Recorded when issued (sizes are known), so a step's figures are complete even while its collectives run.
        sent = ring_bytes(op, nbytes, self._size(scope))
        if sent:
            self.meter.record(op, scope, sent)

    def _group(self, scope: str):
        return self._groups.intra if scope == INTRA else self._groups.rail

    def _size(self, scope: str) -> int:
        return self.topology.group_size if scope == INTRA else self.topology.num_groups

    def _rail_kwargs(self) -> dict:
        return {"chunk_bytes": self.ho_ring_config.chunk_bytes, "single_thread": self.ho_ring_config.single_thread}

    def _piece_bytes(self) -> int:
        """Largest piece of a flat all-gather or reduce-scatter on a backend that stages the whole buffer (gloo)."""
        chunk = self.ho_ring_config.chunk_bytes if self.ho_ring_config is not None else None
        return int(chunk) if chunk else pieces.DEFAULT_PIECE_BYTES

    # ------------------------------------------------------------------ one-phase primitives
    def _phase_all_gather(self, out: torch.Tensor, shard: torch.Tensor, scope: str) -> None:
        k = self._size(scope)
        if k == 1:
            if shard.data_ptr() != out.data_ptr():
                out.copy_(shard)
            return
        if scope == INTER and self._ho_groups is not None:
            ho_ring.rail_all_gather(out, shard, self._ho_groups, **self._rail_kwargs())
            return
        pieces.all_gather(out, shard, self._group(scope), k, self._piece_bytes())

    def _phase_reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, scope: str) -> None:
        k = self._size(scope)
        if k == 1:
            if full.data_ptr() != out.data_ptr():
                out.copy_(full)
            return
        if scope == INTER and self._ho_groups is not None:
            ho_ring.rail_reduce_scatter(out, full, self._ho_groups, **self._rail_kwargs())
            return
        pieces.reduce_scatter(out, full, self._group(scope), k, self._piece_bytes())

    def _phase_all_reduce(self, tensor: torch.Tensor, scope: str) -> None:
        k = self._size(scope)
        if k == 1:
            return
        if scope == INTER and self._ho_groups is not None:
            ho_ring.rail_all_reduce(tensor, self._ho_groups, **self._rail_kwargs())
            return
        dist.all_reduce(tensor, group=self._group(scope))

    # ------------------------------------------------------------------ composed collectives
    def _block(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's intra block of a full buffer."""
        m, j = self.topology.group_size, self.topology.local_index
        size = full.numel() // m
        return full[j * size:(j + 1) * size]

    def _all_gather(self, out: torch.Tensor, shard: torch.Tensor, scope: Scope) -> None:
        if scope == "global" and self._ho_global:
            ho_ring.all_gather(out, shard, self.topology, config=self.ho_ring_config, groups=self._ho_groups)
        elif scope == "global":
            block = self._block(out)
            self._phase_all_gather(block, shard, INTER)
            self._phase_all_gather(out, block, INTRA)
        else:
            self._phase_all_gather(out, shard, scope)

    def _reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, scope: Scope, op: ReduceOp) -> None:
        if scope == "global" and self._ho_global:
            ho_ring.reduce_scatter(out, full, self.topology, op=op, config=self.ho_ring_config,
                                   groups=self._ho_groups)
            return
        if scope == "global":
            block = torch.empty(full.numel() // self.topology.group_size, dtype=full.dtype, device=full.device)
            self._phase_reduce_scatter(block, full, INTRA)
            self._phase_reduce_scatter(out, block, INTER)
            k = self.topology.world_size
        else:
            self._phase_reduce_scatter(out, full, scope)
            k = self._size(scope)
        if op == "avg":
            out.div_(k)

    def _all_reduce(self, tensor: torch.Tensor, scope: Scope, op: ReduceOp) -> None:
        if scope == "global" and self._ho_global:
            ho_ring.all_reduce(tensor, self.topology, op=op, config=self.ho_ring_config, groups=self._ho_groups)
            return
        if scope == "global":
            # the reduced intra block lives in a scratch buffer: reduce-scatter cannot write into its own input
            tmp = torch.empty(tensor.numel() // self.topology.group_size, dtype=tensor.dtype, device=tensor.device)
            self._phase_reduce_scatter(tmp, tensor, INTRA)
            self._phase_all_reduce(tmp, INTER)
            self._phase_all_gather(tensor, tmp, INTRA)
            k = self.topology.world_size
        else:
            self._phase_all_reduce(tensor, scope)
            k = self._size(scope)
        if op == "avg":
            tensor.div_(k)


# ---------------------------------------------------------------------- the communication thread of a layout
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
