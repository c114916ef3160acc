"""The training progress bar of the command line: optimizer steps against ``max_steps``.

Lightning's TQDM bar, when training is bounded by ``max_steps``, takes the optimizer steps left as its total but
counts micro-batches, so under gradient accumulation it reads ``0/60`` at the start and ``120/?`` at the end, and it
starts over at every pass over the data. This bar counts optimizer steps (``trainer.global_step``) against
``max_steps``, across passes over the data, and says which pass it is on; without ``max_steps`` it is Lightning's bar
(micro-batches of the epoch against the epoch's length, which match).
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar


def counts_optimizer_steps(trainer: L.Trainer) -> bool:
    """Whether training is bounded by max_steps alone (Lightning's own condition for a total in steps)."""
    return trainer.max_steps is not None and trainer.max_steps > 0 and trainer.max_epochs == -1


class StepProgressBar(TQDMProgressBar):
    """A TQDM progress bar whose training bar counts optimizer steps against ``max_steps`` (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._step_bar_started = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._step_bar_started = False

    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if not counts_optimizer_steps(trainer):
            super().on_train_epoch_start(trainer, *args)
            return
        bar = self.train_progress_bar
        if not self._step_bar_started:  # one bar for the whole run, not one per pass over the data
            bar.reset(total=trainer.max_steps)
            bar.initial = 0
            bar.n = trainer.global_step  # a resumed run starts where it left off
            self._step_bar_started = True
        bar.set_description(f"Optimizer steps (data pass {trainer.current_epoch})")
        if not bar.disable:
            bar.refresh()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not counts_optimizer_steps(trainer):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        bar = self.train_progress_bar
        step = trainer.global_step
        if bar is not None and not bar.disable and self._should_update(step, bar.total):
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not counts_optimizer_steps(trainer):
            super().on_train_epoch_end(trainer, pl_module)
            return
        if not self.train_progress_bar.disable:  # the bar goes on into the next pass
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))
