"""The optimizers of a :class:`~lightning_paro.strategy.engine.PaROEngine` and the shards they update:
:class:`OptimizerShards` owns the optimizers' masters (this rank's optimizer-state shards), the protection of
parameters no rank used, clipping, and the OS -> P sync after each step.

* :meth:`OptimizerShards.sync_grads` brings every trainable flat group's gradient to the optimizer-state level and
  agrees, over all ranks, which parameters received a gradient; the optimizer-shard slices of the unused ones are then
  snapshotted and, after the optimizer's step, put back, as torch optimizers leave a parameter whose ``.grad`` is
  None untouched;
* :meth:`OptimizerShards.clip_grad_norm` clips the optimizer-level gradients by their global norm;
* :meth:`OptimizerShards.after_step` launches the OS -> P parameter sync and resets the gradient accumulators.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_paro.comm.collectives import Communicator
from lightning_paro.strategy.construction import adopt_optimizers
from lightning_paro.strategy.flat import FlatGroup
from lightning_paro.strategy.levels import Level
from lightning_paro.strategy.transitions import SCOPE_OF
from lightning_paro.strategy.units import Unit


class OptimizerShards:
    """The optimizers over one engine's flat groups, each param group holding this rank's optimizer shards.

    Args:
        units: the engine's units.
        optimizers: the torch optimizers built over the module's parameters; their param groups are rewritten to hold
            the shards (see :func:`~lightning_paro.strategy.construction.adopt_optimizers`).
        comm: the communicator.
        optim_level: the OS level (the scope over which clipping's sum of squares is reduced).
    """

    def __init__(self, units: list[Unit], optimizers: list[Optimizer], comm: Communicator,
                 optim_level: Level) -> None:
        self.units = units
        self.optimizers = optimizers
        self.comm = comm
        self.optim_level = optim_level
        self.handles: list[RemovableHandle] = []
        """The hooks that flag used parameters and restore unused slices after each step."""
        self._snapshots: dict[int, list[tuple[nn.Parameter, FlatGroup, int, list[list[torch.Tensor]]]]] = {}
        """Per optimizer (by id), the unused slices saved before its step, put back after it."""
        self._flat_by_master: dict[int, FlatGroup] = adopt_optimizers(units, optimizers, self.handles,
                                                                       self._restore_unused)

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def trainable_flats(self) -> list[FlatGroup]:
        return [f for u in self.units for f in u.flats if f.trainable]

    def masters(self, optimizer: Optimizer | None = None) -> list[nn.Parameter]:
        """The optimizer shards (of one optimizer, or all)."""
        opts = [optimizer] if optimizer is not None else self.optimizers
        return [p for o in opts for g in o.param_groups for p in g["params"]]

    def flat_of(self, master: nn.Parameter) -> FlatGroup:
        """The flat group an optimizer shard belongs to."""
        return self._flat_by_master[id(master)]

    def state_bytes(self) -> int:
        """Bytes of the optimizers' state tensors on this rank (each tensor once)."""
        seen: set[int] = set()
        total = 0
        for opt in self.optimizers:
            for state in opt.state.values():
                for v in state.values():
                    if torch.is_tensor(v) and id(v) not in seen:
                        seen.add(id(v))
                        total += v.numel() * v.element_size()
        return total

    # ------------------------------------------------------------------ the step
    def sync_grads(self) -> None:
        """Gradients to the OS level; the used-parameter flags all-reduced over all ranks; unused slices saved."""
        flats = self.trainable_flats()
        for f in flats:
            f.sync_grads()
        # Which parameters got a gradient on any rank: those that did not keep their value and optimizer state
        # through the step, as torch optimizers skip parameters whose .grad is None.
        if flats:
            used = torch.cat([f.used for f in flats])  # on the compute device, where the flags live
            self.comm.scalar_all_reduce(used, "global")
            for f, u in zip(flats, used.split([len(f.slots) for f in flats])):
                f.set_unused(u)
            self._protect_unused()

    def _protect_unused(self) -> None:
        """Save the optimizer-shard slices of unused parameters (and their optimizer state) before the step.

        Runs after the gradient sync, i.e. inside the optimizer's closure, just before ``optimizer.step`` proper.
        """
        self._snapshots = {}
        for opt in self.optimizers:
            for p in self.masters(opt):
                f = self._flat_by_master[id(p)]
                if not f.frozen_ranges:
                    continue
                tensors = [p] + _shard_states(opt, p)
                copies = [[t.detach()[a:b].clone() for a, b in f.frozen_ranges] for t in tensors]
                self._snapshots.setdefault(id(opt), []).append((p, f, len(tensors), copies))

    def _restore_unused(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """After ``optimizer``'s step: put the saved slices back (zeros for state the step created)."""
        with torch.no_grad():
            for p, f, count, copies in self._snapshots.pop(id(optimizer), []):
                # state tensors created by this (first) step did not exist at snapshot time: reset them to zero
                for i, t in enumerate([p] + _shard_states(optimizer, p)):
                    for k, (a, b) in enumerate(f.frozen_ranges):
                        if i < count:
                            t.detach()[a:b].copy_(copies[i][k])
                        else:
                            t.detach()[a:b].zero_()

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, optimizer: Optimizer | None, eps: float,
                       device: torch.device) -> torch.Tensor:
        """Clip the OS-level gradients by their global 2-norm; returns the norm before clipping.

        The sum of squares is reduced only over the ranks that hold *disjoint* shards (all ranks for OS = G, the
        group for OS = I, nobody for OS = N): reducing over replicas would count them several times. ``device``:
        where the sum lives when this rank holds no gradient (it is all-reduced all the same).
        """
        grads = [p.grad for p in self.masters(optimizer) if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else device)
        for g in grads:
            sq += g.detach().float().pow(2).sum()
        if self.optim_level != Level.N:
            self.comm.scalar_all_reduce(sq, SCOPE_OF[self.optim_level])
        total = sq.sqrt()
        coef = torch.clamp(max_norm / (total + eps), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    def after_step(self, optimizer: Optimizer | None) -> None:
        """Launch the OS -> P parameter sync of ``optimizer``'s flat groups (all optimizers' without one) and reset
        their gradient accumulators and used-parameter flags."""
        masters = {id(p) for p in self.masters(optimizer)}
        for f in self.trainable_flats():
            if id(f.master) in masters:
                f.sync_params()
                f.zero_grad_accumulators()
                f.master.grad = None
                f.used.zero_()
                f.frozen_ranges = []

    def refresh_masters(self) -> None:
        """After new weights were written into the parameter shards: separate master copies take them."""
        with torch.no_grad():
            for f in self.trainable_flats():
                if f.master.data_ptr() != f.own_param_slot.data_ptr():
                    f.master.copy_(f.own_param_slot)


def is_shard_state(value: Any, master: torch.Tensor) -> bool:
    """Whether an optimizer state value holds one entry per element of its optimizer shard (``exp_avg``, ...; not
    step counters): the one rule for which state is sharded like the shard (checkpoints and switches read it too)."""
    return torch.is_tensor(value) and value.shape == master.shape


def _shard_states(optimizer: Optimizer, master: nn.Parameter) -> list[torch.Tensor]:
    """The state tensors ``optimizer`` keeps per element of ``master``."""
    return [v for v in optimizer.state.get(master, {}).values() if is_shard_state(v, master)]
