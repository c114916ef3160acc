"""Collectives over a :class:`Topology`: intra-group, inter-group (rail) and hierarchical global ones.

Every collective works on flat, contiguous buffers laid out as in the PaRO design (section 4): a buffer of ``L``
elements (a multiple of n) is split into m *intra blocks*, each split into g *sub-blocks*; rank (i, j) holds intra
block j at level I and sub-block i of intra block j at level G. With that layout a global all-gather is an inter
all-gather followed by an intra all-gather, and a global reduce-scatter is an intra reduce-scatter followed by an
inter one, with no copies.

All collectives of one :class:`Communicator` run, in the order they were issued, on one background thread: ranks
issue them in the same order, so they match across ranks, and the caller's thread is free to compute while they
run (``async_op=True`` returns a :class:`CommHandle`). Communicators of the same layout in one process share that
thread and their process groups (:mod:`lightning_paro.comm.group_cache`), so building strategy after strategy adds
neither, and work issued by one never races work issued by another.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable, Literal

import torch
import torch.distributed as dist

from lightning_paro.comm import ho_ring
from lightning_paro.comm.accounting import INTER, INTRA, TrafficMeter, ring_bytes
from lightning_paro.comm.group_cache import cached_groups
from lightning_paro.comm.ho_ring import HORingConfig
from lightning_paro.comm.topology import Topology

Scope = Literal["intra", "inter", "global"]

HOR_EXACT_SCOPES = HORingConfig(flat_below_bytes=0)
"""HO-Ring as the Communicator runs it: never the flat fallback, so every byte crosses the scope it is recorded in."""
ReduceOp = Literal["sum", "avg"]


class CommHandle:
    """A collective in flight. :meth:`wait` blocks until it (and everything issued before it) has finished."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def wait(self) -> None:
        self._future.result()

    def is_completed(self) -> bool:
        return self._future.done()


class _Worker:
    """The thread that runs a process's collectives for one layout, one at a time, in the order they were issued."""

    def __init__(self, device: torch.device | None) -> None:
        self.device = device
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="paro-comm", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> Future:
        future: Future = Future()
        self._queue.put((fn, future))
        return future

    def close(self) -> None:
        """Run what was submitted, then stop the thread."""
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            # A new thread starts on device 0: make this rank's device current, so that buffers it allocates and
            # the streams its collectives order against are this rank's.
            torch.cuda.set_device(self.device)
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, future = item
            try:
                fn()
            except BaseException as err:  # surfaced to the waiting thread
                future.set_exception(err)
            else:
                future.set_result(None)


class Communicator:
    """Issues the collectives of one rank over a :class:`Topology` and records their traffic in a meter."""

    def __init__(self, topology: Topology, meter: TrafficMeter | None = None,
                 device: torch.device | None = None, ho_ring_config: HORingConfig | None = HOR_EXACT_SCOPES) -> None:
        self.topology = topology
        self.meter = meter if meter is not None else TrafficMeter()
        self.device = device
        self._groups = topology.groups
        # Global collectives run as HO-Ring (chunked, intra and inter phases overlapped on their own groups);
        # None keeps the plain two-phase version. Creating the groups is collective, like the ones above.
        self.ho_ring_config = ho_ring_config
        # Rail (inter) collectives use HO-Ring's inter phase whenever there are several groups: point-to-point sends
        # of the ideal volume (the backend's reduce-scatter moves twice that), both link directions busy.
        self._ho_groups = (ho_ring.shared_groups(topology)
                           if ho_ring_config is not None and topology.num_groups > 1 else None)
        self._ho_global = self._ho_groups is not None and topology.group_size > 1
        self._worker = cached_groups(("paro-comm", topology.world_size, topology.group_size, topology.rank, device),
                                     lambda: _Worker(device))

    # ------------------------------------------------------------------ public collectives
    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, scope: Scope, async_op: bool = False) -> CommHandle | None:
        """Gather ``shard`` from every rank of ``scope`` into ``out`` (in place where ``shard`` is this rank's slot).

        ``global`` gathers 1/n shards at their layout positions: inter all-gather into this rank's intra block, then
        intra all-gather of the blocks.
        """
        nbytes = out.numel() * out.element_size()
        if scope == "global":
            self._account("all_gather", INTER, nbytes // self.topology.group_size)
            self._account("all_gather", INTRA, nbytes)
        else:
            self._account("all_gather", scope, nbytes)
        return self._submit(lambda: self._all_gather(out, shard, scope), async_op)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, scope: Scope, op: ReduceOp = "sum",
                       async_op: bool = False) -> CommHandle | None:
        """Reduce ``full`` over the ranks of ``scope`` and keep this rank's slice of it in ``out``."""
        nbytes = full.numel() * full.element_size()
        if scope == "global":
            self._account("reduce_scatter", INTRA, nbytes)
            self._account("reduce_scatter", INTER, nbytes // self.topology.group_size)
        else:
            self._account("reduce_scatter", scope, nbytes)
        return self._submit(lambda: self._reduce_scatter(out, full, scope, op), async_op)

    def all_reduce(self, tensor: torch.Tensor, scope: Scope, op: ReduceOp = "sum",
                   async_op: bool = False) -> CommHandle | None:
        """Reduce ``tensor`` in place over the ranks of ``scope`` (``global`` runs hierarchically)."""
        nbytes = tensor.numel() * tensor.element_size()
        if scope == "global":
            self._account("reduce_scatter", INTRA, nbytes)
            self._account("all_reduce", INTER, nbytes // self.topology.group_size)
            self._account("all_gather", INTRA, nbytes)
        else:
            self._account("all_reduce", scope, nbytes)
        return self._submit(lambda: self._all_reduce(tensor, scope, op), async_op)

    def submit(self, fn: Callable[[], None], async_op: bool = True) -> CommHandle | None:
        """Run ``fn`` on the communication thread after everything issued so far (e.g. consume a result)."""
        return self._submit(fn, async_op)

    def scalar_all_reduce(self, tensor: torch.Tensor, scope: Scope) -> None:
        """Sum a small control tensor (a norm, a flag) over ``scope``; its traffic is recorded as ``control``."""
        group = {"intra": self._groups.intra, "inter": self._groups.rail, "global": self._groups.world}[scope]
        if group is None:
            return
        k = dist.get_world_size(group)
        # A scalar cannot be split into ring chunks: each rank passes it on (k - 1) times in each direction.
        nbytes = 2 * (k - 1) * tensor.numel() * tensor.element_size()
        crosses_groups = scope == "inter" or (scope == "global" and self.topology.num_groups > 1)
        self.meter.record("control", INTER if crosses_groups else INTRA, nbytes)
        self._submit(lambda: dist.all_reduce(tensor, group=group), False)

    def close(self) -> None:
        """Wait for the work issued so far. The communication thread and groups stay, shared with later
        Communicators of the same layout."""
        self._submit(lambda: None, False)

    # ------------------------------------------------------------------ machinery
    def _submit(self, fn: Callable[[], None], async_op: bool) -> CommHandle | None:
        handle = CommHandle(self._worker.submit(fn))
        if async_op:
            return handle
        handle.wait()
        return None

    def _account(self, op: str, scope: str, nbytes: int) -> None:
        # Recorded when issued (sizes are known), so a step's figures are complete even while its collectives run.
        sent = ring_bytes(op, nbytes, self._size(scope))
        if sent:
            self.meter.record(op, scope, sent)

    def _group(self, scope: str):
        return self._groups.intra if scope == INTRA else self._groups.rail

    def _size(self, scope: str) -> int:
        return self.topology.group_size if scope == INTRA else self.topology.num_groups

    # ------------------------------------------------------------------ one-phase primitives
    def _phase_all_gather(self, out: torch.Tensor, shard: torch.Tensor, scope: str) -> None:
        k = self._size(scope)
        if k == 1:
            if shard.data_ptr() != out.data_ptr():
                out.copy_(shard)
            return
        if scope == INTER and self._ho_groups is not None:
            ho_ring.rail_all_gather(out, shard, self._ho_groups, chunk_bytes=self.ho_ring_config.chunk_bytes)
            return
        dist.all_gather_into_tensor(out, shard, group=self._group(scope))

    def _phase_reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, scope: str) -> None:
        k = self._size(scope)
        if k == 1:
            if full.data_ptr() != out.data_ptr():
                out.copy_(full)
            return
        if scope == INTER and self._ho_groups is not None:
            ho_ring.rail_reduce_scatter(out, full, self._ho_groups, chunk_bytes=self.ho_ring_config.chunk_bytes)
            return
        dist.reduce_scatter_tensor(out, full, group=self._group(scope))

    def _phase_all_reduce(self, tensor: torch.Tensor, scope: str) -> None:
        k = self._size(scope)
        if k == 1:
            return
        if scope == INTER and self._ho_groups is not None:
            ho_ring.rail_all_reduce(tensor, self._ho_groups, chunk_bytes=self.ho_ring_config.chunk_bytes)
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
