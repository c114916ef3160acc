"""Save checkpoints over and over (a new one, and an overwrite of the same path), sharded and full in turn, until
killed.

Usage: ckpt_kill.py DIR. DIR/good (sharded) and DIR/good.ckpt (full) are written first; DIR/ready marks that saving
began. Sharded checkpoints are directories without a suffix, full ones files ending in ".ckpt".
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
import lightning as L  # noqa: E402
from tiny_lm import TinyLM, loader  # noqa: E402

from lightning_paro import PaROStrategy  # noqa: E402

out = Path(sys.argv[1])
torch.manual_seed(0)
model = TinyLM()
strategy = PaROStrategy("IIG", group_size=1)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, loader(8))


def save(name: str, fmt: str) -> None:
    strategy.state_dict_type = fmt  # read at each save
    trainer.save_checkpoint(out / (name if fmt == "sharded" else f"{name}.ckpt"))


save("good", "sharded")
save("good", "full")
if trainer.global_rank == 0:
    (out / "ready").touch()
for i in range(10_000):
    for fmt in ("sharded", "full"):
        save("latest", fmt)
        save(f"ck{i % 3}", fmt)
