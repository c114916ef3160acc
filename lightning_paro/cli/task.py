"""The model and data the commands run: the demo GPT on standard-library source, plus per-file scoring."""

from __future__ import annotations

import dataclasses
import math
import sysconfig
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_paro.cli.schema import GPTModelConfig, StdlibDataConfig
from lightning_paro.demo.data import ByteChunks, stdlib_files
from lightning_paro.demo.model import GPT, GPTConfig

CHECKPOINT_MODEL_KEY = "lightning_paro_model"
"""Checkpoint entry holding the model config it was trained with, so predict can refuse a mismatched shape."""


def gpt_config(model: GPTModelConfig) -> GPTConfig:
    """The demo's GPTConfig with the values of the ``model`` config group."""
    return GPTConfig(**{f.name: getattr(model, f.name) for f in dataclasses.fields(GPTConfig)})


def freeze_all_but_last_blocks(model: GPT, trainable_blocks: int) -> None:
    """Freeze every parameter except those of the last ``trainable_blocks`` blocks and the final norm."""
    if not 0 <= trainable_blocks <= len(model.blocks):
        raise ValueError(f"model.trainable_blocks={trainable_blocks} must be between 0 and the {len(model.blocks)}"
                         " blocks of the model")
    model.requires_grad_(False)
    for block in list(model.blocks)[len(model.blocks) - trainable_blocks:]:
        block.requires_grad_(True)
    model.ln_f.requires_grad_(True)


class GPTTask(GPT):
    """The demo GPT as the commands use it: scores whole files in ``predict_step``, shards itself under FSDP2, and
    records its shape in checkpoints."""

    def __init__(self, model: GPTModelConfig) -> None:
        super().__init__(gpt_config(model))
        self.model_config = model
        if model.trainable_blocks is not None:
            freeze_all_but_last_blocks(self, model.trainable_blocks)

    def predict_step(self, batch: dict, batch_idx: int = 0) -> dict[str, torch.Tensor]:
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
        return {"bits_per_byte": (nll * scored).sum(1) / count / math.log(2), "bytes_scored": count.long()}

    def configure_model(self) -> None:
        # Only Lightning's ModelParallelStrategy (the fsdp2 and hsdp configs) asks the model to shard itself.
        strategy = self._trainer.strategy if self._trainer is not None else None
        mesh_for = getattr(strategy, "fsdp_mesh", None)
        if mesh_for is None:
            return
        from torch.distributed.fsdp import fully_shard

        mesh, reshard = mesh_for(), strategy.reshard_after_forward
        for block in self.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(self, mesh=mesh, reshard_after_forward=reshard)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_MODEL_KEY] = dataclasses.asdict(self.model_config)


# ---------------------------------------------------------------------------------------------------- data
def split_files(data: StdlibDataConfig) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): consecutive standard-library files in sorted order, never overlapping."""
    train = stdlib_files(data.train_bytes)
    return train, stdlib_files(data.held_out_bytes, skip=len(train))


def train_loaders(data: StdlibDataConfig, seq_len: int) -> tuple[DataLoader, DataLoader]:
    """(training, validation) loaders of byte windows. The shuffle order follows the seed set by seed_everything
    (Lightning's distributed sampler reads it too); no torch.Generator here, as one cannot be pickled for spawn."""
    train_files, held_out = split_files(data)
    train = DataLoader(ByteChunks(train_files, seq_len), batch_size=data.batch_size, shuffle=True,
                       num_workers=data.num_workers)
    val = DataLoader(ByteChunks(held_out, seq_len), batch_size=data.val_batch_size, num_workers=data.num_workers)
    return train, val


class FileBytes(Dataset):
    """One row per file: its leading bytes padded to a fixed number of windows, for per-file scoring."""

    def __init__(self, files: list[Path], seq_len: int, max_bytes: int) -> None:
        self.files = files
        self.max_bytes = max_bytes
        self.windows = max(1, math.ceil((max_bytes - 1) / seq_len))
        self.size = self.windows * seq_len + 1
        self.root = Path(sysconfig.get_paths()["stdlib"])

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, Any]:
        path = self.files[index]
        data = path.read_bytes()[: self.max_bytes]
        tokens = torch.zeros(self.size, dtype=torch.long)
        tokens[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).long() if data else tokens[:0]
        name = str(path.relative_to(self.root)) if path.is_relative_to(self.root) else str(path)
        return {"path": name, "tokens": tokens, "length": len(data)}
