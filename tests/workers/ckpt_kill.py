"""Save checkpoints over and over (a new one, and an overwrite of the same path) until killed.

Usage: ckpt_kill.py DIR FORMAT (sharded | full). DIR/good is written first; DIR/ready marks that saving began.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
import lightning as L  # noqa: E402
from tiny_lm import TinyLM, loader  # noqa: E402

from lightning_paro import PaROStrategy  # noqa: E402

out, fmt = Path(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
model = TinyLM()
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=PaROStrategy("IIG", group_size=1, state_dict_type=fmt),
                    max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(model, loader(8))
suffix = "" if fmt == "sharded" else ".ckpt"
trainer.save_checkpoint(out / f"good{suffix}")
if trainer.global_rank == 0:
    (out / "ready").touch()
for i in range(10_000):
    trainer.save_checkpoint(out / f"latest{suffix}")
    trainer.save_checkpoint(out / f"ck{i % 3}{suffix}")
