"""The command line's training progress bar counts optimizer steps against max_steps, across passes over the data,
where Lightning's own counts micro-batches against a total in optimizer steps (0/6 running on to 12/?)."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_paro.cli.progress import StepProgressBar


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_the_bar_counts_optimizer_steps_against_max_steps_across_data_passes(tmp_path):
    bar = StepProgressBar()
    seen = []

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            seen.append((bar.train_progress_bar.n, bar.train_progress_bar.total, trainer.current_epoch))

    # 5 micro-batches per pass, 2 per optimizer step (Lightning also steps at the end of a pass): 6 steps, 2 passes
    loader = DataLoader(TensorDataset(torch.randn(10, 2)), batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, max_epochs=-1, accumulate_grad_batches=2,
                        logger=False, enable_checkpointing=False, enable_model_summary=False,
                        callbacks=[Watch(), bar], default_root_dir=tmp_path)
    trainer.fit(Tiny(), loader)
    # Watch runs before the bar in each hook: it sees the count of the micro-batch before
    assert all(total == 6 for _, total, _ in seen) and [n for n, _, _ in seen] == sorted(n for n, _, _ in seen)
    assert {epoch for _, _, epoch in seen} == {0, 1} and len(seen) == 10
    assert bar.train_progress_bar.n == bar.train_progress_bar.total == 6


def test_without_max_steps_it_is_lightning_s_bar(tmp_path):
    bar = StepProgressBar()
    loader = DataLoader(TensorDataset(torch.randn(10, 2)), batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, accumulate_grad_batches=2, logger=False,
                        enable_checkpointing=False, enable_model_summary=False, callbacks=[bar],
                        default_root_dir=tmp_path)
    trainer.fit(Tiny(), loader)
    assert bar.train_progress_bar.n == bar.train_progress_bar.total == 5  # micro-batches of the last pass
