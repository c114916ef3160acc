"""A switch whose resharding peak does not fit the rank's memory is declined; one that fits is made. Two processes
(2 groups of 1), a small MLP of four units.

Both fits start on NNN (``first_plan``) among NNN and GGG with the activations declared, under a budget NNN does not
fit and GGG does, so the re-plan after 2 steps asks for GGG. ``fits``: 1 GB of memory per rank, the switch is made.
``short``: the memory per rank is the budget itself, which the switch's peak (NNN's states, the model gathered and
GGG's states) exceeds: it is declined, NNN stays. Each fit logs with a CSVLogger under OUT/NAME; each rank writes
OUT/NAME.RANK.json.

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
from lightning_paro.planner import AutoConfig, Cluster, Compute, Link, predict
from lightning_paro.planner.workload import workload_from_module

out = Path(sys.argv[1])
rank = int(os.environ["RANK"])
BS, PER_TOKEN = 4, 1.0
LINKS = {"intra": Link.gbit(10, 10), "inter": Link.gbit(1, 50)}


class Block(nn.Module):
    """A unit of its own: GGG gathers one at a time, so it needs less memory than NNN."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), *[Block() for _ in range(4)], nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)),
                          batch_size=BS)


model = MLP()
work = workload_from_module(model, [model.configure_optimizers()], accumulation=1, tokens_per_micro_batch=BS,
                            activation_bytes_per_token=PER_TOKEN)
compute = Compute(1e-3, memory_bandwidth=1e10)
cluster = Cluster(2, 1, LINKS["intra"], LINKS["inter"], 1e9)
ggg, nnn = (predict(s, work, cluster, compute).memory.total for s in ("GGG", "NNN"))
assert ggg < nnn
budget = (ggg + nnn) / 2  # NNN does not fit, GGG does
for name, memory in (("fits", 1e9), ("short", budget)):
    config = AutoConfig(first_plan="NNN", strategies=("NNN", "GGG"), replan_after_steps=2, memory_budget=budget,
                        device_memory=memory, micro_step_seconds=1e-3, memory_bandwidth=1e10,
                        tokens_per_micro_batch=BS, activation_bytes_per_token=PER_TOKEN, trial_margin=0.0, **LINKS)
    torch.manual_seed(0)
    strategy = PaROStrategy(sharding="auto", group_size=1, auto=config)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=5, logger=CSVLogger(out / name),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(MLP())
    (out / f"{name}.{rank}.json").write_text(json.dumps({
        "in_use": strategy.sharding.name,
        "switches": [[s.from_strategy, s.to_strategy] for s in strategy.auto_switches],
        "replans": strategy.auto_replans, "budget": budget, "global_step": trainer.global_step}))
print("done", rank)
