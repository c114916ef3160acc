"""The order in which a :class:`~lightning_paro.strategy.engine.PaROEngine`'s units run, and the module and autograd
hooks that follow it: :class:`UnitSchedule`, the one owner of hook registration, execution order and prefetch.

Every unit but the root gets a forward pre-hook and a forward hook; what they do depends on the mode that
:class:`~lightning_paro.strategy.evaluation.EvaluationStages` holds:

* training (SHARDED): before a unit's forward its parameters are made ready and the next units' gathers are
  prefetched; the unit's tensor inputs are routed through :class:`_PostBackward`, whose backward runs once the unit's
  own backward is complete. After the forward the unit is freed (P = I or G) and a multi-grad hook on its outputs
  gathers it again before its backward, prefetching the units before it;
* sharded evaluation (EVAL): the stage gathers the unit before its forward and frees it after;
* FULL: the hooks do nothing.

The schedule records the order in which units run in a step (``seen``; the last forward's is kept as ``order``),
which the prefetch follows forwards and, in backward, backwards. Each unit owns its own gather and reduction state
(:class:`~lightning_paro.strategy.units.Unit`); the schedule only decides when.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_paro.strategy.evaluation import EvaluationStages
from lightning_paro.strategy.modes import Mode
from lightning_paro.strategy.units import Unit


class UnitSchedule:
    """Hooks, execution order and prefetch of one engine's units.

    Args:
        units: the engine's units, the root unit last (it has no hooks: it is gathered for the whole step).
        prefetch: how many units ahead to gather (0 disables prefetching).
        stages: the engine's modes and evaluation stages, which the hooks consult.
    """

    def __init__(self, units: list[Unit], prefetch: int, stages: EvaluationStages) -> None:
        self.units = units
        self.root = units[-1]
        self.prefetch = max(0, int(prefetch))
        self.stages = stages
        self.order: list[Unit] = []
        """The units in the order the last training forward ran them (the root excluded)."""
        self.seen: list[Unit] = []
        """The units the current training step has run so far, in order."""
        self.reducing: Unit | None = None
        """The unit whose gradient reduction was issued last in this backward."""
        self.handles: list[RemovableHandle] = []
        for unit in units[:-1]:
            self.handles.append(unit.module.register_forward_pre_hook(self._pre_forward_hook(unit),
                                                                      with_kwargs=True))
            self.handles.append(unit.module.register_forward_hook(self._post_forward_hook(unit)))

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    # ------------------------------------------------------------------ a training step
    def begin_step(self) -> None:
        """Before a training step: a new order is recorded; the root unit is gathered and its gradients attached."""
        self.seen = []
        self.ready_root()

    def ready_root(self) -> None:
        """Gather the root unit (waiting for its parameter sync) and attach its gradients for a new backward."""
        self.root.ensure_ready()
        self.root.backward_started = False
        self.root.backward_done = False
        self.root.pre_backward()

    def finish_backward(self) -> None:
        """After ``loss.backward()``: every unit's reduction issued, in reverse forward order, the root's last."""
        if self.seen:
            self.order = list(self.seen)
        for unit in [*reversed(self.order), self.root]:
            self.unit_post_backward(unit)
        self.reducing = None

    def unit_pre_backward(self, unit: Unit) -> None:
        """Before ``unit``'s backward: gather it and attach its gradients; prefetch the units before it."""
        unit.pre_backward()
        self.prefetch_after(unit, forward=False)

    def unit_post_backward(self, unit: Unit) -> None:
        """After ``unit``'s backward: issue its gradient reduction (once per backward), freeing it if sharded."""
        if unit.post_backward(free=unit.sharded_params, previous=self.reducing):
            self.reducing = unit

    def prefetch_after(self, unit: Unit, forward: bool) -> None:
        """Start the gathers of the ``prefetch`` units after ``unit`` in the last forward's order (before it, in
        backward)."""
        if not self.prefetch or unit not in self.order:
            return
        pos = self.order.index(unit)
        step = 1 if forward else -1
        for k in range(1, self.prefetch + 1):
            idx = pos + step * k
            if 0 <= idx < len(self.order):
                nxt = self.order[idx]
                if nxt.sharded_params:
                    nxt.gather(async_op=True)

    # ------------------------------------------------------------------ the hooks
    def _pre_forward_hook(self, unit: Unit):
        def hook(module: nn.Module, args: tuple, kwargs: dict):
            mode = self.stages.mode
            if mode is Mode.EVAL:
                self.stages.enter(unit)
                return None
            if mode is not Mode.SHARDED:
                return None
            unit.ensure_ready()
            if unit not in self.seen:
                self.seen.append(unit)
            self.prefetch_after(unit, forward=True)
            if torch.is_grad_enabled() and (unit.trainable or unit.sharded_params):
                return _wrap_inputs(self, unit, args, kwargs)
            return None
        return hook

    def _post_forward_hook(self, unit: Unit):
        def hook(module: nn.Module, args: tuple, output: Any):
            mode = self.stages.mode
            if mode is Mode.EVAL:
                self.stages.leave(unit)
                return
            if mode is not Mode.SHARDED:
                return
            if unit.sharded_params:
                unit.free()
            if torch.is_grad_enabled():
                tensors = [t for t in _tensors(output) if t.requires_grad]
                if tensors:
                    unit.backward_started = False
                    unit.backward_done = False
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, lambda _grads: self.unit_pre_backward(unit), mode="any")
            return
        return hook


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the unit's own backward is complete."""

    @staticmethod
    def forward(ctx, schedule: UnitSchedule, unit: Unit, *inputs: torch.Tensor):
        ctx.schedule, ctx.unit = schedule, unit
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.schedule.unit_post_backward(ctx.unit)
        return (None, None, *grads)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors(x)]
    return []


def _wrap_inputs(schedule: UnitSchedule, unit: Unit, args: tuple, kwargs: dict):
    """Route the unit's tensor inputs through :class:`_PostBackward` so its backward marks the unit done."""
    positions = [i for i, a in enumerate(args) if torch.is_tensor(a) and a.requires_grad]
    keys = [k for k, v in kwargs.items() if torch.is_tensor(v) and v.requires_grad]
    if not positions and not keys:
        return None
    inputs = [args[i] for i in positions] + [kwargs[k] for k in keys]
    outs = _PostBackward.apply(schedule, unit, *inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    new_args = list(args)
    for i, t in zip(positions, outs[:len(positions)]):
        new_args[i] = t
    new_kwargs = dict(kwargs)
    for k, t in zip(keys, outs[len(positions):]):
        new_kwargs[k] = t
    return tuple(new_args), new_kwargs
