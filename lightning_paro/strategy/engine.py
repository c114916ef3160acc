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

This file holds :class:`PaROEngine`, the class that owns the units and their state and coordinates the rest; each
concern is a file of its own, which the engine's methods call:

* ``construction.py``: the units and flat groups built from the module, the optimizers given their shards;
* ``hooks.py``: the module and autograd hooks, the prefetch, and the engine's :class:`Mode`;
* ``optimizer_step.py``: the gradient sync, parameters no rank used kept through the step, clipping, the OS -> P
  sync after the step;
* ``export.py``: exact weights for evaluation (gathered, or sharded stages) and export (``full_state_dict``);
* ``handback.py``: the module given back, checked, or its values taken in from outside.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_paro.comm.collectives import Communicator
from lightning_paro.strategy import export, handback, hooks, optimizer_step
from lightning_paro.strategy.construction import (
    adopt_optimizers,
    broadcast_buffers,
    build_units,
    check_module,
)
from lightning_paro.strategy.evaluation import ShardedEvaluation
from lightning_paro.strategy.flat import FlatGroup, GatherMeter
from lightning_paro.strategy.handback import ENGINES as _ENGINES
from lightning_paro.strategy.hooks import Mode
from lightning_paro.strategy.levels import Level, ShardingSpec
from lightning_paro.strategy.transitions import EXACT, CommDtypes
from lightning_paro.strategy.units import Unit, UnitPolicy


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
        replicated: the module's parameters are already the same on every rank (a strategy switch in place), so
            rank 0's are not broadcast.
    """

    def __init__(self, module: nn.Module, spec: ShardingSpec, comm: Communicator,
                 optimizers: Iterable[Optimizer] = (), units: UnitPolicy = "auto", prefetch: int = 1,
                 master_dtype: torch.dtype | None = None, comm_dtypes: CommDtypes = EXACT,
                 replicated: bool = False) -> None:
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
        check_module(module)
        handback.take_over(self)
        built = build_units(module, spec, comm, self.optimizers, units, master_dtype, comm_dtypes, replicated)
        self.original_param_groups: list[list[list[str]]] = built.original_param_groups
        """Per optimizer and param group, the parameter names in the order the user built them (checkpoints)."""
        self._untracked: list[str] = built.untracked
        self.units: list[Unit] = built.units
        self.root: Unit = self.units[-1]
        self.gather_meter = GatherMeter()
        """Gathered parameter bytes alive on this rank, their high-water mark, and an optional limit (debug)."""
        for f in self.flat_groups():
            f.gather_meter = self.gather_meter
        self.evaluation: ShardedEvaluation | None = None
        """The rounds of the sharded evaluation stage in progress (mode EVAL)."""
        self.eval_rounds = 0
        """Rounds of sharded evaluation this rank took part in (one scalar all-reduce each)."""
        self._flat_by_master: dict[int, FlatGroup] = adopt_optimizers(
            self.units, self.optimizers, self._hooks, self._restore_unused)
        hooks.register_hooks(self)
        broadcast_buffers(module, comm)
        _ENGINES[id(module)] = self

    @property
    def mode(self) -> Mode:
        """Training (SHARDED) or one of the evaluation modes; only training gathers in ``comm_dtypes``."""
        return self._mode

    @mode.setter
    def mode(self, mode: Mode) -> None:
        self._mode = mode
        export.set_exact_gathers(self.flat_groups(), mode)

    def exact_params(self) -> None:
        """Collective. Make every rank's parameter storage hold the exact weights where training left them rounded
        (``comm_dtypes`` with parameters in fewer bits than stored): drop gathered units rounded on the wire and run
        the OS -> P sync again in the parameters' own dtype. Nothing to do otherwise. Runs before evaluation,
        checkpoints and handing the module back."""
        export.exact_params(self)

    # ------------------------------------------------------------------ hooks (hooks.py)
    def _unit_pre_backward(self, unit: Unit) -> None:
        hooks.unit_pre_backward(self, unit)

    def _unit_post_backward(self, unit: Unit) -> None:
        hooks.unit_post_backward(self, unit)

    def _prefetch_after(self, unit: Unit, forward: bool) -> None:
        hooks.prefetch_after(self, unit, forward)

    # ------------------------------------------------------------------ step protocol (optimizer_step.py)
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
        """Bring the gradients to the optimizer-state level and keep parameters no rank used through the step."""
        optimizer_step.sync_grads(self)

    def _protect_unused(self) -> None:
        optimizer_step.protect_unused(self)

    def _restore_unused(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        optimizer_step.restore_unused(self, optimizer, args, kwargs)

    def masters(self, optimizer: Optimizer | None = None) -> list[nn.Parameter]:
        """The optimizer shards (of one optimizer, or all)."""
        opts = [optimizer] if optimizer is not None else self.optimizers
        return [p for o in opts for g in o.param_groups for p in g["params"]]

    def clip_grad_norm_(self, max_norm: float, optimizer: Optimizer | None = None, eps: float = 1e-6) -> torch.Tensor:
        """Clip the OS-level gradients by their global 2-norm (reduced over the ranks holding disjoint shards only);
        returns the norm before clipping."""
        return optimizer_step.clip_grad_norm(self, max_norm, optimizer, eps)

    def after_optimizer_step(self, optimizer: Optimizer | None = None) -> None:
        """Launch the OS -> P parameter sync (waited for at first use) and reset the gradient accumulators."""
        optimizer_step.after_optimizer_step(self, optimizer)

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

    # ------------------------------------------------------------------ evaluation and export (export.py)
    def materialize(self) -> None:
        """Gather every unit and keep it gathered (evaluation): no collectives per batch. The weights are exact."""
        export.materialize(self)

    def release(self) -> None:
        """Back to training mode: free what is sharded."""
        export.release(self)

    @property
    def full_param_bytes(self) -> int:
        """Bytes of every parameter buffer gathered at once (padded): what :meth:`materialize` holds."""
        return sum(f.full_bytes for f in self.flat_groups())

    # Sharded evaluation (evaluation.py): the engine gathers the root unit and hands the stage's rounds to a
    # ShardedEvaluation; the unit hooks call it while the mode is EVAL.
    def begin_eval(self) -> None:
        """Start a sharded evaluation stage (collective over the P scope): the root unit is gathered for the whole
        stage, the other units in each forward. With P = N this is :meth:`materialize` (nothing to gather)."""
        export.begin_eval(self)

    def eval_step_begin(self) -> None:
        """Before an evaluation step: this rank's round, flag 1 (running)."""
        export.eval_step_begin(self)

    def eval_step_end(self, last: bool) -> None:
        """After an evaluation step; ``last``: this rank has no more batches in this stage, so it serves its peers'
        gathers until every rank has run its last step."""
        export.eval_step_end(self, last)

    def join(self) -> None:
        """Serve the peers' gathers until every rank of the P scope has run its last step (collective)."""
        export.join(self)

    def end_eval(self) -> None:
        """End of an evaluation stage: join if the last step did not, then free what is sharded."""
        export.end_eval(self)

    def full_state_dict(self, rank0_only: bool = False, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The module's state dict with full tensors copied to ``device``, gathered one unit at a time (collective):
        the device holds at most one more unit than it does already. With ``rank0_only`` other ranks take part in
        the gathers and return an empty dict."""
        return export.full_state_dict(self, rank0_only, device)

    # ------------------------------------------------------------------ the module (handback.py)
    def restore_module(self) -> None:
        """Give the module back full, independent parameters and remove every hook (collective)."""
        handback.restore_module(self)

    def holds(self, module: nn.Module) -> bool:
        """Whether this engine still shards ``module`` as it was built: the same parameter objects under the same
        names, with the same shapes, dtypes and devices (``configure_model`` or a precision change may have replaced
        them between stages)."""
        return handback.holds(self, module)

    def adopt_module_values(self) -> None:
        """Collective. Take the module's current parameter values into this rank's shards, and rank 0's buffers,
        keeping the optimizers and their states: for a stage that runs after fit on the same engine.

        The module's values are the truth, as they are under "ddp": the user may have loaded weights into it after
        fit, or moving it between devices may have given its parameters storage of their own (they become views of
        the engine's buffers again). A separate master copy is refreshed only where it no longer rounds to the
        parameters, so an unchanged one keeps its extra precision. The module is left gathered, as after fit.

        A module left sharded after fit has no other values than the shards: nothing is gathered then.
        """
        handback.adopt_module_values(self)

    def after_load(self) -> None:
        """After new weights were written into this rank's parameter shards: refresh separate master copies and
        drop any gathered copy (it holds the old weights)."""
        handback.after_load(self)

    # ------------------------------------------------------------------ state
    def wait(self) -> None:
        """Wait for every collective in flight."""
        for unit in self.units:
            unit.wait_param_sync()
            unit.wait_gather()
            unit.wait_reduce()

    def control_device(self) -> torch.device:
        """Where the engine's control tensors (flags, norms) live: the compute device."""
        if self.comm.device is not None:
            return self.comm.device
        return next((f.device for f in self.flat_groups()), torch.device("cpu"))

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
