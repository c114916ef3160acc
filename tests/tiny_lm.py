"""A tiny transformer language model with every feature the engine must handle: tied embeddings, a frozen block,
buffers, odd-sized parameters, two optimizer param groups and an LR scheduler."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning as L

VOCAB, DIM, HEADS, FFN, SEQ, BLOCKS = 37, 10, 2, 18, 8, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)  # a key bias has no gradient: Adam would amplify noise
        self.proj = nn.Linear(DIM, DIM)
        self.ln2 = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, FFN)
        self.fc2 = nn.Linear(FFN, DIM)
        self.register_buffer("mask", torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // HEADS)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(L.LightningModule):
    def __init__(self, lr: float = 1e-2, freeze_block: int | None = 1, unused: bool = True,
                 optimizer: str = "adamw") -> None:
        super().__init__()
        self.lr = lr
        self.optimizer_name = optimizer
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.tensor(1.0 / math.sqrt(DIM)))
        self.unused = nn.Linear(3, 5) if unused else None  # a parameter no step uses
        if freeze_block is not None:
            for p in self.blocks[freeze_block].parameters():
                p.requires_grad_(False)
        self.losses: list[float] = []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x)) * (self.scale * math.sqrt(DIM))

    def loss(self, batch) -> torch.Tensor:
        (idx,) = batch
        logits = self(idx[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.losses.append(loss.item())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0][:, :-1]).argmax(-1)

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.requires_grad and p.ndim < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        if self.optimizer_name == "sgd":
            opt = torch.optim.SGD(groups, lr=self.lr * 10, momentum=0.9, nesterov=True)
        elif self.optimizer_name == "adam":
            opt = torch.optim.Adam(groups, lr=self.lr)
        else:
            opt = torch.optim.AdamW(groups, lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def token_data(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, VOCAB, (n, SEQ + 1), generator=g))


def loader(n: int, batch_size: int = 2, seed: int = 0) -> DataLoader:
    return DataLoader(token_data(n, seed), batch_size=batch_size, shuffle=False)
