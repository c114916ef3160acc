"""Train the demo GPT (tiny shape) under one PaRO strategy with several communication dtypes, in the same processes;
save each run's per-step losses, its traffic per optimizer step and its weights after fit.

argv: output directory, steps, then runs as ``NAME~PARAM+REDUCE`` (``-``: the option left unset), e.g.
``IIG~-+-`` (exact) and ``IIG~bf16+bf16``.
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch

import lightning_paro  # noqa: F401
from lightning_paro import PaROStrategy
from lightning_paro.demo import StdlibData
from lightning_paro.demo.task import GPTTask

out_dir, steps, runs = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


class Record(L.Callback):
    """Per optimizer step: the loss averaged over the ranks (every rank sees it), and the traffic."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = trainer.strategy.reduce(outputs["loss"].detach().clone(), reduce_op="mean")
        self.losses.append(loss.item())


for run in runs:
    name, _, dtypes = run.partition("~")
    param, _, reduce = dtypes.partition("+")
    L.seed_everything(0, verbose=False)
    model = GPTTask(seq_len=32, dim=32, heads=2, layers=2, lr=3e-3)
    data = StdlibData(seq_len=32, train_bytes=40_000, held_out_bytes=20_000, batch_size=4)
    strategy = PaROStrategy(sharding=name, group_size=2, param_dtype=None if param in ("", "-") else param,
                            reduce_dtype=None if reduce in ("", "-") else reduce)
    record = Record()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, gradient_clip_val=1.0, callbacks=[record])
    trainer.fit(model, datamodule=data)
    traffic = [{"intra": t.intra, "inter": t.inter, "by_op": t.by_op} for t in strategy.traffic_history]
    flats = [{"root": u is strategy.engine.root, "trainable": f.trainable, "padded": f.layout.padded,
              "elsize": f.p_local.element_size()} for u in strategy.engine.units for f in u.flats]
    (out_dir / f"{run}.{rank}.json").write_text(json.dumps({"losses": record.losses, "traffic": traffic,
                                                            "flats": flats}))
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out_dir / f"{run}.{rank}.pt")
print("done", rank)
