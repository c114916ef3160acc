"""Making a rename durable: what both the checkpoints and the prediction shard files need so that a name, once it
appears, survives a crash of the machine."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Flush ``path``'s directory entries (a rename or a new name in it) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
