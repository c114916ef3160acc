"""Real text that ships with every Python install: the standard library's own source files."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset


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
