"""Traffic accounting: bytes each rank sends, by collective and by scope (intra / inter)."""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

INTRA = "intra"
INTER = "inter"


def ring_bytes(op: str, nbytes: int, k: int) -> int:
    """Bytes one rank sends in a ring ``op`` over ``k`` ranks.

    ``nbytes`` is the size of the full (unsharded) tensor: the all-gather output, the reduce-scatter input, or the
    all-reduce buffer. Ring algorithms send (k-1)/k of it (twice for all-reduce).
    """
    if k <= 1:
        return 0
    per = nbytes // k
    if op == "all_reduce":
        return 2 * (k - 1) * per
    if op in ("all_gather", "reduce_scatter"):
        return (k - 1) * per
    raise ValueError(f"unknown collective {op!r}")


@dataclass(frozen=True)
class TrafficRecord:
    """Accumulated traffic of one (operation, scope) pair."""

    op: str
    """Collective name, e.g. ``all_gather``."""
    scope: str
    """``intra`` or ``inter``."""
    bytes: int
    """Bytes this rank sent."""
    calls: int
    """Number of collectives."""


class TrafficMeter:
    """Thread-safe counters of bytes sent by this rank, keyed by (operation, scope)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[tuple[str, str], int] = defaultdict(int)
        self._calls: dict[tuple[str, str], int] = defaultdict(int)

    def record(self, op: str, scope: str, nbytes: int) -> None:
        with self._lock:
            self._bytes[(op, scope)] += nbytes
            self._calls[(op, scope)] += 1

    def reset(self) -> None:
        with self._lock:
            self._bytes.clear()
            self._calls.clear()

    def records(self) -> list[TrafficRecord]:
        with self._lock:
            return [TrafficRecord(op, scope, b, self._calls[(op, scope)]) for (op, scope), b in sorted(self._bytes.items())]

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._bytes)
