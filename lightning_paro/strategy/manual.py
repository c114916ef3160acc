"""Optimization the user drives: manual optimization's step protocol on the engine, and the one-optimizer rule that
both kinds of optimization follow."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim import Optimizer

if TYPE_CHECKING:
    from lightning_paro.strategy.engine import PaROEngine


class ManualSteps:
    """Manual optimization (``automatic_optimization=False``) on the engine.

    ``manual_backward`` may run several times before a step, with forwards between: each backward only accumulates,
    and the gradients reach the optimizer shards (``sync_grads``, once) when the step or a clip needs them. Between a
    backward and the next forward, and after a step, the root unit is made ready again (gathered with the current
    weights), since the training step may go on.
    """

    def __init__(self, engine: PaROEngine) -> None:
        self.engine = engine
        self.pending = False
        """A backward ran since the last sync."""
        self.synced = False
        """The gradients are at the optimizer shards and the step has not run yet."""

    def before_backward(self) -> None:
        # Raised before the backward issues any collective, so that every rank stops with nothing in flight.
        if self.synced:
            raise RuntimeError("manual_backward ran after clip_gradients and before the optimizer step: under the PaRO"
                               " strategy clip right before `opt.step()`, after the last manual_backward.")

    def after_backward(self) -> None:
        self.engine.finish_backward(sync=False)
        self.pending = True
        self.engine.prepare_next_forward()

    def before_step(self) -> None:
        """Before a step or a clip."""
        if self.pending:
            self.engine.sync_grads()
            self.pending = False
            self.synced = True

    def after_step(self) -> None:
        self.synced = False
        self.engine.prepare_next_forward()


def check_one_optimizer(optimizers: list[Optimizer]) -> None:
    """The engine steps one optimizer (in automatic or manual optimization); fail at set-up, before any step, for
    more."""
    if len(optimizers) > 1:
        names = ", ".join(type(o._optimizer if isinstance(o, LightningOptimizer) else o).__name__ for o in optimizers)
        raise ValueError(
            f"The PaRO strategy trains one optimizer; configure_optimizers returned {len(optimizers)} ({names}). Put"
            " the parameters in one optimizer (each param group may set its own lr and hyper-parameters), or train"
            " this module with strategy='ddp'.")
