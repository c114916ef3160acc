"""HO-Ring's process groups: one set per topology and placement, with the phase threads that use them.

Every phase gets two groups of its own, one per direction (lower rank to higher, and back): gloo serialises the two
directions of one connection, and an exchange over a single group would use only half of a full-duplex link. Creating
groups is collective: every rank creates every group, in the same order. Every group is created with the default
process group's timeout, so a message from a peer that stopped issuing collectives fails after that timeout.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch.distributed as dist

from lightning_paro.comm.group_cache import cached_groups, default_timeout, stall_limit
from lightning_paro.comm.ho_ring.pipeline import _Phase
from lightning_paro.comm.topology import Topology


class HORingGroups:
    """The process groups and phase threads HO-Ring uses for one topology. Create with :func:`create_groups`."""

    def __init__(self, topology: Topology, rank_order: Sequence[int]) -> None:
        n, m = topology.world_size, topology.group_size
        order = tuple(int(r) for r in rank_order)
        if sorted(order) != list(range(n)):
            raise ValueError(f"rank_order must be a permutation of range({n}) (every rank once), got {list(order)}.")
        self.topology = topology
        self.rank_order = order
        """Global ranks in placement order: ``rank_order[i * m + j]`` is local index j of group i."""
        self.position = order.index(topology.rank)
        """This rank's place in the layout, ``i * m + j``."""
        self.group_index, self.local_index = divmod(self.position, m)
        g = topology.num_groups
        self.intra_peers = [order[self.group_index * m + p] for p in range(m)]
        """Global ranks of this rank's group, by local index."""
        self.rail_peers = [order[q * m + self.local_index] for q in range(g)]
        """Global ranks of this rank's rail, by group index."""

        # The default group's timeout bounds every wait on these groups (torch would give them 30 minutes).
        timeout = default_timeout()
        self.timeout = timeout.total_seconds()
        """Seconds a message may take before the backend gives up on it (the default process group's timeout)."""
        self.stall_limit = stall_limit(self.timeout)
        """Seconds without progress after which a waiter declares a collective failed."""

        def new_group(ranks: list[int]):
            return dist.new_group(ranks, timeout=timeout)

        # new_group is collective over the default group: every rank creates every group, in the same order.
        def one_group_each(members_of: Callable[[int], list[int]], count: int, mine: int) -> Callable[[], object]:
            """A creator of the ``count`` groups ``members_of(c)`` (collective) that returns the one this rank is in."""
            def create():
                chosen = None
                for c in range(count):
                    grp = new_group(members_of(c))
                    if c == mine:
                        chosen = grp
                return chosen
            return create

        def intra_of(i: int) -> list[int]:
            return [order[i * m + p] for p in range(m)]

        def rail_of(j: int) -> list[int]:
            return [order[q * m + j] for q in range(g)]

        self.world = new_group(list(range(n)))
        """A private world group for the flat all-reduce (gloo's ring)."""
        self.flat = _Phase("flat", lambda: new_group(list(range(n))))
        self.intra_scatter = self.inter_scatter = self.inter_gather = self.intra_gather = None
        if m > 1:
            self.intra_scatter = _Phase("intra-scatter", one_group_each(intra_of, g, self.group_index))
            self.intra_gather = _Phase("intra-gather", one_group_each(intra_of, g, self.group_index))
        if g > 1:
            self.inter_scatter = _Phase("inter-scatter", one_group_each(rail_of, m, self.local_index), ring=g > 2)
            self.inter_gather = _Phase("inter-gather", one_group_each(rail_of, m, self.local_index), ring=g > 2)

    @property
    def phases(self) -> list[_Phase]:
        return [p for p in (self.flat, self.intra_scatter, self.inter_scatter, self.inter_gather, self.intra_gather)
                if p is not None]

    def progress_at(self) -> float:
        """When a chunk last finished any phase (monotonic clock; 0 if none has yet)."""
        return max(p.progress_at for p in self.phases)

    def close(self) -> None:
        """Stop the phase threads (after the work already issued). The process groups live until the default group
        is destroyed."""
        for phase in self.phases:
            phase.stop()


def create_groups(topology: Topology, rank_order: Sequence[int] | None = None) -> HORingGroups:
    """Create HO-Ring's process groups for ``topology``; collective: every rank must call it, in the same order.

    ``rank_order`` lists the global ranks in placement order, ``rank_order[i * m + j]`` being the rank that plays local
    index j of group i; the default ``range(n)`` is contiguous placement (``rank = i * m + j``). Pass
    :func:`rank_order_by_node` when a launcher placed ranks on nodes another way (round-robin, for instance), so that
    groups are still the ranks that share a node.
    """
    return HORingGroups(topology, range(topology.world_size) if rank_order is None else rank_order)


def rank_order_by_node(node_id: str | int) -> list[int]:
    """Global ranks grouped by node: nodes in order of their lowest rank, ranks ascending within a node.

    Collective: every rank passes the id of the node it runs on (a hostname, ``NODE_RANK``...).
    """
    ids: list = [None] * dist.get_world_size()
    dist.all_gather_object(ids, node_id)
    first_rank: dict = {}
    for r, node in enumerate(ids):
        first_rank.setdefault(node, r)
    return sorted(range(len(ids)), key=lambda r: (first_rank[ids[r]], r))


def shared_groups(topology: Topology) -> HORingGroups:
    """The contiguous-placement groups for ``topology``, created on first use and shared by every caller in the
    process for as long as the default group lives (collective on first use, like :func:`create_groups`)."""
    key = ("ho-ring", topology.world_size, topology.group_size, topology.rank)
    return cached_groups(key, lambda: create_groups(topology))


def _groups_for(topology: Topology, groups: HORingGroups | None) -> HORingGroups:
    if groups is not None:
        if groups.topology != topology:
            raise ValueError(f"groups were created for {groups.topology}, not for {topology}.")
        return groups
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call init_process_group before HO-Ring collectives.")
    return shared_groups(topology)


def _rail_groups(groups: HORingGroups, what: str) -> HORingGroups:
    if groups.inter_scatter is None or groups.inter_gather is None:
        raise ValueError(f"rail {what} needs more than one group; with g = 1 there is no rail to run it on.")
    return groups

