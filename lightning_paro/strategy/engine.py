"""The PaRO sharding engine: one engine for all 14 strategies, parameterised by the three levels.

It turns a plain ``nn.Module`` into one whose parameters, gradients and optimizer states live in per-unit
:class:`FlatGroup` buffers sharded as the :class:`ShardingSpec` says, and drives them with module hooks:

* forward: a unit's parameters are gathered before its forward (the next unit's gather is prefetched while this one
  computes) and freed after it (P = I or G);
* backward: gathered again before the unit's backward, and after it the unit's gradient is reduce-scattered to
  level G asynchronously while the rest of backward runs (G = I or G);
* at the accumulation boundary, :meth:`PaROEngine.finish_backward` syncs gradients to the OS level (the only
  inter-group traffic when neither P nor G is G), the optimizer updates the local OS shard, and
  :meth:`PaROEngine.after_optimizer_step` launches the OS -> P parameter sync, waited for at each unit's first use.

The engine is independent of Lightning: the strategy calls ``pre_step``, ``finish_backward`` and
``after_optimizer_step``; plain PyTorch loops can do the same.
"""

from __future__ import annotations

import enum
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_paro.comm.collectives import Communicator
from lightning_paro.strategy.flat import FlatGroup, GatherMeter
from lightning_paro.strategy.levels import Level, ShardingSpec
from lightning_paro.strategy.transitions import EXACT, SCOPE_OF, CommDtypes
from lightning_paro.strategy.evaluation import ShardedEvaluation
from lightning_paro.strategy.units import Unit, UnitPolicy, find_units

ROOT = "<root>"

_ENGINES: weakref.WeakValueDictionary[int, PaROEngine] = weakref.WeakValueDictionary()
"""The engine that shards each module, by ``id(module)``: a new engine gives the module back from the previous one
first (its hooks would stay on the module, and keep its buffers alive, otherwise)."""


class Mode(enum.Enum):
    SHARDED = "sharded"
    """Training: gather before use, free after use."""
    FULL = "full"
    """Evaluation: every unit stays gathered, hooks do nothing (no collectives per batch, so ranks may run
    different numbers of batches)."""
    EVAL = "eval"
    """Sharded evaluation: the root unit stays gathered, the other units are gathered one at a time (with prefetch)
    and freed after their forward; ranks that ran out of batches replay the gathers of their peers' steps (see
    :meth:`PaROEngine.begin_eval`)."""


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the unit's own backward is complete."""

    @staticmethod
    def forward(ctx, engine: PaROEngine, unit: Unit, *inputs: torch.Tensor):
        ctx.engine, ctx.unit = engine, unit
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine._unit_post_backward(ctx.unit)
        return (None, None, *grads)


class PaROEngine:
    """Shards one module's model states according to a :class:`ShardingSpec`.

    Args:
        module: the model; its parameters become views into flat buffers (it stays the same object).
        spec: the strategy, e.g. ``ShardingSpec.parse("IIG")``.
        comm: the communicator over the PaRO topology.
        optimizers: the optimizers built over ``module``'s parameters; their param groups are rewritten to hold
            this rank's optimizer shards. Without optimizers (evaluation) nothing is trainable.
        units: which submodules are units (see :func:`find_units`).
        prefetch: how many units ahead to gather (0 disables prefetching).
        master_dtype: dtype of the optimizer shard (defaults to the parameter dtype; fp32 for bf16 parameters).
        comm_dtypes: the dtypes parameters and gradients travel in during training (default: their own). Evaluation,
            checkpoints and the module after fit read exact weights (:meth:`exact_params`).
    """

    def __init__(self, module: nn.Module, spec: ShardingSpec, comm: Communicator,
                 optimizers: Iterable[Optimizer] = (), units: UnitPolicy = "auto", prefetch: int = 1,
                 master_dtype: torch.dtype | None = None, comm_dtypes: CommDtypes = EXACT) -> None:
        self.module = module
        self.spec = spec
        self.comm = comm
        self.comm_dtypes = comm_dtypes
        self.prefetch = max(0, int(prefetch))
        self._mode = Mode.SHARDED
        self.optimizers = list(optimizers)
        self._hooks: list[RemovableHandle] = []
        self._order: list[Unit] = []  # execution order seen in the last forward
        self._seen: list[Unit] = []
        self._reducing: Unit | None = None  # the unit whose gradient reduction was issued last in this backward
        self.attached = True
        """Whether the module's parameters are this engine's (False once :meth:`restore_module` gave them back)."""
        _check_module(module)
        previous = _ENGINES.get(id(module))
        if previous is not None and previous.module is module and previous.attached:
            # Another Trainer's strategy sharded this module before (one LightningModule, two Trainers).
            previous.restore_module()
        self._flat_by_master: dict[int, FlatGroup] = {}
        self.units: list[Unit] = self._build_units(units, master_dtype)
        self.root: Unit = self.units[-1]
        self.gather_meter = GatherMeter()
        """Gathered parameter bytes alive on this rank, their high-water mark, and an optional limit (debug)."""
        for f in self.flat_groups():
            f.gather_meter = self.gather_meter
        self.evaluation: ShardedEvaluation | None = None
        """The rounds of the sharded evaluation stage in progress (mode EVAL)."""
        self.eval_rounds = 0
        """Rounds of sharded evaluation this rank took part in (one scalar all-reduce each)."""
        self._adopt_optimizers()
        self._register_hooks()
        _broadcast_buffers(module, comm)
        _ENGINES[id(module)] = self

    # ------------------------------------------------------------------ construction
    def _build_units(self, policy: UnitPolicy, master_dtype: torch.dtype | None) -> list[Unit]:
        names = _param_names(self.module)
        owner: dict[int, set[str]] = {}
        unit_mods = find_units(self.module, policy)
        for uname, mod in unit_mods:
            for p in mod.parameters():
                owner.setdefault(id(p), set()).add(uname)
        group_of = _optimizer_group_index(self.optimizers, names)
        self.original_param_groups: list[list[list[str]]] = [
            [[names[id(p)][0] for p in g["params"]] for g in opt.param_groups] for opt in self.optimizers]
        """Per optimizer and param group, the parameter names in the order the user built them (checkpoints)."""
        per_unit: dict[str, OrderedDict] = {u: OrderedDict() for u, _ in unit_mods}
        per_unit[ROOT] = OrderedDict()
        for pid, (name, p) in names.items():
            us = owner.get(pid, set())
            # A parameter shared by several units (tied weights) lives in the root unit, gathered for the whole step.
            uname = next(iter(us)) if len(us) == 1 else ROOT
            trainable = p.requires_grad and pid in group_of
            key = (group_of.get(pid) if trainable else None, p.dtype, p.device)
            per_unit[uname].setdefault(key, []).append((name, p))
        self._untracked = [n for pid, (n, p) in names.items()
                           if self.optimizers and p.requires_grad and pid not in group_of]
        units = []
        modules = dict(unit_mods)
        modules[ROOT] = self.module
        for uname, groups in per_unit.items():
            flats = []
            for (gidx, dtype, _dev), entries in groups.items():
                mdtype = master_dtype if master_dtype is not None else (
                    torch.float32 if dtype in (torch.bfloat16, torch.float16) else None)
                flat = FlatGroup(entries, trainable=gidx is not None, spec=self.spec, comm=self.comm,
                                 master_dtype=mdtype, comm_dtypes=self.comm_dtypes)
                flat.optimizer_group = gidx
                flats.append(flat)
            units.append(Unit(uname, modules[uname], flats))
        return units

    def _adopt_optimizers(self) -> None:
        groups: dict[tuple[int, int], list[nn.Parameter]] = {}
        for unit in self.units:
            for f in unit.flats:
                if f.trainable:
                    groups.setdefault(f.optimizer_group, []).append(f.master)
                    self._flat_by_master[id(f.master)] = f
        for unit in self.units:
            for f in unit.flats:
                if f.trainable:
                    for k, slot in enumerate(f.slots):
                        self._hooks.append(slot.param.register_post_accumulate_grad_hook(_mark_used(f.used, k)))
        for oi, opt in enumerate(self.optimizers):
            self._hooks.append(opt.register_step_post_hook(self._restore_unused))
            if len(opt.state) != 0:
                raise RuntimeError(
                    f"Optimizer {type(opt).__name__} already has state before sharding. Create optimizers in"
                    " `configure_optimizers` and step them only through the Trainer (the strategy shards them)."
                )
            for gi, group in enumerate(opt.param_groups):
                group["params"] = groups.get((oi, gi), [])

    @property
    def mode(self) -> Mode:
        """Training (SHARDED) or one of the evaluation modes; only training gathers in ``comm_dtypes``."""
        return self._mode

    @mode.setter
    def mode(self, mode: Mode) -> None:
        self._mode = mode
        for f in self.flat_groups():
            f.exact_gathers = mode is not Mode.SHARDED

    @contextmanager
    def _exact_gathers(self) -> Iterator[None]:
        """Gathers in the parameters' own dtype inside the block, whatever the mode."""
        flats = self.flat_groups()
        before = [f.exact_gathers for f in flats]
        for f in flats:
            f.exact_gathers = True
        try:
            yield
        finally:
            for f, b in zip(flats, before):
                f.exact_gathers = b

    def exact_params(self) -> None:
        """Collective. Make every rank's parameter storage hold the exact weights where training left them rounded
        (``comm_dtypes`` with parameters in fewer bits than stored): drop gathered units rounded on the wire and run
        the OS -> P sync again in the parameters' own dtype. Nothing to do otherwise. Runs before evaluation,
        checkpoints and handing the module back."""
        for unit in self.units:
            if any(f.gathered_rounded for f in unit.flats):
                unit.free()
        for f in self.flat_groups():
            if f.trainable:
                f.exact_params()

    # ------------------------------------------------------------------ hooks
    def _register_hooks(self) -> None:
        for unit in self.units[:-1]:
            self._hooks.append(unit.module.register_forward_pre_hook(
                self._make_pre_forward(unit), with_kwargs=True))
            self._hooks.append(unit.module.register_forward_hook(self._make_post_forward(unit)))

    def _make_pre_forward(self, unit: Unit):
        def hook(module: nn.Module, args: tuple, kwargs: dict):
            if self.mode is Mode.EVAL:
                self.evaluation.enter(unit)
                return None
            if self.mode is not Mode.SHARDED:
                return None
            unit.ensure_ready()
            if unit not in self._seen:
                self._seen.append(unit)
            self._prefetch_after(unit, forward=True)
            if torch.is_grad_enabled() and (unit.trainable or unit.sharded_params):
                return _wrap_inputs(self, unit, args, kwargs)
            return None
        return hook

    def _make_post_forward(self, unit: Unit):
        def hook(module: nn.Module, args: tuple, output: Any):
            if self.mode is Mode.EVAL:
                unit.free()
                return None
            if self.mode is not Mode.SHARDED:
                return None
            if unit.sharded_params:
                unit.free()
            if torch.is_grad_enabled():
                tensors = [t for t in _tensors(output) if t.requires_grad]
                if tensors:
                    unit.backward_started = False
                    unit.backward_done = False
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, lambda _grads: self._unit_pre_backward(unit), mode="any")
            return None
        return hook

    def _unit_pre_backward(self, unit: Unit) -> None:
        unit.pre_backward()
        self._prefetch_after(unit, forward=False)

    def _unit_post_backward(self, unit: Unit) -> None:
        if unit.post_backward(free=unit.sharded_params, previous=self._reducing):
            self._reducing = unit

    def _prefetch_after(self, unit: Unit, forward: bool) -> None:
        if not self.prefetch or unit not in self._order:
            return
        pos = self._order.index(unit)
        step = 1 if forward else -1
        for k in range(1, self.prefetch + 1):
            idx = pos + step * k
            if 0 <= idx < len(self._order):
                nxt = self._order[idx]
                if nxt.sharded_params:
                    nxt.gather(async_op=True)

    # ------------------------------------------------------------------ step protocol
    def pre_step(self) -> None:
        """Before a training step: make the root unit's parameters usable and its gradients ready."""
        self.mode = Mode.SHARDED
        self._seen = []
        self.root.ensure_ready()
        self.root.backward_started = False
        self.root.backward_done = False
        self.root.pre_backward()

    def finish_backward(self, sync: bool) -> None:
        """After ``loss.backward()``: complete every unit's reduction; with ``sync`` (the accumulation boundary),
        bring the gradients to the optimizer-state level."""
        if self._seen:
            self._order = list(self._seen)
        for unit in [*reversed(self._order), self.root]:
            self._unit_post_backward(unit)
        self._reducing = None
        if sync:
            self.sync_grads()

    def sync_grads(self) -> None:
        flats = [f for f in self.flat_groups() if f.trainable]
        for f in flats:
            f.sync_grads()
        # Which parameters got a gradient on any rank: those that did not keep their value and optimizer state
        # through the step, as torch optimizers skip parameters whose .grad is None.
        if flats:
            used = torch.cat([f.used for f in flats])  # on the compute device, where the flags live
            self.comm.scalar_all_reduce(used, "global")
            for f, u in zip(flats, used.split([len(f.slots) for f in flats])):
                f.set_unused(u)
            self._protect_unused()

    def _protect_unused(self) -> None:
        """Snapshot the optimizer-shard slices of unused parameters (and their optimizer state) before the step.

        Runs after the gradient sync, i.e. inside the optimizer's closure, just before ``optimizer.step`` proper.
        """
        self._saved = {}
        for opt in self.optimizers:
            for p in self.masters(opt):
                f = self._flat_by_master[id(p)]
                if not f.frozen_ranges:
                    continue
                tensors = [p] + [v for v in opt.state.get(p, {}).values() if torch.is_tensor(v) and v.shape == p.shape]
                copies = [[t.detach()[a:b].clone() for a, b in f.frozen_ranges] for t in tensors]
                self._saved.setdefault(id(opt), []).append((p, f, len(tensors), copies))

    def _restore_unused(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            for p, f, count, copies in getattr(self, "_saved", {}).pop(id(optimizer), []):
                # state tensors created by this (first) step did not exist at snapshot time: reset them to zero
                tensors = [p] + [v for v in optimizer.state.get(p, {}).values()
                                 if torch.is_tensor(v) and v.shape == p.shape]
                for i, t in enumerate(tensors):
                    for k, (a, b) in enumerate(f.frozen_ranges):
                        if i < count:
                            t.detach()[a:b].copy_(copies[i][k])
                        else:
                            t.detach()[a:b].zero_()

    def masters(self, optimizer: Optimizer | None = None) -> list[nn.Parameter]:
        """The optimizer shards (of one optimizer, or all)."""
        opts = [optimizer] if optimizer is not None else self.optimizers
        return [p for o in opts for g in o.param_groups for p in g["params"]]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, optimizer: Optimizer | None = None, eps: float = 1e-6) -> torch.Tensor:
        """Clip the OS-level gradients by their global 2-norm.

        The sum of squares is reduced only over the ranks that hold *disjoint* shards (all ranks for OS = G, the
        group for OS = I, nobody for OS = N): reducing over replicas would count them several times.
        """
        grads = [p.grad for p in self.masters(optimizer) if p.grad is not None]
        # On the compute device even when this rank holds no gradient: the sum is all-reduced.
        device = grads[0].device if grads else next((f.device for f in self.flat_groups()), self.comm.device)
        sq = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            sq += g.detach().float().pow(2).sum()
        if self.spec.optim != Level.N:
            self.comm.scalar_all_reduce(sq, SCOPE_OF[self.spec.optim])
        total = sq.sqrt()
        coef = torch.clamp(max_norm / (total + eps), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    def after_optimizer_step(self, optimizer: Optimizer | None = None) -> None:
        """Launch the OS -> P parameter sync (waited for at first use) and reset the gradient accumulators."""
        masters = {id(p) for p in self.masters(optimizer)}
        for unit in self.units:
            for f in unit.flats:
                if f.trainable and id(f.master) in masters:
                    f.sync_params()
                    f.zero_grad_accumulators()
                    f.master.grad = None
                    f.used.zero_()
                    f.frozen_ranges = []

    # ------------------------------------------------------------------ evaluation and export
    def materialize(self) -> None:
        """Gather every unit and keep it gathered (evaluation): no collectives per batch. The weights are exact."""
        self.exact_params()
        with self._exact_gathers():
            for unit in self.units:
                unit.wait_param_sync()
                unit.gather(async_op=True)
            for unit in self.units:
                unit.wait_gather()
        self.mode = Mode.FULL

    def release(self) -> None:
        """Back to training mode: free what is sharded."""
        for unit in self.units:
            if unit.sharded_params:
                unit.free()
        self.mode = Mode.SHARDED
        self.evaluation = None

    @property
    def full_param_bytes(self) -> int:
        """Bytes of every parameter buffer gathered at once (padded): what :meth:`materialize` holds."""
        return sum(f.full_bytes for f in self.flat_groups())

    # Sharded evaluation (evaluation.py): the engine gathers the root unit and hands the stage's rounds to a
    # ShardedEvaluation; the unit hooks call it while the mode is EVAL.
    def begin_eval(self) -> None:
        """Start a sharded evaluation stage (collective over the P scope): the root unit is gathered for the whole
        stage, the other units in each forward. With P = N this is :meth:`materialize` (nothing to gather)."""
        if not self.root.sharded_params:
            self.materialize()
            return
        self.wait()
        self.release()
        self.exact_params()
        with self._exact_gathers():
            self.root.ensure_ready()
        self.evaluation = ShardedEvaluation(self, [u for u in self._order if u is not self.root] or self.units[:-1])
        self.mode = Mode.EVAL

    def eval_step_begin(self) -> None:
        """Before an evaluation step: this rank's round, flag 1 (running)."""
        if self.mode is Mode.EVAL:
            self.evaluation.step_begin()

    def eval_step_end(self, last: bool) -> None:
        """After an evaluation step; ``last``: this rank has no more batches in this stage, so it serves its peers'
        gathers until every rank has run its last step."""
        if self.mode is Mode.EVAL:
            self.evaluation.step_end(last)

    def join(self) -> None:
        """Serve the peers' gathers until every rank of the P scope has run its last step (collective)."""
        if self.mode is Mode.EVAL:
            self.evaluation.join()

    def end_eval(self) -> None:
        """End of an evaluation stage: join if the last step did not, then free what is sharded."""
        if self.mode is Mode.EVAL:
            self.join()
        if self.mode in (Mode.EVAL, Mode.FULL):
            self.release()

    def control_device(self) -> torch.device:
        """Where the engine's control tensors (flags, norms) live: the compute device."""
        if self.comm.device is not None:
            return self.comm.device
        return next((f.device for f in self.flat_groups()), torch.device("cpu"))

    @torch.no_grad()
    def full_state_dict(self, rank0_only: bool = False, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The module's state dict with full tensors copied to ``device``, gathered one unit at a time (collective):
        the device holds at most one more unit than it does already. With ``rank0_only`` other ranks take part in
        the gathers and return an empty dict."""
        self.wait()
        self.exact_params()
        keep = rank0_only is False or self.comm.topology.rank == 0
        copies: dict[int, torch.Tensor] = {}
        for unit in self.units:
            was_gathered = all(f.gathered for f in unit.flats)
            with self._exact_gathers():
                unit.ensure_ready()
            if keep:
                for f in unit.flats:
                    for s in f.slots:
                        copies[id(s.param)] = s.param.detach().to(device, copy=True)
            if not was_gathered:
                unit.free()
        if not keep:
            return {}
        return {k: copies[id(v)] if id(v) in copies else v.detach().to(device, copy=True)
                for k, v in self.module.state_dict(keep_vars=True).items()}

    def wait(self) -> None:
        """Wait for every collective in flight."""
        for unit in self.units:
            unit.wait_param_sync()
            unit.wait_gather()
            unit.wait_reduce()

    def restore_module(self) -> None:
        """Give the module back full, independent parameters and remove every hook (collective)."""
        self.wait()
        self.materialize()
        with torch.no_grad():
            for unit in self.units:
                for f in unit.flats:
                    for s in f.slots:
                        s.param.data = s.param.data.clone()
                        s.param.grad = None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.mode = Mode.FULL
        self.attached = False
        if _ENGINES.get(id(self.module)) is self:
            del _ENGINES[id(self.module)]

    def holds(self, module: nn.Module) -> bool:
        """Whether this engine still shards ``module`` as it was built: the same parameter objects under the same
        names, with the same shapes, dtypes and devices (``configure_model`` or a precision change may have replaced
        them between stages)."""
        if module is not self.module or not self.attached:
            return False
        slots = {id(s.param): (s, f) for f in self.flat_groups() for s in f.slots}
        names = _param_names(module)
        if names.keys() != slots.keys():
            return False
        for pid, (name, p) in names.items():
            s, f = slots[pid]
            if name != s.name or p.shape != s.shape or p.dtype != f.dtype or p.device != f.device:
                return False
        return True

    def adopt_module_values(self) -> None:
        """Collective. Take the module's current parameter values into this rank's shards, and rank 0's buffers,
        keeping the optimizers and their states: for a stage that runs after fit on the same engine.

        The module's values are the truth, as they are under "ddp": the user may have loaded weights into it after
        fit, or moving it between devices may have given its parameters storage of their own (they become views of
        the engine's buffers again). A separate master copy is refreshed only where it no longer rounds to the
        parameters, so an unchanged one keeps its extra precision. The module is left gathered, as after fit.

        A module left sharded after fit has no other values than the shards: nothing is gathered then.
        """
        self.wait()
        if self.mode is not Mode.FULL and self.root.sharded_params:
            _broadcast_buffers(self.module, self.comm)
            return
        self.materialize()
        with torch.no_grad():
            for f in self.flat_groups():
                for s in f.slots:
                    if not _is_view(s.param, f.p_full, s.offset):
                        f.p_full[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))
                        s.param.data = f.p_full[s.offset:s.offset + s.numel].view(s.shape)
                if f.spec.params != Level.N:
                    p0, p1 = f.layout.range(f.spec.params)
                    f.p_local.copy_(f.p_full[p0:p1])
                if _master_differs(f):
                    o0, o1 = f.layout.range(f.spec.optim)
                    f.master.copy_(f.p_full[o0:o1])
        _broadcast_buffers(self.module, self.comm)

    def prepare_next_forward(self) -> None:
        """Manual optimization: get the root unit ready for another forward and backward in the same training step.

        The root unit is gathered once per training step and freed by the backward; after an optimizer step a
        gathered copy holds the old weights. Gather it again with the current weights and attach its gradients.
        """
        root = self.root
        if root.sharded_params:
            root.free()
        root.ensure_ready()
        root.backward_started = False
        root.backward_done = False
        root.pre_backward()

    def after_load(self) -> None:
        """After new weights were written into this rank's parameter shards: refresh separate master copies and
        drop any gathered copy (it holds the old weights)."""
        with torch.no_grad():
            for f in self.flat_groups():
                if f.trainable and f.master.data_ptr() != f.own_param_slot.data_ptr():
                    f.master.copy_(f.own_param_slot)
                f.params_exact = True
                if f.spec.params != Level.N:
                    f.free_params()
        if self.mode is Mode.FULL:
            self.materialize()
        elif self.mode is Mode.EVAL:
            self.root.ensure_ready()

    def memory_report(self) -> dict[str, int]:
        """Persistent per-rank bytes of model states held by the engine (padding included).

        ``params``: compute parameters at level P; ``grads``: gradient accumulators at level G; ``optim``: optimizer
        states of this rank's shard plus any separate master copy; ``transient_params``: gathered parameters alive
        right now (P != N).
        """
        out = {"params": 0, "grads": 0, "optim": 0, "transient_params": 0}
        for unit in self.units:
            for f in unit.flats:
                b = f.state_bytes()
                out["params"] += b["params"]
                out["grads"] += b["grads"]
                out["optim"] += b["master"]
                if f.spec.params != Level.N and f.gathered:
                    out["transient_params"] += f.p_full.numel() * f.p_full.element_size()
        seen: set[int] = set()
        for opt in self.optimizers:
            for state in opt.state.values():
                for v in state.values():
                    if torch.is_tensor(v) and id(v) not in seen:
                        seen.add(id(v))
                        out["optim"] += v.numel() * v.element_size()
        return out

    def num_params(self) -> dict[str, int]:
        """Psi (all parameters), Psi' (trainable) and their padded totals."""
        out = {"total": 0, "trainable": 0, "total_padded": 0, "trainable_padded": 0}
        for unit in self.units:
            for f in unit.flats:
                out["total"] += f.layout.numel
                out["total_padded"] += f.layout.padded
                if f.trainable:
                    out["trainable"] += f.layout.numel
                    out["trainable_padded"] += f.layout.padded
        return out

    def flat_of(self, master: nn.Parameter) -> FlatGroup:
        """The flat group an optimizer shard belongs to."""
        return self._flat_by_master[id(master)]

    def flat_groups(self) -> list[FlatGroup]:
        return [f for u in self.units for f in u.flats]


# ---------------------------------------------------------------------- helpers
def _param_names(module: nn.Module) -> OrderedDict:
    names: OrderedDict = OrderedDict()
    for name, p in module.named_parameters(remove_duplicate=True):
        names[id(p)] = (name, p)
    return names


def _optimizer_group_index(optimizers: list[Optimizer], names: OrderedDict) -> dict[int, tuple[int, int]]:
    index: dict[int, tuple[int, int]] = {}
    for oi, opt in enumerate(optimizers):
        for gi, group in enumerate(opt.param_groups):
            for p in group["params"]:
                if id(p) not in names:
                    raise ValueError(
                        f"Optimizer {oi} ({type(opt).__name__}) holds a tensor of shape {tuple(p.shape)} that is not a"
                        " parameter of the LightningModule. Build optimizers from `self.parameters()` (or submodules)"
                        " inside `configure_optimizers`."
                    )
                if id(p) in index:
                    raise ValueError(f"Parameter {names[id(p)][0]!r} appears in more than one optimizer param group.")
                index[id(p)] = (oi, gi)
    return index


def _check_module(module: nn.Module) -> None:
    for name, p in module.named_parameters():
        if p.is_meta:
            raise ValueError(
                f"Parameter {name!r} is on the meta device. Materialise the model (e.g. in `configure_model`) before"
                " the strategy shards it."
            )
        if p.is_sparse or p.layout != torch.strided:
            raise ValueError(f"Parameter {name!r} is not a dense strided tensor; the PaRO engine shards dense ones.")
    for name, mod in module.named_modules():
        if isinstance(mod, nn.Embedding) and mod.sparse:
            raise ValueError(
                f"Module {name!r} is an nn.Embedding with sparse=True: sparse gradients cannot be reduce-scattered."
                " Use sparse=False."
            )


def _is_view(param: torch.Tensor, full: torch.Tensor, offset: int) -> bool:
    """Whether ``param`` is the engine's view of its slot in the flat buffer ``full``."""
    return (param.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
            and param.storage_offset() == full.storage_offset() + offset)


def _master_differs(f: FlatGroup) -> bool:
    """Whether a separate master copy (e.g. fp32 beside bf16 parameters) no longer rounds to the parameters: the
    parameters were changed from outside. A master that does round to them keeps its extra precision."""
    if not f.trainable or f.master.data_ptr() == f.own_param_slot.data_ptr():
        return False
    o0, o1 = f.layout.range(f.spec.optim)
    return not torch.equal(f.master.detach().to(f.dtype), f.p_full[o0:o1])


def _broadcast_buffers(module: nn.Module, comm: Communicator) -> None:
    """Every rank starts from rank 0's buffers: broadcast on the communication thread, like every collective of the
    engine, all issued at once and each waited for."""
    if torch.distributed.is_initialized() and comm.topology.world_size > 1:
        handles = [comm.broadcast(b, src=0, async_op=True) for b in module.buffers()]
        for handle in handles:
            handle.wait()


def _mark_used(flags: torch.Tensor, index: int):
    def hook(_param: torch.Tensor) -> None:
        flags[index] = 1
    return hook


def _tensors(obj: Any) -> list[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors(x)]
    return []


def _wrap_inputs(engine: PaROEngine, unit: Unit, args: tuple, kwargs: dict):
    """Route the unit's tensor inputs through :class:`_PostBackward` so its backward marks the unit done."""
    positions = [i for i, a in enumerate(args) if torch.is_tensor(a) and a.requires_grad]
    keys = [k for k, v in kwargs.items() if torch.is_tensor(v) and v.requires_grad]
    if not positions and not keys:
        return None
    inputs = [args[i] for i in positions] + [kwargs[k] for k in keys]
    outs = _PostBackward.apply(engine, unit, *inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    new_args = list(args)
    for i, t in zip(positions, outs[:len(positions)]):
        new_args[i] = t
    new_kwargs = dict(kwargs)
    for k, t in zip(keys, outs[len(positions):]):
        new_kwargs[k] = t
    return tuple(new_args), new_kwargs
