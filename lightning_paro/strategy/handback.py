"""Between the flat groups of a :class:`~lightning_paro.strategy.engine.PaROEngine` and the module whose parameters
are views of them, outside a training step: plain functions over the flat groups, each taking what it reads.

* :func:`detach_parameters` gives each parameter storage of its own (the module handed back);
* :func:`holds` tells whether the module's parameters are still the flat groups' own;
* :func:`adopt_values` takes the module's current values into the shards (a stage after fit), and
  :func:`drop_stale_copies` frees gathered copies after new weights were written into the shards (a checkpoint).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_paro.strategy.construction import param_names
from lightning_paro.strategy.flat import FlatGroup
from lightning_paro.strategy.levels import Level


def detach_parameters(flats: list[FlatGroup]) -> None:
    """Give every parameter (gathered: full values) storage of its own and drop its gradient."""
    with torch.no_grad():
        for f in flats:
            for s in f.slots:
                s.param.data = s.param.data.clone()
                s.param.grad = None


def holds(flats: list[FlatGroup], module: nn.Module) -> bool:
    """Whether ``module`` has the flat groups' parameter objects under the same names, shapes, dtypes and devices."""
    slots = {id(s.param): (s, f) for f in flats for s in f.slots}
    names = param_names(module)
    if names.keys() != slots.keys():
        return False
    for pid, (name, p) in names.items():
        s, f = slots[pid]
        if name != s.name or p.shape != s.shape or p.dtype != f.dtype or p.device != f.device:
            return False
    return True


def adopt_values(flats: list[FlatGroup]) -> None:
    """With every flat group gathered: take the module's parameter values into the shards (re-pointing parameters
    that have storage of their own at the flat buffers), and refresh a master copy that no longer rounds to them."""
    with torch.no_grad():
        for f in flats:
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


def drop_stale_copies(flats: list[FlatGroup]) -> None:
    """After new weights were written into the parameter shards: they are exact, and gathered copies are stale."""
    for f in flats:
        f.params_exact = True
        if f.spec.params != Level.N:
            f.free_params()


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
