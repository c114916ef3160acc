"""A sharded module's full state dict, gathered one unit at a time: :func:`full_state_dict`.

A collective over the units' scopes that takes its owners as arguments: the module, its units and the
:class:`~lightning_paro.strategy.evaluation.EvaluationStages` that make the weights exact.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_paro.comm.collectives import Communicator
from lightning_paro.strategy.evaluation import EvaluationStages
from lightning_paro.strategy.units import Unit, wait_all


@torch.no_grad()
def full_state_dict(module: nn.Module, units: list[Unit], stages: EvaluationStages, comm: Communicator,
                    rank0_only: bool, device: torch.device | str) -> dict[str, torch.Tensor]:
    """``module``'s state dict with full tensors copied to ``device``, gathered one unit at a time (a unit gathered
    before stays gathered): the device holds at most one more unit than it does already. With ``rank0_only`` the
    other ranks take part in the gathers and return an empty dict."""
    wait_all(units)
    stages.exact_params()
    keep = rank0_only is False or comm.topology.rank == 0
    copies: dict[int, torch.Tensor] = {}
    for unit in units:
        was_gathered = all(f.gathered for f in unit.flats)
        with stages.exact_gathers():
            unit.ensure_ready()
        if keep:
            for f in unit.flats:
                for s in f.slots:
                    copies[id(s.param)] = s.param.detach().to(device, copy=True)
        if not was_gathered:
            unit.free()
    if not keep:
        return {}
    return {k: copies[id(v)] if id(v) in copies else v.detach().to(device, copy=True)
            for k, v in module.state_dict(keep_vars=True).items()}
