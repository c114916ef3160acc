"""Sharding levels and the three-letter PaRO strategy (parameters, gradients, optimizer states)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Level(enum.IntEnum):
    """How widely one kind of model state is sharded. Ordered: N < I < G."""

    N = 0
    """Not sharded: every rank holds the whole tensor."""
    I = 1  # noqa: E741
    """Sharded inside the rank's node group (1/m each), replicated across groups."""
    G = 2
    """Sharded globally over all n ranks (1/n each)."""

    def degree(self, group_size: int, world_size: int) -> int:
        """d(level): into how many pieces this level splits a tensor (1, m or n)."""
        return (1, group_size, world_size)[self]


def _valid(p: Level, g: Level, os_: Level) -> bool:
    # A rank can only update optimizer state it holds: OS must be at least as fine as P and G.
    return os_ >= p and os_ >= g


VALID_STRATEGIES: tuple[str, ...] = tuple(
    p.name + g.name + o.name for p in Level for g in Level for o in Level if _valid(p, g, o)
)
"""The 14 valid strategies, in order of (P, G, OS)."""

KNOWN_AS: dict[str, str] = {
    "NNN": "DDP",
    "NNG": "ZeRO-1",
    "NGG": "ZeRO-2",
    "GGG": "ZeRO-3 / FSDP full shard",
    "III": "MiCS / HSDP",
}


@dataclass(frozen=True)
class ShardingSpec:
    """A PaRO strategy: the level of each of parameters (P), gradients (G) and optimizer states (OS)."""

    params: Level
    """Level of the compute parameters."""
    grads: Level
    """Level at which gradients are accumulated between optimizer steps."""
    optim: Level
    """Level of the optimizer states (and of the fp32 master weights)."""

    def __post_init__(self) -> None:
        if not _valid(self.params, self.grads, self.optim):
            raise ValueError(
                f"Invalid PaRO strategy {self.name!r}: the optimizer-state level must be at least as fine as the"
                f" parameter and gradient levels (N < I < G). Valid strategies: {', '.join(VALID_STRATEGIES)}."
            )

    @classmethod
    def parse(cls, text: str | ShardingSpec) -> ShardingSpec:
        """Parse a strategy such as ``"NIG"`` (case-insensitive)."""
        if isinstance(text, ShardingSpec):
            return text
        if not isinstance(text, str) or len(text) != 3 or any(c not in "NIGnig" for c in text):
            raise ValueError(
                f"Unknown PaRO sharding {text!r}: expected three letters from N, I, G for parameters, gradients"
                f" and optimizer states. Valid strategies: {', '.join(VALID_STRATEGIES)}."
            )
        p, g, o = (Level[c] for c in text.upper())
        return cls(p, g, o)

    @property
    def name(self) -> str:
        """The three-letter name, e.g. ``"IIG"``."""
        return self.params.name + self.grads.name + self.optim.name

    def __str__(self) -> str:
        return self.name
