"""The int8 hop's error feedback over a fit: a sharded checkpoint carries it, a different layout starts it from zero
(with a note), so does a full checkpoint, which does not hold it, a non-finite gradient leaves it finite, and the
public quantized collectives refuse a size they cannot split. Four processes in 2 groups of 2 (one job: 4 groups of
1), ``IIG`` with ``inter_quant="int8"`` and ``error_feedback=True``, a two-layer MLP.

argv: output directory. Each rank writes OUT/RANK.json.
"""

import json
import math
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_paro  # noqa: F401
from lightning_paro import PaROStrategy

out = Path(sys.argv[1])
rank = int(os.environ["RANK"])
STEPS = 3


class MLP(L.LightningModule):
    def __init__(self, inject_inf_at: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
        self.inject_inf_at = inject_inf_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.global_step == self.inject_inf_at and self.global_rank == 0:
            loss = loss + self.net[0].weight.view(-1)[5] * math.inf  # one gradient element inf on one rank
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)),
                          batch_size=4)


class AfterStep(L.Callback):
    """After every optimizer step: whether every error-feedback buffer of this rank is finite."""

    def __init__(self) -> None:
        self.finite: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        buffers = [f.quant_error for f in trainer.strategy.engine.flat_groups() if f.quant_error is not None]
        self.finite.append(bool(buffers) and all(bool(b.isfinite().all()) for b in buffers))


def fit(group_size: int = 2, resume: Path | None = None, inject_inf_at: int | None = None,
        state_dict_type: str = "sharded"):
    torch.manual_seed(0)
    model = MLP(inject_inf_at)
    strategy = PaROStrategy(sharding="IIG", group_size=group_size, inter_quant="int8", error_feedback=True,
                            state_dict_type=state_dict_type)
    after = AfterStep()
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[after])
    trainer.fit(model, ckpt_path=str(resume) if resume else None)
    return trainer, strategy, after


def buffers(strategy) -> list[torch.Tensor]:
    return [f.quant_error.clone() for f in strategy.engine.flat_groups() if f.quant_error is not None]


result = {}
ckpt = out / "fed.ckpt"
trainer, strategy, _ = fit()
saved = buffers(strategy)
result["buffers"] = len(saved)
result["saved_nonzero"] = all(bool(b.abs().sum() > 0) for b in saved)
trainer.save_checkpoint(ckpt)

# the public quantized collectives: 10 elements do not split over 4 ranks
try:
    strategy.engine.comm.all_reduce(torch.zeros(10), "global", quant="int8")
    result["odd_size_error"] = None
except ValueError as err:
    result["odd_size_error"] = str(err)

_, resumed, _ = fit(resume=ckpt)  # the same layout: each rank reads its own buffers back
result["resumed_equal"] = [torch.equal(a, b) for a, b in zip(saved, buffers(resumed))]

_, other, _ = fit(group_size=1, resume=ckpt)  # 4 groups of 1: another layout's buffers mean nothing here
result["other_layout_zero"] = [bool((b == 0).all()) for b in buffers(other)]

trainer, _, _ = fit(state_dict_type="full")
trainer.save_checkpoint(out / "full.ckpt")
_, from_full, _ = fit(resume=out / "full.ckpt", state_dict_type="full")  # a full checkpoint holds none
result["from_full_zero"] = [bool((b == 0).all()) for b in buffers(from_full)]

_, _, after = fit(inject_inf_at=1)
result["finite_after_each_step"] = after.finite
(out / f"{rank}.json").write_text(json.dumps(result))
print("done", rank)
