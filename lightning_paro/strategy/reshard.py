"""Changing a running job's strategy in memory (``sharding="auto"``'s switch after a re-plan).

The model and optimizer states leave the old engine's shards the way a full checkpoint saves them and enter the new
engine's the way a full checkpoint loads them (the same functions), so a switch gives the result, bit for bit, of
saving under the old strategy and resuming under the new one. The full states are staged in host memory, one unit
gathered at a time on the device, as a full checkpoint is.
"""

from __future__ import annotations

from typing import Callable

from torch.optim import Optimizer

from lightning_paro.strategy.checkpoint import full_optimizer_state, load_full_model_state, load_full_optimizer_state
from lightning_paro.strategy.engine import PaROEngine


def reshard(engine: PaROEngine, build: Callable[[list[Optimizer]], PaROEngine]) -> PaROEngine:
    """Collective. Move ``engine``'s module and optimizer states to the engine ``build`` makes (the new strategy's)
    and return it; ``engine`` gives the module back and is done.

    Call between optimizer steps, with no gradient accumulated: accumulated gradients are not carried over. The
    optimizers stay the same objects (a learning-rate scheduler keeps working): their parameter groups point at the
    module's parameters again while the new engine is built, and their states are loaded into its shards.
    """
    module = engine.module
    model_state = engine.full_state_dict()
    optimizer_states = [full_optimizer_state(engine, i) for i in range(len(engine.optimizers))]
    optimizers, names = engine.optimizers, engine.original_param_groups
    engine.restore_module()
    params = dict(module.named_parameters(remove_duplicate=False))
    for optimizer, groups in zip(optimizers, names):
        optimizer.state.clear()
        for group, group_names in zip(optimizer.param_groups, groups):
            group["params"] = [params[name] for name in group_names]
    new = build(optimizers)
    load_full_model_state(new, model_state)  # in the order a resume from a full checkpoint loads them
    new.after_load()
    for index, state in enumerate(optimizer_states):
        load_full_optimizer_state(new, index, state)
    return new
