"""Sharded PaRO checkpoints where one file is expected.

``PaROStrategy()`` saves sharded checkpoints: ``trainer.save_checkpoint("x.ckpt")`` writes a *directory* of shards
named ``x.ckpt``. Lightning's ``LightningModule.load_from_checkpoint`` and ``torch.load`` open files only (a directory
ends in ``IsADirectoryError`` inside them, before any hook of this package runs). Two ways to read one:

- ``python -m lightning_paro.convert SHARDED_DIR FULL_FILE`` consolidates it into one file in Lightning's own format
  (as ``"ddp"`` writes it): ``load_from_checkpoint`` reads it on one process, and
  ``Trainer(strategy="ddp").fit(..., ckpt_path=...)`` resumes from it;
- :func:`load_from_checkpoint` (``lightning_paro.load_from_checkpoint(MyModule, "x.ckpt")``) does what
  ``MyModule.load_from_checkpoint`` does, for a file or a sharded directory, consolidating in memory.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path
from typing import Any, TypeVar, Union

import torch

from lightning_paro.strategy.checkpoint import convert_to_full, read_full

Module = TypeVar("Module")


def load_checkpoint(path: Union[str, Path], weights_only: bool = True) -> dict[str, Any]:
    """A checkpoint as one dict in Lightning's format, on the CPU: a file as ``torch.load`` reads it, or a sharded
    directory consolidated in memory. ``weights_only=False`` only for checkpoints you trust."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if path.is_dir():
        return read_full(path, weights_only=weights_only)
    return torch.load(path, map_location="cpu", weights_only=weights_only)


def load_from_checkpoint(cls: type[Module], path: Union[str, Path], weights_only: bool = True,
                         **kwargs: Any) -> Module:
    """``cls.load_from_checkpoint(path, **kwargs)`` (a LightningModule or LightningDataModule class) for a checkpoint
    file or a sharded checkpoint directory: Lightning's own loading (hyperparameters, ``on_load_checkpoint``,
    strict keys, ``map_location``), given the checkpoint consolidated in memory."""
    path = Path(path)
    if not path.is_dir():
        return cls.load_from_checkpoint(path, weights_only=weights_only, **kwargs)  # type: ignore[attr-defined]
    buffer = io.BytesIO()
    torch.save(load_checkpoint(path, weights_only=weights_only), buffer)
    buffer.seek(0)
    return cls.load_from_checkpoint(buffer, weights_only=True, **kwargs)  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lightning_paro.convert",
                                 description="Consolidate a sharded PaRO checkpoint directory into one file.")
    ap.add_argument("src", help="sharded checkpoint directory (the one holding meta.pt and .metadata)")
    ap.add_argument("dst", help="output file, e.g. model.ckpt")
    ap.add_argument("--unsafe-load-meta", action="store_true",
                    help="read the trainer state with weights_only=False (only for checkpoints you trust)")
    args = ap.parse_args(argv)
    if Path(args.src).is_file():
        raise SystemExit(f"error: {args.src} is already one file (a full checkpoint): torch.load and"
                         " load_from_checkpoint read it as it is")
    try:
        path = convert_to_full(args.src, args.dst, weights_only=not args.unsafe_load_meta)
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"error: {err}") from None
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
