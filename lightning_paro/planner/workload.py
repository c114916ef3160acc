"""A running job's model as the cost model's :class:`Workload`: parameters, trainable ones, units (the engine's own
detection), element sizes and optimizer states per parameter.
"""

from __future__ import annotations

from typing import Iterable

from lightning_paro.planner.inputs import Workload
from lightning_paro.strategy.transitions import EXACT, CommDtypes

_STATES_PER_PARAM = {
    "Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adadelta": 2, "Rprop": 2, "ASGD": 2,
    "Adagrad": 1, "SparseAdam": 2,
}
"""Parameter-sized state tensors of the optimizers whose count does not depend on their options."""


def optimizer_states_per_param(optimizer) -> float:
    """How many parameter-sized state tensors ``optimizer`` keeps (Adam: 2, SGD with momentum: 1, plain SGD: 0);
    unknown optimizers count as 2."""
    name = type(optimizer).__name__
    if name in _STATES_PER_PARAM:
        return _STATES_PER_PARAM[name]
    groups = getattr(optimizer, "param_groups", [{}])
    if name == "SGD":
        return 1 if any(g.get("momentum", 0) for g in groups) else 0
    if name == "RMSprop":
        return 1 + any(g.get("momentum", 0) for g in groups) + any(g.get("centered", False) for g in groups)
    return 2


def workload_from_module(module, optimizers: Iterable = (), units="auto", accumulation: int = 1,
                         tokens_per_micro_batch: float = 0.0, activation_bytes_per_token: float = 0.0,
                         comm: CommDtypes = EXACT) -> Workload:
    """Describe ``module`` as the engine will shard it: parameters, trainable ones (requiring grad and in an
    optimizer), units (the same detection as the engine), element sizes, and optimizer bytes per trainable parameter
    (the engine keeps optimizer states in fp32 and a separate fp32 master when parameters are 16-bit); ``comm``: the
    dtypes parameters and gradients travel in."""
    from lightning_paro.strategy.units import find_units

    params = {id(p): p for p in module.parameters()}
    if not params:
        raise ValueError("The module has no parameters: there is nothing to shard or plan.")
    in_optimizer = {id(p) for o in optimizers for g in o.param_groups for p in g["params"]}
    trainable = [p for pid, p in params.items() if p.requires_grad and pid in in_optimizer]
    num_params = sum(p.numel() for p in params.values())
    num_trainable = sum(p.numel() for p in trainable)
    unit_modules = find_units(module, units)
    owners: dict[int, int] = {}
    for _name, mod in unit_modules:
        for p in mod.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    # a parameter shared by several units lives in the root unit, like in the engine
    in_units = sum(params[pid].numel() for pid, count in owners.items() if count == 1 and pid in params)
    # Backward runs from the last unit down to the first one holding a trainable parameter. A trainable parameter
    # outside the units that is registered before them (an embedding, a tied head) may be used before all of them, so
    # then backward is taken to reach every unit; one registered after them (a final norm, a head) is not.
    trainable_ids = {id(p) for p in trainable}
    unit_owned = {pid for pid, count in owners.items() if count == 1}
    order = {id(p): k for k, p in enumerate(module.parameters())}
    first_unit_param = min((order[pid] for pid in unit_owned if pid in order), default=len(order))
    if any(order[pid] < first_unit_param for pid in trainable_ids - unit_owned):
        backward_units = len(unit_modules)
    else:
        first = next((k for k, (_name, mod) in enumerate(unit_modules)
                      if any(id(p) in trainable_ids for p in mod.parameters())), len(unit_modules))
        backward_units = len(unit_modules) - first
    param_bytes = round(sum(p.numel() * p.element_size() for p in params.values()) / num_params)
    master_bytes = 4 if param_bytes < 4 else 0
    if num_trainable:
        states = sum(optimizer_states_per_param(o) * sum(p.numel() for g in o.param_groups for p in g["params"])
                     for o in optimizers) / max(1, sum(p.numel() for o in optimizers for g in o.param_groups
                                                        for p in g["params"]))
    else:
        states = 0.0
    return Workload(
        num_params=num_params, num_trainable=num_trainable, accumulation=accumulation,
        num_units=len(unit_modules), root_fraction=1 - in_units / num_params if unit_modules else 1.0,
        tokens_per_micro_batch=tokens_per_micro_batch, param_bytes=param_bytes, grad_bytes=param_bytes,
        optim_bytes=round(master_bytes + 4 * states), activation_bytes_per_token=activation_bytes_per_token,
        backward_units=backward_units, comm=comm,
    )
