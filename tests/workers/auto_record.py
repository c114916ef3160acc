"""``sharding="auto"`` reproducible or not, on two processes (2 groups of 1): the run's record in ``trainer.log_dir``
and whether the fit re-planned on measured timings.

Both fits start with NNG (``first_plan``; links, memory and update bandwidth given, so nothing is probed), NGG its
gradient-only neighbour, margins that make the timed re-plan try NGG: ``timed`` does, ``deterministic``
(``Trainer(deterministic=True)``) keeps NNG without re-planning on timings. Each fit logs with a CSVLogger under
OUT/NAME; each rank writes OUT/NAME.RANK.json.

argv: output directory.
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_paro import PaROStrategy
from lightning_paro.planner import AutoConfig, Link

out = Path(sys.argv[1])
rank = int(os.environ["RANK"])


class MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 2, generator=g)),
                          batch_size=2)


config = AutoConfig(first_plan="NNG", strategies=("NNG", "NGG"), replan_after_steps=2, replan_margin=0.0,
                    trial_margin=1e9, intra=Link.gbit(100, 5), inter=Link.gbit(1, 50), device_memory=4e9,
                    memory_bandwidth=1e10)
for name, deterministic in (("timed", False), ("deterministic", True)):
    torch.manual_seed(0)
    strategy = PaROStrategy(sharding="auto", group_size=1, auto=config)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=10, deterministic=deterministic,
                        logger=CSVLogger(out / name), enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(MLP())
    (out / f"{name}.{rank}.json").write_text(json.dumps({
        "log_dir": trainer.log_dir, "replans": len(strategy.auto_replans),
        "switches": [[s.from_strategy, s.to_strategy] for s in strategy.auto_switches],
        "in_use": strategy.sharding.name}))
print("done", rank)
