"""Real text that ships with every Python install: the standard library's own source files, as a LightningDataModule
(what a ``data`` config node builds)."""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset


def stdlib_files(limit_bytes: int, skip: int = 0) -> list[Path]:
    """Standard-library ``.py`` files in a stable order, about ``limit_bytes`` of them after the first ``skip``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    out, total = [], 0
    for p in files[skip:]:
        out.append(p)
        total += p.stat().st_size
        if total >= limit_bytes:
            break
    return out


def split_files(train_bytes: int, held_out_bytes: int) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): consecutive standard-library files in sorted order, never overlapping."""
    train = stdlib_files(train_bytes)
    return train, stdlib_files(held_out_bytes, skip=len(train))


class ByteChunks(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes over the concatenated files."""

    def __init__(self, files: list[Path], seq_len: int) -> None:
        data = b"\n".join(p.read_bytes() for p in files)
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.window = seq_len + 1

    def __len__(self) -> int:
        return len(self.tokens) // self.window

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i * self.window:(i + 1) * self.window]


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


class StdlibData(L.LightningDataModule):
    """Training windows from about ``train_bytes`` of standard-library files; validation windows and per-file
    prediction rows from about ``held_out_bytes`` of the files after them."""

    def __init__(self, seq_len: int = 64, train_bytes: int = 600_000, held_out_bytes: int = 100_000,
                 batch_size: int = 8, val_batch_size: int = 16, predict_batch_size: int = 4,
                 max_bytes_per_file: int = 4096, num_workers: int = 0) -> None:
        super().__init__()
        for name in ("seq_len", "train_bytes", "held_out_bytes", "batch_size", "val_batch_size", "predict_batch_size"):
            value = locals()[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if max_bytes_per_file < 2:
            raise ValueError(f"max_bytes_per_file={max_bytes_per_file} must be at least 2 (one prediction)")
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} must be 0 or more")
        self.seq_len, self.train_bytes, self.held_out_bytes = seq_len, train_bytes, held_out_bytes
        self.batch_size, self.val_batch_size, self.predict_batch_size = batch_size, val_batch_size, predict_batch_size
        self.max_bytes_per_file, self.num_workers = max_bytes_per_file, num_workers
        self.train_files: list[Path] = []
        self.held_out_files: list[Path] = []

    def setup(self, stage: Optional[str] = None) -> None:
        self.train_files, self.held_out_files = split_files(self.train_bytes, self.held_out_bytes)

    def train_dataloader(self) -> DataLoader:
        # The shuffle order follows the seed set by seed_everything (Lightning's distributed sampler reads it too);
        # no torch.Generator here, as one cannot be pickled for spawn.
        return DataLoader(ByteChunks(self.train_files, self.seq_len), batch_size=self.batch_size, shuffle=True,
                          num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(ByteChunks(self.held_out_files, self.seq_len), batch_size=self.val_batch_size,
                          num_workers=self.num_workers)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(FileBytes(self.held_out_files, self.seq_len, self.max_bytes_per_file),
                          batch_size=self.predict_batch_size, num_workers=self.num_workers)
