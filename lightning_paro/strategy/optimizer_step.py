"""A :class:`~lightning_paro.strategy.engine.PaROEngine`'s optimizer step, from the accumulation boundary to the
next step's first use of the parameters.

* :func:`sync_grads` brings every trainable flat group's gradient to the optimizer-state level and agrees, over all
  ranks, which parameters received a gradient; :func:`protect_unused` then snapshots the optimizer-shard slices of
  the unused ones, and :func:`restore_unused` (an optimizer step post-hook) puts them back, as torch optimizers leave
  a parameter whose ``.grad`` is None untouched;
* :func:`clip_grad_norm` clips the optimizer-level gradients by their global norm;
* :func:`after_optimizer_step` launches the OS -> P parameter sync and resets the gradient accumulators.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

from lightning_paro.strategy.levels import Level
from lightning_paro.strategy.transitions import SCOPE_OF

if TYPE_CHECKING:
    from lightning_paro.strategy.engine import PaROEngine


def sync_grads(engine: PaROEngine) -> None:
    """Gradients to the OS level; the used-parameter flags all-reduced over all ranks; unused slices snapshotted."""
    flats = [f for f in engine.flat_groups() if f.trainable]
    for f in flats:
        f.sync_grads()
    # Which parameters got a gradient on any rank: those that did not keep their value and optimizer state
    # through the step, as torch optimizers skip parameters whose .grad is None.
    if flats:
        used = torch.cat([f.used for f in flats])  # on the compute device, where the flags live
        engine.comm.scalar_all_reduce(used, "global")
        for f, u in zip(flats, used.split([len(f.slots) for f in flats])):
            f.set_unused(u)
        engine._protect_unused()


def protect_unused(engine: PaROEngine) -> None:
    """Snapshot the optimizer-shard slices of unused parameters (and their optimizer state) before the step.

    Runs after the gradient sync, i.e. inside the optimizer's closure, just before ``optimizer.step`` proper.
    """
    engine._saved = {}
    for opt in engine.optimizers:
        for p in engine.masters(opt):
            f = engine._flat_by_master[id(p)]
            if not f.frozen_ranges:
                continue
            tensors = [p] + [v for v in opt.state.get(p, {}).values() if torch.is_tensor(v) and v.shape == p.shape]
            copies = [[t.detach()[a:b].clone() for a, b in f.frozen_ranges] for t in tensors]
            engine._saved.setdefault(id(opt), []).append((p, f, len(tensors), copies))


def restore_unused(engine: PaROEngine, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    """After ``optimizer``'s step: put the snapshotted slices back (zeros for state the step created)."""
    with torch.no_grad():
        for p, f, count, copies in getattr(engine, "_saved", {}).pop(id(optimizer), []):
            # state tensors created by this (first) step did not exist at snapshot time: reset them to zero
            tensors = [p] + [v for v in optimizer.state.get(p, {}).values()
                             if torch.is_tensor(v) and v.shape == p.shape]
            for i, t in enumerate(tensors):
                for k, (a, b) in enumerate(f.frozen_ranges):
                    if i < count:
                        t.detach()[a:b].copy_(copies[i][k])
                    else:
                        t.detach()[a:b].zero_()


@torch.no_grad()
def clip_grad_norm(engine: PaROEngine, max_norm: float, optimizer: Optimizer | None, eps: float) -> torch.Tensor:
    """Clip the OS-level gradients by their global 2-norm.

    The sum of squares is reduced only over the ranks that hold *disjoint* shards (all ranks for OS = G, the
    group for OS = I, nobody for OS = N): reducing over replicas would count them several times.
    """
    grads = [p.grad for p in engine.masters(optimizer) if p.grad is not None]
    # On the compute device even when this rank holds no gradient: the sum is all-reduced.
    device = grads[0].device if grads else next((f.device for f in engine.flat_groups()), engine.comm.device)
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        sq += g.detach().float().pow(2).sum()
    if engine.spec.optim != Level.N:
        engine.comm.scalar_all_reduce(sq, SCOPE_OF[engine.spec.optim])
    total = sq.sqrt()
    coef = torch.clamp(max_norm / (total + eps), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total


def after_optimizer_step(engine: PaROEngine, optimizer: Optimizer | None) -> None:
    """Launch the OS -> P parameter sync of ``optimizer``'s flat groups (all optimizers' without one) and reset
    their gradient accumulators and used-parameter flags."""
    masters = {id(p) for p in engine.masters(optimizer)}
    for unit in engine.units:
        for f in unit.flats:
            if f.trainable and id(f.master) in masters:
                f.sync_params()
                f.zero_grad_accumulators()
                f.master.grad = None
                f.used.zero_()
                f.frozen_ranges = []
