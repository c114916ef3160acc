"""HO-Ring's policy: how a collective is cut into pipeline chunks, when it runs flat instead, which thread runs it.

Every rank must pass an equal :class:`HORingConfig` to the same collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ReduceOp = Literal["sum", "avg"]
"""``"sum"``, or ``"avg"``: the sum divided by the number of ranks reduced over."""

KiB = 1024
MiB = 1024 * KiB


@dataclass(frozen=True)
class HORingConfig:
    """How HO-Ring cuts a collective into chunks, and when it falls back to a flat one."""

    chunk_bytes: int = 2 * MiB
    """Bytes of the full buffer per pipeline chunk: smaller overlaps better, larger pays less per-message overhead."""
    flat_below_bytes: int = 1 * MiB
    """Buffers smaller than this use one flat collective over the world (one latency step instead of four phases)."""
    single_thread: bool | None = None
    """Run the pipeline on the calling thread, in one fixed interleaving of chunks and phases, instead of on the
    phases' own threads; ``None`` (default): single-thread for CUDA tensors, whose NCCL calls must come from one thread
    in the same order on every rank. The results are the same bits either way."""

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be a positive number of bytes, got {self.chunk_bytes}.")
        if self.flat_below_bytes < 0:
            raise ValueError(f"flat_below_bytes must be >= 0 (0 = never flat), got {self.flat_below_bytes}.")


DEFAULT_CONFIG = HORingConfig()
"""2 MiB chunks, flat below 1 MiB, single-thread for CUDA tensors."""


def _check_op(op: str) -> None:
    """Reject a reduction HO-Ring does not run (see :data:`ReduceOp`)."""
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}.")
