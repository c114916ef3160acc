"""Where each rank sits: n ranks = g groups x m ranks per group, and the process groups over them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from lightning_paro.comm.group_cache import cached_groups, default_timeout


@dataclass(frozen=True)
class Topology:
    """The PaRO rank layout. Rank ``r = i * m + j`` is local index ``j`` of group ``i`` (contiguous placement).

    Process groups are created lazily, the first time :attr:`groups` is read, collectively on every rank, and shared
    by every Topology of the same layout in the process (see :mod:`lightning_paro.comm.group_cache`).
    """

    world_size: int
    """n: total number of ranks."""
    group_size: int
    """m: ranks per group (normally the processes of one node)."""
    rank: int
    """This process's global rank."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}.")
        if self.group_size < 1 or self.world_size % self.group_size != 0:
            raise ValueError(
                f"group_size={self.group_size} does not divide the world size {self.world_size}: every group must have"
                f" the same number of ranks. Pick a divisor of {self.world_size}, e.g. the processes per node"
                f" ({', '.join(str(d) for d in _divisors(self.world_size))})."
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside the world of size {self.world_size}.")

    @classmethod
    def from_process_group(cls, group_size: int | None = None) -> Topology:
        """Build from the initialised default process group. ``group_size`` defaults to the whole world."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call init_process_group first.")
        n = dist.get_world_size()
        return cls(world_size=n, group_size=group_size or n, rank=dist.get_rank())

    @property
    def num_groups(self) -> int:
        """g: number of groups."""
        return self.world_size // self.group_size

    @property
    def group_index(self) -> int:
        """i: which group this rank belongs to."""
        return self.rank // self.group_size

    @property
    def local_index(self) -> int:
        """j: this rank's position inside its group (and the rail it is on)."""
        return self.rank % self.group_size

    def intra_ranks(self, i: int | None = None) -> list[int]:
        """Global ranks of group ``i`` (default: this rank's group)."""
        i = self.group_index if i is None else i
        return list(range(i * self.group_size, (i + 1) * self.group_size))

    def rail_ranks(self, j: int | None = None) -> list[int]:
        """Global ranks with local index ``j`` (default: this rank's rail), one per group."""
        j = self.local_index if j is None else j
        return list(range(j, self.world_size, self.group_size))

    @property
    def groups(self) -> ProcessGroups:
        """This rank's process groups; created collectively on first access for this layout, then reused."""
        return cached_groups(("topology", self.world_size, self.group_size, self.rank),
                             lambda: ProcessGroups.create(self))


@dataclass(frozen=True)
class ProcessGroups:
    """The communicators one rank uses. Separate groups let intra and inter phases run concurrently."""

    world: Any
    """A private copy of the world group (so the engine never races user collectives on the default group)."""
    intra: Any
    """The m ranks of this rank's group (None when m == 1)."""
    rail: Any
    """The g ranks on this rank's rail (None when g == 1)."""

    @classmethod
    def create(cls, topo: Topology) -> ProcessGroups:
        # new_group is collective over the default group: every rank creates every group in the same order.
        timeout = default_timeout()
        world = dist.new_group(list(range(topo.world_size)), timeout=timeout)
        intra = rail = None
        for i in range(topo.num_groups):
            g = dist.new_group(topo.intra_ranks(i), timeout=timeout) if topo.group_size > 1 else None
            if i == topo.group_index:
                intra = g
        for j in range(topo.group_size):
            g = dist.new_group(topo.rail_ranks(j), timeout=timeout) if topo.num_groups > 1 else None
            if j == topo.local_index:
                rail = g
        return cls(world=world, intra=intra, rail=rail)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
