"""Between a :class:`~lightning_paro.strategy.engine.PaROEngine` and the module it shards, outside a training step:
giving the module back, checking it is still the one sharded, and taking in values written from outside.

* :data:`ENGINES` remembers which engine shards each module, so that a new engine first gives the module back from
  the previous one (one LightningModule fitted by two Trainers);
* :func:`restore_module` gives the module full, independent parameters and removes every hook;
* :func:`holds` tells whether the module's parameters are still the engine's;
* :func:`adopt_module_values` takes the module's current values into the shards (a stage after fit), and
  :func:`after_load` refreshes what depends on the shards after new weights were written into them (a checkpoint).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

from lightning_paro.strategy.construction import broadcast_buffers, param_names
from lightning_paro.strategy.flat import FlatGroup
from lightning_paro.strategy.hooks import Mode
from lightning_paro.strategy.levels import Level

if TYPE_CHECKING:
    from lightning_paro.strategy.engine import PaROEngine

ENGINES: weakref.WeakValueDictionary[int, PaROEngine] = weakref.WeakValueDictionary()
"""The engine that shards each module, by ``id(module)``: a new engine gives the module back from the previous one
first (its hooks would stay on the module, and keep its buffers alive, otherwise)."""


def take_over(engine: PaROEngine) -> None:
    """Before ``engine`` shards its module: give the module back from the engine that still shards it, if any."""
    previous = ENGINES.get(id(engine.module))
    if previous is not None and previous.module is engine.module and previous.attached:
        # Another Trainer's strategy sharded this module before (one LightningModule, two Trainers).
        previous.restore_module()


def restore_module(engine: PaROEngine) -> None:
    """Gather every unit, give each parameter storage of its own, remove every hook and forget the module."""
    engine.wait()
    engine.materialize()
    with torch.no_grad():
        for unit in engine.units:
            for f in unit.flats:
                for s in f.slots:
                    s.param.data = s.param.data.clone()
                    s.param.grad = None
    for h in engine._hooks:
        h.remove()
    engine._hooks.clear()
    engine.mode = Mode.FULL
    engine.attached = False
    if ENGINES.get(id(engine.module)) is engine:
        del ENGINES[id(engine.module)]


def holds(engine: PaROEngine, module: nn.Module) -> bool:
    """Whether ``module`` is the engine's, attached, with the same parameter objects under the same names, shapes,
    dtypes and devices."""
    if module is not engine.module or not engine.attached:
        return False
    slots = {id(s.param): (s, f) for f in engine.flat_groups() for s in f.slots}
    names = param_names(module)
    if names.keys() != slots.keys():
        return False
    for pid, (name, p) in names.items():
        s, f = slots[pid]
        if name != s.name or p.shape != s.shape or p.dtype != f.dtype or p.device != f.device:
            return False
    return True


def adopt_module_values(engine: PaROEngine) -> None:
    """Take the module's parameter values into the shards (re-pointing parameters that have storage of their own at
    the flat buffers), refresh a master copy that no longer rounds to them, and broadcast rank 0's buffers. A module
    left sharded after fit: only the buffers."""
    engine.wait()
    if engine.mode is not Mode.FULL and engine.root.sharded_params:
        broadcast_buffers(engine.module, engine.comm)
        return
    engine.materialize()
    with torch.no_grad():
        for f in engine.flat_groups():
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
    broadcast_buffers(engine.module, engine.comm)


def after_load(engine: PaROEngine) -> None:
    """Refresh separate master copies from the parameter shards, drop gathered copies, and gather again what the
    mode keeps gathered."""
    with torch.no_grad():
        for f in engine.flat_groups():
            if f.trainable and f.master.data_ptr() != f.own_param_slot.data_ptr():
                f.master.copy_(f.own_param_slot)
            f.params_exact = True
            if f.spec.params != Level.N:
                f.free_params()
    if engine.mode is Mode.FULL:
        engine.materialize()
    elif engine.mode is Mode.EVAL:
        engine.root.ensure_ready()


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
