"""Shard layout of one flat buffer (PaRO design, section 4).

A buffer of ``numel`` elements is padded to ``padded``, a multiple of n, and split into m *intra blocks*, each split
into g *sub-blocks*. Rank (i, j) holds intra block j at level I and sub-block i of intra block j at level G (global
shard index ``j * g + i``). Every level's slice contains the finer ones, so I -> G is a view and collectives act on
contiguous ranges.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_paro.comm.topology import Topology
from lightning_paro.strategy.levels import Level


@dataclass(frozen=True)
class ShardLayout:
    """Where this rank's shard of a flat buffer lies, at each level."""

    numel: int
    """Elements before padding."""
    world_size: int
    """n."""
    group_size: int
    """m."""
    group_index: int
    """i: this rank's group."""
    local_index: int
    """j: this rank's index inside its group."""

    @classmethod
    def of(cls, numel: int, topology: Topology) -> ShardLayout:
        return cls(numel, topology.world_size, topology.group_size, topology.group_index, topology.local_index)

    @property
    def padded(self) -> int:
        """Elements after padding to a multiple of n."""
        n = self.world_size
        return -(-self.numel // n) * n

    def shard_numel(self, level: Level) -> int:
        """Elements this rank holds at ``level`` (padded / d(level))."""
        return self.padded // level.degree(self.group_size, self.world_size)

    def start(self, level: Level) -> int:
        """Offset of this rank's shard at ``level`` inside the padded buffer."""
        if level == Level.N:
            return 0
        block = self.padded // self.group_size
        if level == Level.I:
            return self.local_index * block
        return self.local_index * block + self.group_index * (self.padded // self.world_size)

    def range(self, level: Level) -> tuple[int, int]:
        """``(start, stop)`` of this rank's shard at ``level``."""
        s = self.start(level)
        return s, s + self.shard_numel(level)
