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

:class:`PaROEngine` is a thin facade over the pieces that own the state, as FSDP2 splits its own:

* each :class:`~lightning_paro.strategy.units.Unit` owns its flat groups' gather and reduction state;
* :class:`~lightning_paro.strategy.schedule.UnitSchedule` owns hook registration, execution order and prefetch;
* :class:`~lightning_paro.strategy.optimizer_shards.OptimizerShards` owns the optimizers' shards, unused-parameter
  protection, clipping and the OS -> P sync;
* :class:`~lightning_paro.strategy.evaluation.EvaluationStages` owns the modes, exact weights and the evaluation
  stages' rounds;
* ``construction.py`` builds the units, ``export.py`` gathers a full state dict, ``handback.py`` moves values between
  the module and the flat groups.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_paro.comm.collectives import Communicator
from lightning_paro.strategy import handback
from lightning_paro.strategy.construction import broadcast_buffers, build_units, check_module
from lightning_paro.strategy.evaluation import EvaluationStages, ShardedEvaluation
from lightning_paro.strategy.export import full_state_dict
from lightning_paro.strategy.flat import FlatGroup, GatherMeter
from lightning_paro.strategy.levels import Level, ShardingSpec
from lightning_paro.strategy.modes import Mode
from lightning_paro.strategy.optimizer_shards import OptimizerShards
from lightning_paro.strategy.schedule import UnitSchedule
from lightning_paro.strategy.transitions import EXACT, CommDtypes
from lightning_paro.strategy.units import Unit, UnitPolicy, wait_all

_ENGINES: weakref.WeakValueDictionary[int, PaROEngine] = weakref.WeakValueDictionary()
"""The engine that shards each module, by ``id(module)``: a new engine gives the module back from the previous one
first (its hooks would stay on the module, and keep its buffers alive, otherwise)."""


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
        self.attached = True
        """Whether the module's parameters are this engine's (False once :meth:`restore_module` gave them back)."""
        self.pieces_shown = False
        """Whether the module is left sharded between stages, each parameter showing this rank's piece of it
        (:meth:`leave_sharded`)."""
        check_module(module)
        previous = _ENGINES.get(id(module))
        if previous is not None and previous.module is module and previous.attached:
            previous.restore_module()  # another Trainer's strategy sharded this module before
        optimizers = list(optimizers)
        built = build_units(module, spec, comm, optimizers, units, master_dtype, comm_dtypes, replicated)
        self.original_param_groups: list[list[list[str]]] = built.original_param_groups
        """Per optimizer and param group, the parameter names in the order the user built them (checkpoints)."""
        self.untracked: list[str] = built.untracked
        """Names of the parameters that require grad but are in no optimizer (treated as frozen)."""
        self.units: list[Unit] = built.units
        self.root: Unit = self.units[-1]
        self.gather_meter = GatherMeter()
        """Gathered parameter bytes alive on this rank, their high-water mark, and an optional limit (debug)."""
        for f in self.flat_groups():
            f.gather_meter = self.gather_meter
        self.stages = EvaluationStages(self.units, comm, spec.params, self.prefetch, self.control_device)
        self.shards = OptimizerShards(self.units, optimizers, comm, spec.optim)
        self.schedule = UnitSchedule(self.units, self.prefetch, self.stages)
        broadcast_buffers(module, comm)
        _ENGINES[id(module)] = self

    # ------------------------------------------------------------------ the pieces' state, read through the engine
    @property
    def mode(self) -> Mode:
        """Training (SHARDED) or one of the evaluation modes (owned by :attr:`stages`)."""
        return self.stages.mode

    @property
    def optimizers(self) -> list[Optimizer]:
        return self.shards.optimizers

    @property
    def evaluation(self) -> ShardedEvaluation | None:
        """The rounds of the sharded evaluation stage in progress (mode EVAL)."""
        return self.stages.current

    @property
    def eval_rounds(self) -> int:
        """Rounds of sharded evaluation this rank took part in (one scalar all-reduce each)."""
        return self.stages.rounds

    def flat_groups(self) -> list[FlatGroup]:
        return [f for u in self.units for f in u.flats]

    def masters(self, optimizer: Optimizer | None = None) -> list[nn.Parameter]:
        """The optimizer shards (of one optimizer, or all)."""
        return self.shards.masters(optimizer)

    def flat_of(self, master: nn.Parameter) -> FlatGroup:
        """The flat group an optimizer shard belongs to."""
        return self.shards.flat_of(master)

    def control_device(self) -> torch.device:
        """Where the engine's control tensors (flags, norms) live: the compute device."""
        if self.comm.device is not None:
            return self.comm.device
        return next((f.device for f in self.flat_groups()), torch.device("cpu"))

    # ------------------------------------------------------------------ step protocol
    def pre_step(self) -> None:
        """Before a training step: make the root unit's parameters usable and its gradients ready."""
        self.show_params()
        self.stages.mode = Mode.SHARDED
        self.schedule.begin_step()

    def finish_backward(self, sync: bool) -> None:
        """After ``loss.backward()``: complete every unit's reduction; with ``sync`` (the accumulation boundary),
        bring the gradients to the optimizer-state level."""
        self.schedule.finish_backward()
        if sync:
            self.sync_grads()

    def sync_grads(self) -> None:
        """Bring the gradients to the optimizer-state level and keep parameters no rank used through the step."""
        self.shards.sync_grads()

    def clip_grad_norm_(self, max_norm: float, optimizer: Optimizer | None = None, eps: float = 1e-6) -> torch.Tensor:
        """Clip the OS-level gradients by their global 2-norm (reduced over the ranks holding disjoint shards only);
        returns the norm before clipping."""
        return self.shards.clip_grad_norm(max_norm, optimizer, eps, self.control_device())

    def after_optimizer_step(self, optimizer: Optimizer | None = None) -> None:
        """Launch the OS -> P parameter sync (waited for at first use) and reset the gradient accumulators."""
        self.shards.after_step(optimizer)

    def prepare_next_forward(self) -> None:
        """Manual optimization: get the root unit ready for another forward and backward in the same training step.

        The root unit is gathered once per training step and freed by the backward; after an optimizer step a
        gathered copy holds the old weights. Gather it again with the current weights and attach its gradients.
        """
        if self.root.sharded_params:
            self.root.free()
        self.schedule.ready_root()

    # ------------------------------------------------------------------ evaluation and export
    def exact_params(self) -> None:
        """Collective. Make every rank's parameter storage hold the exact weights where training left them rounded
        (``comm_dtypes`` with parameters in fewer bits than stored). Runs before evaluation, checkpoints and handing
        the module back."""
        self.stages.exact_params()

    def materialize(self) -> None:
        """Gather every unit and keep it gathered (evaluation): no collectives per batch. The weights are exact."""
        self.show_params()
        self.stages.materialize()

    def release(self) -> None:
        """Back to training mode: free what is sharded."""
        self.stages.release()

    @property
    def full_param_bytes(self) -> int:
        """Bytes of every parameter buffer gathered at once (padded): what :meth:`materialize` holds."""
        return sum(f.full_bytes for f in self.flat_groups())

    def begin_eval(self) -> None:
        """Start a sharded evaluation stage (collective over the P scope): the root unit is gathered for the whole
        stage, the other units in each forward. With P = N this is :meth:`materialize` (nothing to gather)."""
        self.show_params()
        self.stages.begin_eval(self.schedule.order)

    def eval_step_begin(self) -> None:
        """Before an evaluation step: this rank's round, flag 1 (running)."""
        self.stages.step_begin()

    def eval_step_end(self, last: bool) -> None:
        """After an evaluation step; ``last``: this rank has no more batches in this stage, so it serves its peers'
        gathers until every rank has run its last step."""
        self.stages.step_end(last)

    def join(self) -> None:
        """Serve the peers' gathers until every rank of the P scope has run its last step (collective)."""
        self.stages.join()

    def end_eval(self) -> None:
        """End of an evaluation stage: join if the last step did not, then free what is sharded."""
        self.stages.end_eval()

    def full_state_dict(self, rank0_only: bool = False, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The module's state dict with full tensors copied to ``device``, gathered one unit at a time (collective):
        the device holds at most one more unit than it does already. With ``rank0_only`` other ranks take part in
        the gathers and return an empty dict."""
        with self.params_shown():
            return full_state_dict(self.module, self.units, self.stages, self.comm, rank0_only, device)

    # ------------------------------------------------------------------ the module
    def restore_module(self) -> None:
        """Give the module back full, independent parameters and remove every hook (collective)."""
        self.wait()
        self.materialize()  # (parameters left showing local pieces point at the full buffer again first)
        handback.detach_parameters(self.flat_groups())
        self.schedule.remove_hooks()
        self.shards.remove_hooks()
        self.stages.mode = Mode.FULL
        self.attached = False
        if _ENGINES.get(id(self.module)) is self:
            del _ENGINES[id(self.module)]

    def holds(self, module: nn.Module) -> bool:
        """Whether this engine still shards ``module`` as it was built: the same parameter objects under the same
        names, with the same shapes, dtypes and devices (``configure_model`` or a precision change may have replaced
        them between stages)."""
        self.show_params()
        return module is self.module and self.attached and handback.holds(self.flat_groups(), module)

    def leave_sharded(self) -> None:
        """Between stages, with the module left sharded: free what is sharded and point each sharded parameter at
        this rank's piece of it, a 1-D view of the rank's P-level storage (empty where it holds none). The module then
        holds only readable memory: its parameters can be read, printed and saved (as local pieces; torch's DTensor
        cannot describe pieces that the flat layout cuts across dimensions). :meth:`show_params` undoes it, and every
        method that runs the module does that first."""
        self.wait()
        self.release()
        for f in self.flat_groups():
            f.show_local_pieces()
        self.pieces_shown = True

    def show_params(self) -> None:
        """Point every parameter left showing its local piece at its slice of the full buffer again."""
        if self.pieces_shown:
            for f in self.flat_groups():
                if f.spec.params != Level.N:
                    f.view_params()
            self.pieces_shown = False

    @contextmanager
    def params_shown(self) -> Iterator[None]:
        """Parameters pointing at the full buffer inside the block (to save or export between stages), left
        showing their local pieces again after it if they were."""
        left_sharded = self.pieces_shown
        self.show_params()
        try:
            yield
        finally:
            if left_sharded:
                self.leave_sharded()

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
        if self.mode is Mode.FULL or not self.root.sharded_params:
            self.materialize()
            handback.adopt_values(self.flat_groups())
        broadcast_buffers(self.module, self.comm)

    def after_load(self) -> None:
        """After new weights were written into this rank's parameter shards: refresh separate master copies and
        drop any gathered copy (it holds the old weights)."""
        self.shards.refresh_masters()
        handback.drop_stale_copies(self.flat_groups())
        self.stages.after_load()

    # ------------------------------------------------------------------ state
    def wait(self) -> None:
        """Wait for every collective in flight."""
        wait_all(self.units)

    def memory_report(self) -> dict[str, int]:
        """Persistent per-rank bytes of model states held by the engine (padding included).

        ``params``: compute parameters at level P; ``grads``: gradient accumulators at level G; ``optim``: optimizer
        states of this rank's shard plus any separate master copy; ``transient_params``: gathered parameters alive
        right now (P != N).
        """
        out = {"params": 0, "grads": 0, "optim": 0, "transient_params": 0}
        for f in self.flat_groups():
            b = f.state_bytes()
            out["params"] += b["params"]
            out["grads"] += b["grads"]
            out["optim"] += b["master"]
            if f.spec.params != Level.N and f.gathered:
                out["transient_params"] += f.p_full.numel() * f.p_full.element_size()
        out["optim"] += self.shards.state_bytes()
        return out

    def num_params(self) -> dict[str, int]:
        """Psi (all parameters), Psi' (trainable) and their padded totals."""
        out = {"total": 0, "trainable": 0, "total_padded": 0, "trainable_padded": 0}
        for f in self.flat_groups():
            out["total"] += f.layout.numel
            out["total_padded"] += f.layout.padded
            if f.trainable:
                out["trainable"] += f.layout.numel
                out["trainable_padded"] += f.layout.padded
        return out


def show_module_params(module: nn.Module) -> None:
    """If an engine shards ``module`` and left it showing local pieces between stages, point its parameters at the
    full buffers again: a strategy does this before a stage touches the module."""
    engine = _ENGINES.get(id(module))
    if engine is not None and engine.module is module and engine.attached:
        engine.show_params()
