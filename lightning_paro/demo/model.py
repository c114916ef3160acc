"""A small GPT-style byte-level language model for the demo."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import lightning as L


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the demo model."""

    vocab: int = 256
    """Byte-level vocabulary."""
    seq_len: int = 64
    """Context length in bytes."""
    dim: int = 96
    """Model width."""
    heads: int = 4
    """Attention heads."""
    layers: int = 4
    """Transformer blocks (the units the strategy gathers and frees)."""
    lr: float = 3e-3
    """AdamW learning rate."""


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1, self.ln2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(L.LightningModule):
    """Byte-level GPT with tied input and output embeddings."""

    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, cfg.dim))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)
        self.step_losses: list[float] = []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))

    def _loss(self, idx: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        logits = self(idx[:, :-1])
        return F.cross_entropy(logits.transpose(1, 2), idx[:, 1:], reduction=reduction)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("loss", loss, prog_bar=True, sync_dist=False)
        self.step_losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_bits_per_byte", self._loss(batch) / math.log(2), sync_dist=True, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.cfg.lr, weight_decay=0.01)
