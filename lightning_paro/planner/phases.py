"""Collectives as ring phases over one link class, and their alpha-beta time.

Every collective is a sequence of ring phases over one link class. A ring all-gather or
reduce-scatter of a buffer of ``S`` bytes over ``k`` ranks takes ``k - 1`` steps, each sending ``S / k`` bytes::

    t = (k - 1) * (alpha + S / (k * beta))          (an all-reduce: twice that)

where ``alpha`` is the link's latency per step and ``beta`` the bandwidth one rank gets while every rank of the job
communicates at once (the figure the start-up probe measures). Intra-group collectives are the backend's own; its
reduce-scatter is multiplied by the cluster's ``reduce_scatter_factor`` (1 for ring algorithms, about 2 for gloo).
Inter-group (rail) collectives run on HO-Ring's inter phase: point to point, the ideal volume, two chunks posted, so
latency is paid about once per chunk step (one step: all-to-all between two groups; k - 1 steps: a ring over more)
and no reduce-scatter factor applies.

A global collective is an HO-Ring (``comm/ho_ring/``): its intra and inter phases send the ideal volume point to
point to all peers at once with two chunks posted (latency hidden behind the previous chunk, no reduce-scatter factor)
and overlap chunk by chunk. With phase times ``t_i`` and ``k`` chunks of ``chunk_bytes`` of the full buffer, it is a
pipeline::

    t = max_i t_i + (sum_i t_i - max_i t_i) / k

so a large buffer costs about its slowest phase, and a buffer of one chunk the sum of its phases. The transfer time
of every point-to-point phase (a global collective's, and every rail one) is multiplied by the cluster's
``hierarchical_factor``: the probe times a global all-gather of several times the size it gathers each link class
with, and its time over the links' prediction corrects what the links' smaller gathers misread (1 for NCCL-like
backends; below 1 where HO-Ring's sends use a link better than the backend's collective does). Rail collectives take
it too: both are HO-Ring's exchanges over the same inter link, and on the emulated cluster a rail all-reduce's
measured time over its prediction followed the global gather's (0.95 and 0.75 with factors of 0.92 and 0.74).

A buffer is given in bytes of its own elements (``element_bytes`` each); a collective that travels in another dtype
(``param_dtype``, ``reduce_dtype``: the transition table's :class:`~lightning_paro.strategy.transitions.CommDtypes`)
moves the bytes of that dtype, a hop between groups quantized (``inter_quant``) its payloads
(``transitions.phase_wire_bytes``); a global collective quantized so runs its phases one after the other, not as an
HO-Ring pipeline.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from lightning_paro.planner.inputs import Cluster
from lightning_paro.strategy.levels import Level, ShardingSpec
from lightning_paro.strategy.transitions import (
    EXACT,
    CommDtypes,
    Transition,
    gather_params,
    grads_to_optim,
    link_phases,
    optim_to_params,
    phase_wire_bytes,
    reduce_grads,
)

HO_RING_CHUNKS_IN_FLIGHT = 2
"""Chunks an HO-Ring phase keeps posted (``comm.ho_ring.CHUNKS_IN_FLIGHT``; a test keeps the two equal)."""

Scope = Literal["intra", "inter"]
Op = Literal["all_gather", "reduce_scatter", "all_reduce"]


@dataclass(frozen=True)
class Phase:
    """One ring collective over one link class."""

    op: Op
    """Which collective."""
    scope: Scope
    """The link class it crosses."""
    ranks: int
    """k: ranks in the ring."""
    nbytes: float
    """Bytes of the full buffer (all-gather output, reduce-scatter input, all-reduce buffer)."""
    hierarchical: bool = False
    """A phase of a global (HO-Ring) collective: the ideal volume point to point, overlapped with its other phases."""

    @property
    def point_to_point(self) -> bool:
        """Sent by HO-Ring's exchanges (every phase of a global collective, and every inter phase): the ideal volume to
        all peers at once, chunks in flight."""
        return self.hierarchical or self.scope == "inter"

    @property
    def ring(self) -> bool:
        """HO-Ring runs inter phases over more than two groups as a ring (one stream each way per rank)."""
        return self.point_to_point and self.scope == "inter" and self.ranks > 2

    @property
    def steps(self) -> int:
        """Ring steps: k - 1, twice that for an all-reduce."""
        return (self.ranks - 1) * (2 if self.op == "all_reduce" else 1)

    @property
    def sent_bytes(self) -> float:
        """Bytes one rank sends: (k - 1) / k of the buffer, twice that for an all-reduce."""
        return self.steps * self.nbytes / self.ranks

    def seconds(self, cluster: Cluster, chunks: int = 1) -> float:
        """Alpha-beta time: latency per step + sent bytes / beta, the backend's reduce-scatter times the cluster's
        factor. A point-to-point phase sends to all its peers at once (one step per chunk, two for an all-reduce) and
        keeps ``HO_RING_CHUNKS_IN_FLIGHT`` chunks posted, so latency is paid once unless chunks are too small to cover
        it, and its transfer is scaled by the cluster's ``hierarchical_factor``."""
        link = cluster.intra if self.scope == "intra" else cluster.inter
        transfer = self.sent_bytes / link.bandwidth
        if self.point_to_point:
            # all-to-all: one step per chunk; a ring (inter phases over more than two groups): k - 1 steps
            per_chunk = (2 if self.op == "all_reduce" else 1) * (self.ranks - 1 if self.ring else 1)
            transfer *= cluster.hierarchical_factor
            return per_chunk * link.latency + max(transfer, chunks * per_chunk * link.latency / HO_RING_CHUNKS_IN_FLIGHT)
        t = self.steps * link.latency + transfer
        return t * cluster.reduce_scatter_factor if self.op == "reduce_scatter" else t


def _phases(*candidates: Phase) -> tuple[Phase, ...]:
    return tuple(p for p in candidates if p.ranks > 1 and p.nbytes > 0)


def _global(*candidates: Phase) -> tuple[Phase, ...]:
    """The phases of one global collective: an HO-Ring when it has phases on both link classes (m > 1 and g > 1),
    else the backend's own collective over the one link class there is."""
    phases = _phases(*candidates)
    return tuple(dataclasses.replace(p, hierarchical=True) for p in phases) if len(phases) > 1 else phases


def transition_phases(transition: Transition, nbytes: float, cluster: Cluster,
                      element_bytes: int = 4) -> tuple[Phase, ...]:
    """The phases of a level transition (``lightning_paro.strategy.transitions``) on a buffer of ``nbytes`` (elements
    of ``element_bytes``): each collective split into its link phases, in the dtype it travels in, a global one
    pipelined as an HO-Ring."""
    m, g = cluster.group_size, cluster.num_groups
    out: list[Phase] = []
    for c in transition:
        phases = [Phase(p.op, p.link, k, phase_wire_bytes(c, p, nbytes, element_bytes, k))
                  for p in link_phases(c, m, g) for k in [m if p.link == "intra" else g]]
        # a global collective quantized between groups runs its phases one after the other
        out += _global(*phases) if c.scope == "global" and c.quant is None else _phases(*phases)
    return tuple(out)


def gather_phases(level: Level, nbytes: float, cluster: Cluster, comm: CommDtypes = EXACT,
                  element_bytes: int = 4) -> tuple[Phase, ...]:
    """All-gather a buffer of ``nbytes`` from level-``level`` shards (G: inter then intra)."""
    return transition_phases(gather_params(level, comm), nbytes, cluster, element_bytes)


def reduce_scatter_phases(level: Level, nbytes: float, cluster: Cluster, comm: CommDtypes = EXACT,
                          element_bytes: int = 4) -> tuple[Phase, ...]:
    """Reduce-scatter a full buffer of ``nbytes`` into level-``level`` shards (G: intra then inter)."""
    return transition_phases(reduce_grads(level, comm), nbytes, cluster, element_bytes)


def grad_sync_phases(spec: ShardingSpec, nbytes: float, cluster: Cluster, comm: CommDtypes = EXACT,
                     element_bytes: int = 4) -> tuple[Phase, ...]:
    """Once per step: bring ``nbytes`` of accumulated gradient from level G to level OS (design, section 4)."""
    return transition_phases(grads_to_optim(spec.grads, spec.optim, comm), nbytes, cluster, element_bytes)


def param_sync_phases(spec: ShardingSpec, nbytes: float, cluster: Cluster, comm: CommDtypes = EXACT,
                      element_bytes: int = 4) -> tuple[Phase, ...]:
    """Once per step, after the update: bring ``nbytes`` of trainable parameters from level OS to level P."""
    return transition_phases(optim_to_params(spec.optim, spec.params, comm), nbytes, cluster, element_bytes)


def _phase_seconds(phases: tuple[Phase, ...], cluster: Cluster) -> tuple[float, list[tuple[Phase, float]]]:
    """A collective's time (phases one after another, or an HO-Ring's pipelined chunk by chunk) and each phase's."""
    ho = [p for p in phases if p.hierarchical]
    each = [(p, p.seconds(cluster, max(1, math.ceil(p.nbytes / cluster.chunk_bytes)))) for p in phases
            if not p.hierarchical]
    t = sum(s for _, s in each)
    if ho:
        chunks = max(1, math.ceil(max(p.nbytes for p in ho) / cluster.chunk_bytes))
        times = [p.seconds(cluster, chunks) for p in ho]
        t += max(times) + (sum(times) - max(times)) / chunks
        each += list(zip(ho, times))
    return t, each


def seconds(phases: tuple[Phase, ...], cluster: Cluster) -> float:
    """Time of one collective's phases: one after another, or pipelined chunk by chunk when they are an HO-Ring's
    (module docstring)."""
    return _phase_seconds(phases, cluster)[0]


def processor_seconds(phases: tuple[Phase, ...], cluster: Cluster) -> float:
    """The part of a collective's time that compute running beside it cannot use: each phase's time times one minus
    its link's ``overlap``, at most the collective's time (0 on links with engines of their own)."""
    return seconds_and_processor_seconds(phases, cluster)[1]


def seconds_and_processor_seconds(phases: tuple[Phase, ...], cluster: Cluster) -> tuple[float, float]:
    """:func:`seconds` and :func:`processor_seconds` of one collective, its phases timed once."""
    t, each = _phase_seconds(phases, cluster)
    link = {"intra": cluster.intra, "inter": cluster.inter}
    return t, min(t, sum(s * (1.0 - link[p.scope].overlap) for p, s in each))
