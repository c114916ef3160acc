"""HO-Ring: hierarchical collectives whose intra- and inter-group phases overlap, chunk by chunk.

A global collective over n = g groups x m ranks is run as phases over cheaper groups:

* ``all_reduce``: intra reduce-scatter -> inter reduce-scatter -> inter all-gather -> intra all-gather,
* ``reduce_scatter``: intra reduce-scatter -> inter reduce-scatter,
* ``all_gather``: inter all-gather -> intra all-gather,

where "intra" is among the m ranks of a group (one node: fast links) and "inter" is among the g ranks of a rail (the
ranks with the same local index; every rail runs at the same time, each on its own slice). The buffer is cut into
chunks and the phases form a pipeline: while chunk k is on the inter links, chunk k+1 is in its intra reduce-scatter
and chunk k-1 in its intra all-gather. Each phase has its own worker thread and its own process groups, so the phases
of different chunks are in flight at the same time without racing each other or any other communicator. A phase
has one group per direction (lower rank to higher, and back): gloo serialises the two directions of one connection,
and an exchange over a single group would use only half of a full-duplex link. A phase also keeps two chunks in
flight, posting the messages of the next before waiting for those of the previous, so that a slow peer's last
messages do not leave the link idle.

All ranks must issue the same HO-Ring collectives in the same order (as with any collective). Collectives issued with
``async_op=True`` may be in flight together; each phase runs its work in issue order on every rank.

**Threads.** By default each phase runs on its own thread. In single-thread mode
(:attr:`HORingConfig.single_thread`, the default for CUDA tensors) the calling thread runs the whole pipeline itself,
in one fixed interleaving of chunks and phases, and posts each exchange step as one batch: every rank then issues the
same calls in the same order from one thread, which NCCL needs. Both modes give the same bits. Do not mix the modes
on the same groups while collectives of the other are in flight.

**Failures.** A failed send, receive or reduction fails its collective, and :meth:`HORingWork.wait` raises an error
naming the phase and the chunk. A message from a peer that stopped issuing collectives fails after the default process
group's timeout; a peer that died fails its messages at once. ``wait`` also gives up when no chunk has finished a
phase for :attr:`HORingWork.stall_limit` seconds, a margin after that timeout.

One concern a module:

* :mod:`.config`: :class:`HORingConfig`, the chunk size, flat threshold and thread mode;
* :mod:`.layout`: the PaRO buffer layout (:func:`shard_range`) and the chunk plans, pure index maths;
* :mod:`.pipeline`: the phases' threads, the order they run chunks in, and :class:`HORingWork`;
* :mod:`.groups`: :class:`HORingGroups`, the process groups and phases of one topology and placement;
* :mod:`.exchanges`: one phase's messages for one chunk, all-to-all or ring, and the stages made of them;
* :mod:`.collectives`: the public collectives, over the world and over one rail.
"""

from lightning_paro.comm.ho_ring.collectives import (
    all_gather,
    all_reduce,
    rail_all_gather,
    rail_all_reduce,
    rail_reduce_scatter,
    reduce_scatter,
)
from lightning_paro.comm.ho_ring.config import DEFAULT_CONFIG, HORingConfig
from lightning_paro.comm.ho_ring.groups import HORingGroups, create_groups, rank_order_by_node, shared_groups
from lightning_paro.comm.ho_ring.layout import layout_ranges, shard_range, split_range
from lightning_paro.comm.ho_ring.pipeline import CHUNKS_IN_FLIGHT, HORingWork

__all__ = [
    "CHUNKS_IN_FLIGHT",
    "DEFAULT_CONFIG",
    "HORingConfig",
    "HORingGroups",
    "HORingWork",
    "all_gather",
    "all_reduce",
    "create_groups",
    "layout_ranges",
    "rail_all_gather",
    "rail_all_reduce",
    "rail_reduce_scatter",
    "rank_order_by_node",
    "reduce_scatter",
    "shard_range",
    "shared_groups",
    "split_range",
]
