"""Changing a running job's strategy in memory (``sharding="auto"``'s switch after a re-plan).

The module gets its full parameters back from the old engine and a new engine shards it at the new levels, as at
set-up; the optimizer states (and a separate fp32 master) move from the old optimizer-state level to the new one
buffer by buffer: a slice of the shard a rank holds when the new level is finer or the same (nothing is sent), an
all-gather over the scope the transition table names when it is coarser. The flat layout does not depend on the
strategy (every buffer is padded to a multiple of the world size), so a level's range of a buffer is the same under
both engines. The values are those a sharded checkpoint saved under the old strategy and resumed under the new one
carries, bit for bit.

Which optimizer state tensors are shards (one entry per element of the buffer's optimizer shard, moved between
levels) and which are not (a step counter, carried as it is) is recorded per buffer before the switch
(:func:`~lightning_paro.strategy.state_dicts.per_element_keys`, the rule the checkpoints use) and the move follows
that record, key by key; a recorded shard that the new optimizer keeps in another shape is an error.

A switch holds, at its peak on each rank, the old engine's model states (the optimizer states move from them at the
end), the whole model gathered and copied into the module (the new engine's source) and the new engine's model
states: :func:`switch_peak_bytes`. The caller checks it against the rank's memory before switching
(``auto_session.py`` declines a switch that does not fit, and says why).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.optim import Optimizer

from lightning_paro.strategy import transitions
from lightning_paro.strategy.engine import PaROEngine
from lightning_paro.strategy.flat import FlatGroup
from lightning_paro.strategy.layout import ShardLayout
from lightning_paro.strategy.levels import Level
from lightning_paro.strategy.state_dicts import init_optimizer_state, per_element_keys


def switch_peak_bytes(engine: PaROEngine, new_model_state_bytes: float) -> float:
    """This rank's bytes at the peak of :func:`reshard` from ``engine`` to a strategy whose model states take
    ``new_model_state_bytes`` per rank (the plan's prediction): what the old engine holds now, the module's full
    parameters (copies of their own), the gathered buffers they are copied from (P != N; with P = N the parameter
    storage is the full buffer already) and the new engine's model states."""
    held = sum(engine.memory_report().values())
    full = engine.full_param_bytes
    gathered = full if engine.spec.params != Level.N else 0
    return held + full + gathered + new_model_state_bytes


def reshard(engine: PaROEngine, build: Callable[[list[Optimizer]], PaROEngine]) -> PaROEngine:
    """Collective. Move ``engine``'s module and optimizer states to the engine ``build`` makes (the new strategy's)
    and return it; ``engine`` gives the module back and is done.

    Call between optimizer steps, with no gradient accumulated: accumulated gradients are not carried over. The
    optimizers stay the same objects (a learning-rate scheduler keeps working): their parameter groups point at the
    module's parameters again while the new engine is built, and their states are then moved into its shards.
    """
    carried = [_optimizer_side(engine, f) for f in engine.flat_groups()]
    optimizers, names, module = engine.optimizers, engine.original_param_groups, engine.module
    engine.restore_module()  # the module's parameters, full and exact, are what the new engine shards
    params = dict(module.named_parameters(remove_duplicate=False))
    for optimizer, groups in zip(optimizers, names):
        optimizer.state.clear()
        for group, group_names in zip(optimizer.param_groups, groups):
            group["params"] = [params[name] for name in group_names]
    new = build(optimizers)
    for index in range(len(optimizers)):
        init_optimizer_state(new, index)
    new_flats = new.flat_groups()
    if [_signature(f) for f in new_flats] != [c["signature"] for c in carried]:
        raise RuntimeError("Resharding: the new engine's flat buffers differ from the old one's (a different unit"
                           " policy or optimizer set-up); the strategy cannot be switched in place.")
    with torch.no_grad():
        for old, f in zip(carried, new_flats):
            if old["master"] is None and not old["state"]:
                continue
            move = _mover(old["level"], f.spec.optim, f.layout, new.comm)
            if old["master"] is not None and f.master.data_ptr() != f.own_param_slot.data_ptr():
                f.master.copy_(move(old["master"]))
            state = _optimizer_of(new, f).state[f.master]
            for key, value in old["state"].items():
                if key in old["shard_keys"]:
                    if key not in per_element_keys(_optimizer_of(new, f), f.master):
                        raise RuntimeError(
                            f"Resharding: the optimizer state {key!r} of {f.slots[0].name!r} is a shard of the old"
                            f" optimizer state (one entry per element), but the new optimizer keeps it as"
                            f" {type(state.get(key)).__name__} {tuple(getattr(state.get(key), 'shape', ()))}, not in"
                            f" the new shard's shape {tuple(f.master.shape)}; the strategy cannot be switched in"
                            " place.")
                    state[key].copy_(move(value))
                elif torch.is_tensor(value) and torch.is_tensor(state.get(key)):
                    state[key].copy_(value)
                else:
                    state[key] = value
    return new


def _signature(f: FlatGroup) -> tuple:
    return tuple(s.name for s in f.slots), f.layout.numel, f.trainable, f.dtype


def _optimizer_side(engine: PaROEngine, f: FlatGroup) -> dict[str, Any]:
    """What of one flat buffer moves to the new engine: its optimizer-state level, a separate master and the
    optimizer's state tensors (references: the old engine is not used after this)."""
    out: dict[str, Any] = {"signature": _signature(f), "level": f.spec.optim, "master": None, "state": {},
                           "shard_keys": frozenset()}
    if not f.trainable:
        return out
    if f.master.data_ptr() != f.own_param_slot.data_ptr():
        out["master"] = f.master.detach()
    for opt in engine.optimizers:
        if f.master in opt.state:
            out["state"] = dict(opt.state[f.master])
            out["shard_keys"] = per_element_keys(opt, f.master)  # the record the move follows
    return out


def _optimizer_of(engine: PaROEngine, f: FlatGroup) -> Optimizer:
    for opt in engine.optimizers:
        for group in opt.param_groups:
            if any(p is f.master for p in group["params"]):
                return opt
    raise RuntimeError(f"Resharding: no optimizer holds the master of {f.slots[0].name!r}.")


def _mover(old: Level, new: Level, layout: ShardLayout, comm) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function from a buffer's shard at level ``old`` to its shard at level ``new`` (collective when ``new`` is
    coarser: the transition table's gather from ``old`` to ``new``)."""
    o0, _ = layout.range(old)
    n0, n1 = layout.range(new)
    if new.degree(layout.group_size, layout.world_size) >= old.degree(layout.group_size, layout.world_size):
        return lambda shard: shard[n0 - o0:n1 - o0]  # the same or a finer level: a slice of what this rank holds
    (gather,) = transitions.optim_to_params(old, new)  # a shard widened to a coarser level: one all-gather

    def widen(shard: torch.Tensor) -> torch.Tensor:
        out = torch.empty(n1 - n0, dtype=shard.dtype, device=shard.device)
        comm.all_gather(out, shard.contiguous(), gather.scope)
        return out

    return widen
