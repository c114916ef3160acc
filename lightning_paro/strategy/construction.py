"""Building a :class:`~lightning_paro.strategy.engine.PaROEngine`'s model states: checking the module, grouping its
parameters into units and per-unit :class:`FlatGroup` buffers, and handing the optimizers their shards.

Pure functions of the module, the optimizers and the strategy: the engine calls them once, in its constructor.

* :func:`check_module` refuses what cannot be sharded (sparse or non-strided parameters, sparse embeddings);
* :func:`build_units` puts every parameter into the unit that owns it (a parameter shared by several units into the
  root unit) and, inside a unit, into one flat group per (optimizer param group, dtype, device); a model built on
  the meta device gets its values there, unit by unit, into this rank's shards (``deferred_init.py``);
* :func:`adopt_optimizers` rewrites the optimizers' param groups to hold this rank's optimizer shards and marks, per
  parameter, whether it received a gradient.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_paro.comm.collectives import Communicator
from lightning_paro.strategy.deferred_init import SOURCE_ATTR, has_meta, initialise
from lightning_paro.strategy.flat import FlatGroup
from lightning_paro.strategy.levels import ShardingSpec
from lightning_paro.strategy.transitions import CommDtypes
from lightning_paro.strategy.units import Unit, UnitPolicy, find_units

ROOT = "<root>"
"""The name of the root unit: the module itself, holding every parameter no other unit owns alone."""


@dataclass
class Built:
    """What :func:`build_units` returns."""

    units: list[Unit]
    """The units, the root unit last."""
    original_param_groups: list[list[list[str]]]
    """Per optimizer and param group, the parameter names in the order the user built them (checkpoints)."""
    untracked: list[str]
    """Names of the parameters that require grad but are in no optimizer (treated as frozen)."""


def build_units(module: nn.Module, spec: ShardingSpec, comm: Communicator, optimizers: list[Optimizer],
                policy: UnitPolicy, master_dtype: torch.dtype | None, comm_dtypes: CommDtypes,
                replicated: bool = False) -> Built:
    """Group ``module``'s parameters into units (see :func:`find_units`) and each unit's parameters into flat groups
    by (optimizer param group, dtype, device); a parameter is trainable when it requires grad and an optimizer holds
    it."""
    names = param_names(module)
    owner: dict[int, set[str]] = {}
    unit_mods = find_units(module, policy)
    for uname, mod in unit_mods:
        for p in mod.parameters():
            owner.setdefault(id(p), set()).add(uname)
    group_of = optimizer_group_index(optimizers, names)
    original_param_groups = [[[names[id(p)][0] for p in g["params"]] for g in opt.param_groups] for opt in optimizers]
    per_unit: dict[str, OrderedDict] = {u: OrderedDict() for u, _ in unit_mods}
    per_unit[ROOT] = OrderedDict()
    for pid, (name, p) in names.items():
        us = owner.get(pid, set())
        # A parameter shared by several units (tied weights) lives in the root unit, gathered for the whole step.
        uname = next(iter(us)) if len(us) == 1 else ROOT
        trainable = p.requires_grad and pid in group_of
        key = (group_of.get(pid) if trainable else None, p.dtype, p.device)
        per_unit[uname].setdefault(key, []).append((name, p))
    untracked = [n for pid, (n, p) in names.items() if optimizers and p.requires_grad and pid not in group_of]
    pending = {pid for pid, (_n, p) in names.items() if p.is_meta}
    units = []
    modules = dict(unit_mods)
    modules[ROOT] = module
    for uname, groups in per_unit.items():
        flats = []
        for (gidx, dtype, _dev), entries in groups.items():
            mdtype = master_dtype if master_dtype is not None else (
                torch.float32 if dtype in (torch.bfloat16, torch.float16) else None)
            flat = FlatGroup(entries, trainable=gidx is not None, spec=spec, comm=comm,
                             master_dtype=mdtype, comm_dtypes=comm_dtypes, replicated=replicated)
            flat.optimizer_group = gidx
            flats.append(flat)
        units.append(Unit(uname, modules[uname], flats))
    if pending or has_meta(module):
        # the root unit is last in `units`, as `initialise` expects
        initialise(module, [u.module for u in units[:-1]], [u.flats for u in units], pending, comm,
                   getattr(module, SOURCE_ATTR, None))
    return Built(units, original_param_groups, untracked)


def adopt_optimizers(units: list[Unit], optimizers: list[Optimizer], hooks: list[RemovableHandle],
                     after_step: Callable) -> dict[int, FlatGroup]:
    """Give each optimizer param group the optimizer shards (``master``) of its flat groups and register, into
    ``hooks``, the hooks that flag which parameters received a gradient and ``after_step`` after each optimizer step.
    Returns the flat group of each optimizer shard, by ``id(master)``. Refuses an optimizer that already has state."""
    flat_by_master: dict[int, FlatGroup] = {}
    groups: dict[tuple[int, int], list[nn.Parameter]] = {}
    for unit in units:
        for f in unit.flats:
            if f.trainable:
                groups.setdefault(f.optimizer_group, []).append(f.master)
                flat_by_master[id(f.master)] = f
    for unit in units:
        for f in unit.flats:
            if f.trainable:
                for k, slot in enumerate(f.slots):
                    hooks.append(slot.param.register_post_accumulate_grad_hook(_mark_used(f.used, k)))
    for oi, opt in enumerate(optimizers):
        hooks.append(opt.register_step_post_hook(after_step))
        if len(opt.state) != 0:
            raise RuntimeError(
                f"Optimizer {type(opt).__name__} already has state before sharding. Create optimizers in"
                " `configure_optimizers` and step them only through the Trainer (the strategy shards them)."
            )
        for gi, group in enumerate(opt.param_groups):
            group["params"] = groups.get((oi, gi), [])
    return flat_by_master


def param_names(module: nn.Module) -> OrderedDict:
    """``id(p) -> (name, p)`` for every parameter of ``module``, each once, in ``named_parameters`` order."""
    names: OrderedDict = OrderedDict()
    for name, p in module.named_parameters(remove_duplicate=True):
        names[id(p)] = (name, p)
    return names


def optimizer_group_index(optimizers: list[Optimizer], names: OrderedDict) -> dict[int, tuple[int, int]]:
    """``id(p) -> (optimizer index, param group index)``; refuses foreign tensors and a parameter in two groups."""
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


def check_module(module: nn.Module) -> None:
    """Refuse a module the engine cannot shard. Parameters on the meta device are welcome: :func:`build_units` gives
    them their values one unit at a time (``deferred_init.py``)."""
    for name, p in module.named_parameters():
        if p.is_sparse or p.layout != torch.strided:
            raise ValueError(f"Parameter {name!r} is not a dense strided tensor; the PaRO engine shards dense ones.")
    for name, mod in module.named_modules():
        if isinstance(mod, nn.Embedding) and mod.sparse:
            raise ValueError(
                f"Module {name!r} is an nn.Embedding with sparse=True: sparse gradients cannot be reduce-scattered."
                " Use sparse=False."
            )


def broadcast_buffers(module: nn.Module, comm: Communicator) -> None:
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
