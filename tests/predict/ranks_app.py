"""A script that runs ElasticPredict under Trainer(devices=2, strategy=...) on the CPU: python ranks_app.py OUT STRATEGY."""

from __future__ import annotations

import sys

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_paro.predict import ElasticPredict
from predict_app import Affine, JobSpec, RowsDataset

if __name__ == "__main__":
    torch.set_num_threads(1)
    spec = JobSpec(output_dir=sys.argv[1], rows=50, shard_size=7)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=sys.argv[2], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[ElasticPredict(spec.output_dir, shard_size=spec.shard_size)])
    trainer.predict(Affine(spec), dataloaders=DataLoader(RowsDataset(spec), batch_size=4))
