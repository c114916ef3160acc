"""The engine's module and autograd hooks, and the prefetch they drive.

Every unit but the root gets a forward pre-hook and a forward hook (:func:`register_hooks`); what they do depends on
the engine's :class:`Mode`:

* training (SHARDED): before a unit's forward its parameters are made ready and the next units' gathers are
  prefetched; the unit's tensor inputs are routed through :class:`_PostBackward`, whose backward runs once the unit's
  own backward is complete. After the forward the unit is freed (P = I or G) and a multi-grad hook on its outputs
  gathers it again before its backward, prefetching the units before it;
* sharded evaluation (EVAL): the stage's :class:`~lightning_paro.strategy.evaluation.ShardedEvaluation` gathers the
  unit, which is freed after its forward;
* FULL: the hooks do nothing.

The hooks record the order in which units run (``engine._seen``; the engine keeps the last forward's as
``engine._order``), which the prefetch follows forwards and, in backward, backwards.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_paro.strategy.units import Unit

if TYPE_CHECKING:
    from lightning_paro.strategy.engine import PaROEngine


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


def register_hooks(engine: PaROEngine) -> None:
    """Put the forward pre-hook and forward hook on every unit but the root; their handles go to ``engine._hooks``."""
    for unit in engine.units[:-1]:
        engine._hooks.append(unit.module.register_forward_pre_hook(
            _make_pre_forward(engine, unit), with_kwargs=True))
        engine._hooks.append(unit.module.register_forward_hook(_make_post_forward(engine, unit)))


def _make_pre_forward(engine: PaROEngine, unit: Unit):
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        if engine.mode is Mode.EVAL:
            engine.evaluation.enter(unit)
            return None
        if engine.mode is not Mode.SHARDED:
            return None
        unit.ensure_ready()
        if unit not in engine._seen:
            engine._seen.append(unit)
        engine._prefetch_after(unit, forward=True)
        if torch.is_grad_enabled() and (unit.trainable or unit.sharded_params):
            return _wrap_inputs(engine, unit, args, kwargs)
        return None
    return hook


def _make_post_forward(engine: PaROEngine, unit: Unit):
    def hook(module: nn.Module, args: tuple, output: Any):
        if engine.mode is Mode.EVAL:
            unit.free()
            return
        if engine.mode is not Mode.SHARDED:
            return
        if unit.sharded_params:
            unit.free()
        if torch.is_grad_enabled():
            tensors = [t for t in _tensors(output) if t.requires_grad]
            if tensors:
                unit.backward_started = False
                unit.backward_done = False
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda _grads: engine._unit_pre_backward(unit), mode="any")
        return
    return hook


def unit_pre_backward(engine: PaROEngine, unit: Unit) -> None:
    """Before ``unit``'s backward: gather it and attach its gradients; prefetch the units before it."""
    unit.pre_backward()
    prefetch_after(engine, unit, forward=False)


def unit_post_backward(engine: PaROEngine, unit: Unit) -> None:
    """After ``unit``'s backward: issue its gradient reduction (once per backward), freeing it if sharded."""
    if unit.post_backward(free=unit.sharded_params, previous=engine._reducing):
        engine._reducing = unit


def prefetch_after(engine: PaROEngine, unit: Unit, forward: bool) -> None:
    """Start the gathers of the ``engine.prefetch`` units after ``unit`` in the last forward's order (before it, in
    backward)."""
    if not engine.prefetch or unit not in engine._order:
        return
    pos = engine._order.index(unit)
    step = 1 if forward else -1
    for k in range(1, engine.prefetch + 1):
        idx = pos + step * k
        if 0 <= idx < len(engine._order):
            nxt = engine._order[idx]
            if nxt.sharded_params:
                nxt.gather(async_op=True)


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
