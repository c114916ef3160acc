"""The demo GPT as the command line trains it: a LightningModule built from keyword arguments (what a ``model``
config node gives), that scores whole files in ``predict_step``."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

from lightning_paro.demo.model import GPT, GPTConfig


def freeze_all_but_last_blocks(model: GPT, trainable_blocks: int) -> None:
    """Freeze every parameter except those of the last ``trainable_blocks`` blocks and the final norm."""
    if not 0 <= trainable_blocks <= len(model.blocks):
        raise ValueError(f"trainable_blocks={trainable_blocks} must be between 0 and layers={len(model.blocks)}, or"
                         " null to train every block")
    model.requires_grad_(False)
    for block in list(model.blocks)[len(model.blocks) - trainable_blocks:]:
        block.requires_grad_(True)
    model.ln_f.requires_grad_(True)


class GPTTask(GPT):
    """The demo's byte-level GPT with its shape as arguments; ``trainable_blocks`` freezes all but the last blocks
    (a PEFT-like run). Invalid shapes raise ValueError naming the argument."""

    def __init__(self, vocab: int = 256, seq_len: int = 64, dim: int = 96, heads: int = 4, layers: int = 4,
                 lr: float = 3e-3, trainable_blocks: Optional[int] = None) -> None:
        for name, value in (("vocab", vocab), ("seq_len", seq_len), ("dim", dim), ("heads", heads),
                            ("layers", layers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if dim % heads:
            raise ValueError(f"dim={dim} is not divisible by heads={heads}")
        if vocab < 256:
            raise ValueError(f"vocab={vocab} is too small for byte-level text; use 256")
        if not lr > 0:
            raise ValueError(f"lr={lr} must be positive")
        super().__init__(GPTConfig(vocab=vocab, seq_len=seq_len, dim=dim, heads=heads, layers=layers, lr=lr))
        self.save_hyperparameters()
        self.tokens_per_sample = seq_len
        """Tokens one training sample trains on: bench reports tokens per second from it."""
        if trainable_blocks is not None:
            freeze_all_but_last_blocks(self, trainable_blocks)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_bits_per_byte", loss / math.log(2), sync_dist=True, prog_bar=True)

    def predict_step(self, batch: dict, batch_idx: int = 0) -> dict[str, Any]:
        """Bits per byte of each file's leading bytes (windows of seq_len, each predicted from its own start)."""
        tokens, length = batch["tokens"], batch["length"]
        b, total = tokens.shape
        seq = self.cfg.seq_len
        inputs = tokens[:, :-1].reshape(b * ((total - 1) // seq), seq)
        targets = tokens[:, 1:].reshape(b, -1)
        logits = self(inputs).reshape(b, -1, self.cfg.vocab)
        nll = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        scored = (torch.arange(targets.shape[1], device=tokens.device)[None, :] < (length[:, None] - 1)).to(nll.dtype)
        count = scored.sum(1).clamp_min(1)
        return {"path": list(batch["path"]), "bits_per_byte": (nll * scored).sum(1) / count / math.log(2),
                "bytes_scored": count.long()}
