"""Collectives over a :class:`Topology`: intra-group, inter-group (rail) and hierarchical global ones.

Every collective works on flat, contiguous buffers laid out as in the PaRO design (section 4): a buffer of ``L``
elements (a multiple of n) is split into m *intra blocks*, each split into g *sub-blocks*; rank (i, j) holds intra
block j at level I and sub-block i of intra block j at level G. With that layout a global all-gather is an inter
all-gather followed by an intra all-gather, and a global reduce-scatter is an intra reduce-scatter followed by an
inter one, with no copies.

Each collective is written once over two phases (:mod:`lightning_paro.comm.phases`): the phase inside groups, and the
hop between groups, which sends the values as they are or block-quantized (``quant="int8"``). A global collective
whose hop is exact runs as an HO-Ring, its phases pipelined chunk by chunk; one whose hop is quantized runs its
phases one after the other.

**One thread.** All collectives of one :class:`Communicator` run, in the order they were issued, on the communication
thread of its layout (:mod:`lightning_paro.comm.worker`, which also says how a failure surfaces as
:class:`CollectiveError`); so do the other collectives the strategy issues (:meth:`Communicator.run`,
:meth:`Communicator.broadcast`). Single-thread mode (:attr:`Communicator.single_thread`, the default on CUDA) goes
further: HO-Ring runs its pipeline on this thread too instead of on its phase threads, and a submit returns only once
its collective is issued, so this thread is idle whenever the training thread runs. A collective issued on the
training thread by other code, such as Lightning's per-batch broadcast of its SIGTERM flag or a metric's sync, then
never runs beside the package's. Without single-thread mode (CPU, gloo), such collectives may run beside the
package's, which gloo allows.

Control tensors (the "parameter used" flags, the gradient norm) and every buffer handed to a collective must live on
the communicator's device: an NCCL group carries no CPU tensor.
"""

from __future__ import annotations

import dataclasses
import threading
from datetime import timedelta
from typing import Callable, Literal, TypeVar

import torch
import torch.distributed as dist

from lightning_paro.comm import ho_ring, pieces, quantize
from lightning_paro.comm.accounting import INTER, INTRA, TrafficMeter
from lightning_paro.comm.ho_ring import HORingConfig
from lightning_paro.comm.phases import ExactPhase, QuantizedHop
from lightning_paro.comm.topology import Topology

# The communication thread's names, imported from here by the strategy and its users.
from lightning_paro.comm.worker import (  # noqa: F401
    CollectiveError,
    CommHandle,
    _Worker,
    comm_thread,
    run_on_comm_thread,
)

Scope = Literal["intra", "inter", "global"]

HOR_EXACT_SCOPES = HORingConfig(flat_below_bytes=0)
"""HO-Ring as the Communicator runs it: never the flat fallback, so every byte crosses the scope it is recorded in."""
ReduceOp = Literal["sum", "avg"]
T = TypeVar("T")
Phase = ExactPhase | QuantizedHop

# What a global collective runs inside groups, around its hop between groups.
_INTRA_OPS = {"all_gather": ("all_gather",), "reduce_scatter": ("reduce_scatter",),
              "all_reduce": ("reduce_scatter", "all_gather")}


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
        config = self.ho_ring_config
        # gloo stages a whole copy of a flat all-gather or reduce-scatter: they run in pieces of at most a chunk
        piece_bytes = int(config.chunk_bytes) if config is not None else pieces.DEFAULT_PIECE_BYTES
        self._intra = ExactPhase(INTRA, topology.group_size, self._groups.intra, piece_bytes)
        rail = {} if config is None else {"chunk_bytes": config.chunk_bytes, "single_thread": config.single_thread}
        self._rail = ExactPhase(INTER, topology.num_groups, self._groups.rail, piece_bytes, self._ho_groups, **rail)
        self._quantized_hop = QuantizedHop(topology.num_groups, self._groups.rail, topology.group_index)
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
        hop = self._hop(quant, scope)
        self._check_quantized_sizes("all-gather", hop, scope, out.numel(), shard.numel())
        self._account("all_gather", out, scope, hop)
        return self._submit(lambda: self._all_gather(out, shard, scope, hop), async_op, "all_gather", scope)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, scope: Scope, op: ReduceOp = "sum",
                       async_op: bool = False, quant: str | None = None,
                       error: torch.Tensor | None = None) -> CommHandle | None:
        """Reduce ``full`` over the ranks of ``scope`` and keep this rank's slice of it in ``out``. ``quant``
        ("int8"): the hop between groups sends each slice block-quantized to its owner (``comm.quantize``), with
        ``error`` feedback when given (fp32, the size of the buffer the hop reduces: 1/m of ``full`` for a global
        reduce-scatter)."""
        hop = self._hop(quant, scope, op, "reduce-scatter")
        self._check_quantized_sizes("reduce-scatter", hop, scope, full.numel(), out.numel(), error)
        self._account("reduce_scatter", full, scope, hop)
        return self._submit(lambda: self._reduce_scatter(out, full, scope, op, hop, error), async_op,
                            "reduce_scatter", scope)

    def all_reduce(self, tensor: torch.Tensor, scope: Scope, op: ReduceOp = "sum",
                   async_op: bool = False, quant: str | None = None,
                   error: torch.Tensor | None = None) -> CommHandle | None:
        """Reduce ``tensor`` in place over the ranks of ``scope`` (``global`` runs hierarchically). ``quant``
        ("int8"): the hop between groups is a quantized reduce-scatter (with ``error`` feedback when given, as in
        :meth:`reduce_scatter`) and all-gather (``comm.quantize``)."""
        hop = self._hop(quant, scope, op, "all-reduce")
        self._check_quantized_sizes("all-reduce", hop, scope, tensor.numel(), None, error)
        self._account("all_reduce", tensor, scope, hop)
        return self._submit(lambda: self._all_reduce(tensor, scope, op, hop, error), async_op, "all_reduce", scope)

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

    def _hop(self, quant: str | None, scope: Scope, op: ReduceOp = "sum", what: str = "") -> Phase:
        """The hop between groups of a collective: quantized when asked for, crossing groups, and there are several;
        else exact."""
        if quant is None:
            return self._rail
        if quant not in quantize.SCHEMES or scope == INTRA:
            raise ValueError(f"PaRO quantizes collectives between groups with {quantize.SCHEMES}, not {quant!r} over"
                             f" {scope!r}")
        if self.topology.num_groups == 1:
            return self._rail
        if op != "sum":
            raise ValueError(f"a quantized {what} sums")
        return self._quantized_hop

    def _check_quantized_sizes(self, what: str, hop: Phase, scope: Scope, numel: int, part: int | None,
                               error: torch.Tensor | None = None) -> None:
        """Before a collective with a quantized hop is queued: its buffer of ``numel`` elements must split into equal
        slices over the ranks of ``scope`` (into slices of ``part`` elements, when given), and an ``error`` buffer must
        have the size of what the hop reduces (1/m of the buffer for a global collective); else a ``ValueError``
        naming the size and the divisor, on the caller's thread."""
        if hop is not self._quantized_hop:
            return
        topo = self.topology
        ranks = topo.world_size if scope == "global" else topo.num_groups
        quantize.check_split(what, numel, ranks, part)
        hop_numel = numel // topo.group_size if scope == "global" else numel
        if error is not None and error.numel() != hop_numel:
            raise ValueError(f"the error-feedback buffer of a quantized {what} over {scope!r} holds {error.numel()}"
                             f" elements; the hop between groups reduces {hop_numel} of the buffer's {numel}: give"
                             f" it {hop_numel} fp32 elements.")

    def _phase(self, scope: str, hop: Phase) -> Phase:
        """The one phase of an intra or inter collective."""
        return self._intra if scope == INTRA else hop

    def _pipelined(self, scope: Scope, hop: Phase) -> bool:
        """Whether a collective runs as an HO-Ring: global, with an exact hop, over several groups of several ranks."""
        return scope == "global" and hop is self._rail and self._ho_global

    def _account(self, op: str, buffer: torch.Tensor, scope: Scope, hop: Phase) -> None:
        """Record what each phase of ``op`` over the full ``buffer`` sends. Recorded when issued (sizes are known), so
        a step's figures are complete even while its collectives run."""
        numel, nbytes = buffer.numel(), buffer.numel() * buffer.element_size()
        if scope != "global":
            self._record(op, self._phase(scope, hop), numel, nbytes)
            return
        for intra_op in _INTRA_OPS[op]:
            self._record(intra_op, self._intra, numel, nbytes)
        m = self.topology.group_size
        self._record(op, hop, numel // m, nbytes // m)  # the hop moves this rank's intra block

    def _record(self, op: str, phase: Phase, numel: int, nbytes: int) -> None:
        sent = phase.sent(op, numel, nbytes)
        if sent:
            self.meter.record(op, phase.scope, sent)

    # ------------------------------------------------------------------ collectives made of phases
    def _block(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's intra block of a full buffer."""
        m, j = self.topology.group_size, self.topology.local_index
        size = full.numel() // m
        return full[j * size:(j + 1) * size]

    def _scratch_block(self, full: torch.Tensor) -> torch.Tensor:
        """A buffer for this rank's reduced intra block: a reduce-scatter cannot write into its own input."""
        return torch.empty(full.numel() // self.topology.group_size, dtype=full.dtype, device=full.device)

    def _all_gather(self, out: torch.Tensor, shard: torch.Tensor, scope: Scope, hop: Phase) -> None:
        if self._pipelined(scope, hop):
            ho_ring.all_gather(out, shard, self.topology, config=self.ho_ring_config, groups=self._ho_groups)
        elif scope == "global":
            block = self._block(out)
            hop.all_gather(block, shard)
            self._intra.all_gather(out, block)
        else:
            self._phase(scope, hop).all_gather(out, shard)

    def _reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, scope: Scope, op: ReduceOp, hop: Phase,
                        error: torch.Tensor | None) -> None:
        if self._pipelined(scope, hop):
            ho_ring.reduce_scatter(out, full, self.topology, op=op, config=self.ho_ring_config,
                                   groups=self._ho_groups)
            return
        if scope == "global":
            block = self._scratch_block(full)
            self._intra.reduce_scatter(block, full)
            hop.reduce_scatter(out, block, error)
            k = self.topology.world_size
        else:
            phase = self._phase(scope, hop)
            phase.reduce_scatter(out, full, error)
            k = phase.ranks
        if op == "avg":
            out.div_(k)

    def _all_reduce(self, tensor: torch.Tensor, scope: Scope, op: ReduceOp, hop: Phase,
                    error: torch.Tensor | None) -> None:
        if self._pipelined(scope, hop):
            ho_ring.all_reduce(tensor, self.topology, op=op, config=self.ho_ring_config, groups=self._ho_groups)
            return
        if scope == "global":
            block = self._scratch_block(tensor)
            self._intra.reduce_scatter(block, tensor)
            hop.all_reduce(block, error)
            self._intra.all_gather(tensor, block)
            k = self.topology.world_size
        else:
            phase = self._phase(scope, hop)
            phase.all_reduce(tensor, error)
            k = phase.ranks
        if op == "avg":
            tensor.div_(k)
