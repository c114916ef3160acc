"""One flat buffer: the parameters of one unit that share a dtype and an optimizer param group.

A :class:`FlatGroup` owns the storage of its parameters at every level (P, G, OS) and knows the collectives that move
them between levels. It does not know about hooks or Lightning: the engine decides *when* each method runs.

**Communication dtypes** (``transitions.CommDtypes``). A collective whose dtype differs from the buffer's travels
through a scratch buffer of that dtype: the parameters are cast before an all-gather and the result cast back into
the buffer; a gradient is flattened straight into the reduction dtype and each reduced shard added to the
accumulator in the accumulator's dtype. A hop between groups may go block-quantized (``inter_quant``: the communicator
quantizes and dequantizes). When parameters travel in fewer bits than they are stored in (bf16 for fp32, or int8),
what every rank computes with is the same rounded copy: a gathered unit is rounded on the wire, and the OS -> P sync
writes the rounded values into every rank's P-level storage, its own slice included, so the optimizer keeps a
separate master copy. Such rounded storage is made exact again (:meth:`FlatGroup.exact_params`, the sync in the
buffer's own dtype) before anything reads the weights: evaluation, checkpoints, the module after fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_paro.comm.collectives import CommHandle, Communicator
from lightning_paro.strategy import transitions
from lightning_paro.strategy.layout import ShardLayout
from lightning_paro.strategy.levels import Level, ShardingSpec
from lightning_paro.strategy.transitions import EXACT, CommDtypes, rounds


def free_storage(t: torch.Tensor) -> None:
    """Release the memory behind ``t`` while keeping the tensor (and the views of it) alive."""
    storage = t.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def alloc_storage(t: torch.Tensor) -> bool:
    """Give ``t`` back its memory (contents undefined). Returns True if it had to allocate."""
    storage = t.untyped_storage()
    need = t.numel() * t.element_size()
    if storage.size() == need:
        return False
    storage.resize_(need)
    return True


class GatherMeter:
    """Bytes of gathered (full) parameter buffers alive at once on this rank, and their high-water mark.

    Updated on every gather and free (two integer additions); ``limit``, when set, makes a gather that would go past
    it raise (a debug check: a test bounds a rank's gathered bytes below the full model this way).
    """

    def __init__(self) -> None:
        self.alive = 0
        """Gathered bytes alive now."""
        self.peak = 0
        """The most gathered bytes alive at any moment since the last :meth:`reset_peak`."""
        self.limit: int | None = None
        """Raise on a gather past this many bytes (None: no check)."""

    def add(self, nbytes: int) -> None:
        if self.limit is not None and self.alive + nbytes > self.limit:
            raise RuntimeError(f"PaRO gather of {nbytes} bytes would hold {self.alive + nbytes} gathered parameter"
                               f" bytes at once, over the limit of {self.limit}.")
        self.alive += nbytes
        self.peak = max(self.peak, self.alive)

    def sub(self, nbytes: int) -> None:
        self.alive -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.alive


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its flat buffer."""

    name: str
    """Qualified name in the root module (the first name, for tied parameters)."""
    param: nn.Parameter
    """The module's parameter object (its ``.data`` is a view into the flat buffer)."""
    offset: int
    """First element in the flat buffer."""
    shape: torch.Size
    """Original shape."""

    @property
    def numel(self) -> int:
        return self.shape.numel()  # not the parameter's: it holds a local piece while its module is left sharded


class FlatGroup:
    """Flat parameter, gradient and optimizer-state storage for a set of parameters, sharded by a PaRO spec."""

    def __init__(self, slots_in: list[tuple[str, nn.Parameter]], trainable: bool, spec: ShardingSpec,
                 comm: Communicator, master_dtype: torch.dtype | None = None, comm_dtypes: CommDtypes = EXACT,
                 replicated: bool = False) -> None:
        """``slots_in`` on the meta device (a model built there) make a *deferred* group: its storage is allocated
        but no values are read or broadcast; :meth:`write_shard` fills this rank's shard and :meth:`end_deferred`
        completes the set-up (``deferred_init.py`` drives both)."""
        self.spec = spec
        self.comm = comm
        self.trainable = trainable
        self.comm_dtypes = comm_dtypes
        """The dtypes parameters and gradients travel in (``PaROStrategy(param_dtype=..., reduce_dtype=...)``)."""
        first = slots_in[0][1]
        self.deferred = first.is_meta
        """Whether the values are still to be written (:meth:`write_shard`, then :meth:`end_deferred`)."""
        self.dtype = first.dtype
        self.device = (comm.device or torch.device("cpu")) if self.deferred else first.device
        offset, slots = 0, []
        for name, p in slots_in:
            slots.append(ParamSlot(name, p, offset, p.shape))
            offset += p.numel()
        self.slots: list[ParamSlot] = slots
        self.layout = ShardLayout.of(offset, comm.topology)
        L = self.layout.padded

        p0, p1 = self.layout.range(spec.params)
        if self.deferred:
            # Nothing to read: the full buffer never holds values here, only this rank's shard is allocated.
            full = torch.empty(L, dtype=self.dtype, device=self.device)
            self.p_local = full.zero_() if spec.params == Level.N else torch.zeros(p1 - p0, dtype=self.dtype,
                                                                                  device=self.device)
        else:
            # The full buffer holds the current weights; every rank starts from rank 0's (replicas must not diverge),
            # unless the caller knows they are the same already (``replicated``: a strategy switch in place).
            full = torch.zeros(L, dtype=self.dtype, device=self.device)
            with torch.no_grad():
                for s in slots:
                    full[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))
            if torch.distributed.is_initialized() and comm.topology.world_size > 1 and not replicated:
                comm.broadcast(full, src=0)  # on the communication thread, like every collective of the strategy
            self.p_local = full if spec.params == Level.N else full[p0:p1].clone()
        """This rank's persistent parameter storage at level P."""
        self.p_full = full
        """The unsharded parameters; module parameters are views of it. Freed between uses when P != N."""
        self._views = [full[s.offset:s.offset + s.numel].view(s.shape) for s in slots]
        """Each parameter's view of the full buffer, made while it has its storage (a freed buffer cannot be
        sliced): what :meth:`view_params` points the parameters at."""
        self.view_params()
        self.gathered = True
        if spec.params != Level.N:
            free_storage(full)
            self.gathered = False

        self.g_full: torch.Tensor | None = None
        """Where autograd accumulates this rank's full local gradient across micro-steps (G == N only)."""
        self.g_shard: torch.Tensor | None = None
        """The gradient accumulated at level G across micro-steps (G != N); it holds memory from the step's first
        reduction to the end of the optimizer step."""
        self.master: nn.Parameter | None = None
        """This rank's optimizer shard (level OS); the optimizer updates it."""
        self.used = torch.zeros(len(slots), dtype=torch.int32, device=self.device)
        """Which parameters received a gradient since the last optimizer step (on this rank). On the compute device:
        it is all-reduced once per step, and an NCCL group carries no CPU tensor."""
        self.frozen_ranges: list[tuple[int, int]] = []
        """Ranges of the optimizer shard that no rank produced a gradient for: the step must leave them alone."""
        self.pending_reduce: CommHandle | None = None
        self.pending_param_sync: CommHandle | None = None
        self.quant_error: torch.Tensor | None = None
        """Error feedback of the gradient reduction quantized between groups (``CommDtypes.error_feedback``): what
        this rank's quantized sends left out so far, fp32, the size of the 1/m block that crosses groups."""
        self.params_exact = True
        """Whether the P-level storage holds the exact weights (False after a parameter sync that rounded them)."""
        self.exact_gathers = False
        """Gather in the parameters' own dtype, whatever ``comm_dtypes`` says (evaluation, export)."""
        self.gathered_rounded = False
        """The full buffer holds a gather rounded on the wire."""
        self.gather_meter = GatherMeter()
        """Where gathers and frees of ``p_full`` are counted (the engine shares one among its groups)."""
        self._master_dtype = master_dtype
        if trainable and not self.deferred:
            self._init_trainable(master_dtype)

    # ------------------------------------------------------------------ set-up
    def view_params(self) -> None:
        """Make every parameter's ``.data`` its slice of the full buffer (``_views``)."""
        for s, view in zip(self.slots, self._views):
            if s.param.is_meta:
                # `.data` cannot move a tensor off the meta device: swap in an empty one in place (the same object),
                # then set `.data` as for any other (a parameter made from the view would share its version counter)
                empty = torch.empty(0, dtype=self.dtype, device=self.device)
                torch.utils.swap_tensors(s.param, nn.Parameter(empty, requires_grad=s.param.requires_grad))
            s.param.data = view

    def shard_range(self, index: int) -> tuple[int, int] | None:
        """The elements ``[start, stop)`` of parameter ``index`` (flattened) that this rank's P-level storage holds,
        or None: what a loader reads for it."""
        s = self.slots[index]
        p0, p1 = self.layout.range(self.spec.params)
        a, b = max(s.offset, p0), min(s.offset + s.numel, p1)
        return (a - s.offset, b - s.offset) if a < b else None

    def write_shard(self, index: int, values: torch.Tensor) -> None:
        """Write the elements :meth:`shard_range` names of parameter ``index`` (``values``: those elements, or the
        whole parameter) into this rank's P-level storage, cast to its dtype and device."""
        span = self.shard_range(index)
        if span is None:
            return
        a, b = span
        flat = values.reshape(-1)
        if flat.numel() == self.slots[index].numel:
            flat = flat[a:b]
        elif flat.numel() != b - a:
            raise ValueError(f"Parameter {self.slots[index].name!r}: {flat.numel()} values given for its"
                             f" {b - a} elements on this rank (or all {self.slots[index].numel}).")
        p0 = self.layout.start(self.spec.params)
        off = self.slots[index].offset + a - p0
        with torch.no_grad():
            self.p_local[off:off + b - a].copy_(flat)

    def end_deferred(self) -> None:
        """A deferred group's shard is written: build what depends on its values (the optimizer shard)."""
        if self.deferred:
            self.deferred = False
            if self.trainable:
                self._init_trainable(self._master_dtype)
    def _init_trainable(self, master_dtype: torch.dtype | None) -> None:
        spec, L = self.spec, self.layout.padded
        if spec.grads == Level.N:
            self.g_full = torch.zeros(L, dtype=self.dtype, device=self.device)
            self.attach_grads()
        else:
            self.g_shard = torch.zeros(self.layout.shard_numel(spec.grads), dtype=self.dtype, device=self.device)
            free_storage(self.g_shard)  # allocated at the step's first reduction, freed after the optimizer step
        if transitions.keeps_error_feedback(spec, self.comm_dtypes, self.comm.topology.num_groups):
            # one gradient collective crosses groups at most; its hop reduces a 1/m block of the buffer
            self.quant_error = torch.zeros(L // self.comm.topology.group_size, dtype=torch.float32,
                                           device=self.device)
        o0, o1 = self.layout.range(spec.optim)
        p0 = self.layout.start(spec.params)
        own = self.p_local[o0 - p0:o1 - p0]
        master_dtype = master_dtype or self.dtype
        if master_dtype == self.dtype and not self.rounds_param_sync:
            # The optimizer updates the parameter storage in place: no separate master copy.
            self.master = nn.Parameter(own, requires_grad=True)
        else:
            self.master = nn.Parameter(own.detach().to(master_dtype).clone(), requires_grad=True)

    def attach_grads(self) -> None:
        """Point every parameter's ``.grad`` at its slice of ``g_full`` so autograd accumulates in place."""
        for s in self.slots:
            s.param.grad = self.g_full[s.offset:s.offset + s.numel].view(s.shape)

    def detach_grads(self) -> None:
        for s in self.slots:
            s.param.grad = None

    @property
    def rounds_param_sync(self) -> bool:
        """Whether the OS -> P sync rounds what it writes (parameters travel in fewer bits than they are stored in,
        or quantized): the optimizer's master copy must then be kept apart from the P-level storage."""
        return transitions.param_sync_rounds(self.spec, self.comm_dtypes, self.dtype)

    @property
    def own_param_slot(self) -> torch.Tensor:
        """This rank's OS-level slice of its P-level storage."""
        o0, o1 = self.layout.range(self.spec.optim)
        p0 = self.layout.start(self.spec.params)
        return self.p_local[o0 - p0:o1 - p0]

    # ------------------------------------------------------------------ parameters
    def gather_params(self, async_op: bool) -> CommHandle | None:
        """All-gather the P-level shards into the full buffer (``transitions.gather_params``)."""
        if self.spec.params == Level.N or self.gathered:
            return None
        (gather,) = transitions.gather_params(self.spec.params, EXACT if self.exact_gathers else self.comm_dtypes)
        self.gather_meter.add(self.full_bytes)
        alloc_storage(self.p_full)
        self.gathered = True
        wire = gather.wire_dtype(self.dtype)
        self.gathered_rounded = rounds(gather, self.dtype)
        full = self.p_full if wire == self.dtype else torch.empty(self.layout.padded, dtype=wire, device=self.device)
        # (a quantized gather dequantizes into the buffer as it is)
        p0, _ = self.layout.range(self.spec.params)
        shard, local = full[p0:p0 + self.p_local.numel()], self.p_local
        # The copy runs on the communication thread, after any parameter sync still writing p_local.
        self.comm.submit(lambda: shard.copy_(local), async_op=True, what="parameter copy before all_gather",
                         scope=gather.scope)
        handle = self.comm.all_gather(full, shard, gather.scope, async_op=async_op, quant=gather.quant)
        if full is self.p_full:
            return handle
        p_full = self.p_full
        return self.comm.submit(lambda: p_full.copy_(full), async_op=async_op,
                                what="parameter copy after all_gather", scope=gather.scope)

    def free_params(self) -> None:
        if self.spec.params != Level.N and self.gathered:
            free_storage(self.p_full)
            self.gathered = False
            self.gathered_rounded = False
            self.gather_meter.sub(self.full_bytes)

    @property
    def full_bytes(self) -> int:
        """Bytes of the gathered (full, padded) parameter buffer."""
        return self.p_full.numel() * self.p_full.element_size()

    # ------------------------------------------------------------------ gradients
    def prepare_grads(self) -> None:
        """Before this group's backward. G == N: point ``.grad`` at the persistent full gradient, so autograd
        accumulates every micro-step into it. G != N: clear ``.grad``, so autograd hands each parameter's gradient
        over as it computes it (no copy, nothing allocated before it is needed); :meth:`reduce_grads` flattens them.

        Re-attached every micro-step: ``module.zero_grad()`` (which Lightning calls at the start of a stage) drops
        the views.
        """
        if not self.trainable:
            return
        if self.spec.grads == Level.N:
            self.attach_grads()
        else:
            self.detach_grads()

    def reduce_grads(self) -> None:
        """After this group's backward (G != N): flatten the parameters' gradients into one buffer (a parameter
        with no gradient contributes zeros) and reduce-scatter it into the G-level accumulator.

        Runs asynchronously; the flat buffer is released once the reduction has consumed it, the parameters'
        gradients at once.
        """
        if not self.trainable or self.spec.grads == Level.N:
            return
        grads = [s.param.grad for s in self.slots]
        if all(g is None for g in grads):
            return  # no gradient reached this group in this micro-step
        (reduce,) = transitions.reduce_grads(self.spec.grads, self.comm_dtypes)
        # flattened straight into the dtype the reduction travels in
        flat = torch.empty(self.layout.padded, dtype=reduce.wire_dtype(self.dtype), device=self.device)
        with torch.no_grad():
            end = 0
            for s, g in zip(self.slots, grads):
                if s.offset > end:
                    flat[end:s.offset].zero_()
                dst = flat[s.offset:s.offset + s.numel]
                if g is None:
                    dst.zero_()
                else:
                    dst.copy_(g.reshape(-1))
                end = s.offset + s.numel
            flat[end:].zero_()
        self.detach_grads()
        del grads
        self._ensure_grad_shard()
        tmp = torch.empty(self.g_shard.numel(), dtype=flat.dtype, device=self.device)
        self.comm.reduce_scatter(tmp, flat, reduce.scope, async_op=True, quant=reduce.quant,
                                 error=self.quant_error if reduce.quant else None)
        g_shard = self.g_shard

        def accumulate() -> None:
            g_shard.add_(tmp)  # in the accumulator's dtype
            free_storage(flat)

        # Queued behind the reduce-scatter: if that fails, this never runs (tmp holds no gradient then).
        if self.pending_reduce is not None:
            self.pending_reduce.wait()  # an earlier reduction of this group in this micro-step (a unit run twice)
        self.pending_reduce = self.comm.submit(accumulate, what="gradient accumulation after reduce_scatter",
                                               scope=reduce.scope)

    def sync_grads(self) -> torch.Tensor:
        """Once per optimizer step: bring the accumulated gradient to level OS (``transitions.grads_to_optim``),
        averaged over all n ranks."""
        spec, topo = self.spec, self.comm.topology
        if self.pending_reduce is not None:
            self.pending_reduce.wait()
            self.pending_reduce = None
        if spec.grads != Level.N:
            self._ensure_grad_shard()  # no gradient reached this group in the whole step: zeros
        grad = self.g_full if spec.grads == Level.N else self.g_shard
        ranks = {"intra": topo.group_size, "inter": topo.num_groups, "global": topo.world_size}
        sync = transitions.grads_to_optim(spec.grads, spec.optim, self.comm_dtypes)
        buf = grad if not sync else grad.to(sync[0].wire_dtype(self.dtype))  # the same tensor in its own dtype
        for c in sync:
            error = self.quant_error if c.quant else None
            if c.op == "all_reduce":
                self.comm.all_reduce(buf, c.scope, quant=c.quant, error=error)
            else:  # reduce_scatter: this rank's slice of the sum
                out = torch.empty(buf.numel() // ranks[c.scope], dtype=buf.dtype, device=self.device)
                self.comm.reduce_scatter(out, buf, c.scope, quant=c.quant, error=error)
                buf = out
        if buf is not grad:  # back to the accumulator's dtype
            grad = grad.copy_(buf) if buf.numel() == grad.numel() else buf.to(self.dtype)
        grad.div_(topo.world_size)
        self.master.grad = grad if grad.dtype == self.master.dtype else grad.to(self.master.dtype)
        return self.master.grad

    def zero_grad_accumulators(self) -> None:
        """After the optimizer step. G == N: zero the full gradient autograd accumulates into. G != N: release the
        G-level accumulator until the next step's first reduction (evaluation and the forward before it need none)."""
        if self.spec.grads == Level.N:
            self.g_full.zero_()
        else:
            free_storage(self.g_shard)

    def _ensure_grad_shard(self) -> None:
        """Give the G-level accumulator its memory, zeroed, if the step has not yet."""
        if alloc_storage(self.g_shard):
            self.g_shard.zero_()

    # ------------------------------------------------------------------ after the optimizer step
    def sync_params(self) -> None:
        """Launch the OS -> P parameter sync asynchronously; :meth:`wait_param_sync` waits for it at first use."""
        self._sync_params(self.comm_dtypes)

    def exact_params(self) -> None:
        """Make the P-level storage hold the exact weights if the last parameter sync rounded them (collective over
        the sync's scope; every rank's flags agree, as they follow the same steps): the sync again, in the
        parameters' own dtype. Waits for it."""
        self.wait_param_sync()
        if not self.params_exact:
            self._sync_params(EXACT)
            self.wait_param_sync()

    def _sync_params(self, comm_dtypes: CommDtypes) -> None:
        own = self.own_param_slot
        sync = transitions.optim_to_params(self.spec.optim, self.spec.params, comm_dtypes)  # one all-gather, or none
        wire = sync[0].wire_dtype(self.dtype) if sync else self.dtype
        if wire == self.dtype and not any(c.quant for c in sync):
            if self.master.data_ptr() != own.data_ptr():
                with torch.no_grad():
                    own.copy_(self.master)
            for c in sync:
                self.pending_param_sync = self.comm.all_gather(self.p_local, own, c.scope, async_op=True)
            self.params_exact = True
            return
        # Through a buffer of the wire dtype: every rank's P-level storage gets what arrives, its own slice too, so
        # all ranks compute with the same weights (the master stays apart: ``rounds_param_sync``).
        (c,) = sync
        buf = torch.empty(self.p_local.numel(), dtype=wire, device=self.device)
        o0, o1 = self.layout.range(self.spec.optim)
        p0 = self.layout.start(self.spec.params)
        shard = buf[o0 - p0:o1 - p0]
        with torch.no_grad():
            shard.copy_(self.master)
        self.comm.all_gather(buf, shard, c.scope, async_op=True, quant=c.quant)
        p_local = self.p_local
        self.pending_param_sync = self.comm.submit(lambda: p_local.copy_(buf), what="parameter copy after all_gather",
                                                   scope=c.scope)
        self.params_exact = not rounds(c, self.dtype)

    def wait_param_sync(self) -> None:
        if self.pending_param_sync is not None:
            self.pending_param_sync.wait()
            self.pending_param_sync = None

    def set_unused(self, used_anywhere: torch.Tensor) -> None:
        """Record which slices of the optimizer shard belong to parameters no rank used in this step."""
        o0, o1 = self.layout.range(self.spec.optim)
        ranges = []
        for s, used in zip(self.slots, used_anywhere.tolist()):
            if not used:
                a, b = max(s.offset, o0), min(s.offset + s.numel, o1)
                if a < b:
                    ranges.append((a - o0, b - o0))
        self.frozen_ranges = ranges

    # ------------------------------------------------------------------ accounting
    def state_bytes(self) -> dict[str, int]:
        """Persistent bytes this rank holds for this group: parameters (P), gradients (G), and a separate master."""
        out = {"params": self.p_local.numel() * self.p_local.element_size(), "grads": 0, "master": 0}
        if self.trainable:
            g = self.g_full if self.spec.grads == Level.N else self.g_shard
            out["grads"] = g.numel() * g.element_size()
            if self.quant_error is not None:  # error feedback: kept beside the gradients
                out["grads"] += self.quant_error.numel() * self.quant_error.element_size()
            if self.master.data_ptr() != self.own_param_slot.data_ptr():
                out["master"] = self.master.numel() * self.master.element_size()
        return out

    # ------------------------------------------------------------------ the module left sharded
    def show_local_pieces(self) -> None:
        """Point each parameter's ``.data`` at this rank's piece of it: a 1-D view of the P-level storage (empty where
        this rank holds none of it), so that a module left sharded between stages holds only readable memory. The
        full buffer is freed (P != N). :meth:`view_params` points them back at the full buffer."""
        if self.spec.params == Level.N:
            return
        self.free_params()
        p0 = self.layout.start(self.spec.params)
        for index, s in enumerate(self.slots):
            span = self.shard_range(index)
            a, b = (s.offset + span[0] - p0, s.offset + span[1] - p0) if span is not None else (0, 0)
            s.param.data = self.p_local[a:b]
