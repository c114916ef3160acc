"""Small models for the deferred-initialisation tests: built on CPU or on the meta device from the same code, each
initialised the way the rule of ``lightning_paro/strategy/deferred_init.py`` replays (``reset_parameters`` of torch
modules; Hugging Face's own ``_init_weights``)."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

import lightning as L


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPTNet(nn.Module):
    """A GPT whose every tensor belongs to a torch module with ``reset_parameters``; input and output embeddings
    tied."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class TiedNorms(nn.Module):
    """Tied weights across units, BatchNorm statistics (buffers) and a parameter shared inside a unit."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 6))
                                    for _ in range(3))
        self.blocks[1][2].weight = self.blocks[1][0].weight  # tied inside a unit
        self.blocks[2][0].bias = self.blocks[0][0].bias  # tied across units: lives in the root unit
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight


def llama(tied: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg)


class NoReset(nn.Module):
    """A module whose own parameter no initialisation call writes (no ``reset_parameters``)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.lin = nn.Linear(4, 4)


class GPTModule(L.LightningModule):
    """The GPT as a LightningModule, built in ``configure_model`` on the meta device or on CPU; ``pretrained``: the
    weights set-up fills it from (``init_from_pretrained``)."""

    def __init__(self, meta: bool, pretrained: str | None = None, vocab: int = 40, dim: int = 16, heads: int = 2,
                 layers: int = 3, seq_len: int = 8) -> None:
        super().__init__()
        self.meta, self.pretrained = meta, pretrained
        self.shape = dict(vocab=vocab, dim=dim, heads=heads, layers=layers, seq_len=seq_len)
        self.net: GPTNet | None = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.net is not None:
            return
        with torch.device("meta") if self.meta else nullcontext():
            self.net = GPTNet(**self.shape)
        if self.pretrained is not None:
            from lightning_paro.strategy.loading import init_from_pretrained
            init_from_pretrained(self, self.pretrained, prefix="net.")

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        logits = self.net(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        (idx,) = batch
        logits = self.net(idx[:, :-1])
        self.log("val_loss", F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1)),
                 sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)
