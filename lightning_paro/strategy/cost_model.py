"""An alpha-beta cost model of this engine: predicted step time and per-rank memory of every PaRO strategy.

Volumes are the design's (``volumes.py``); times are alpha-beta per link class; what overlaps is what *this* engine
overlaps. Everything here is a pure function of frozen inputs, so a plan is reproducible and testable by hand.

**Collectives.** Every collective is a sequence of ring phases over one link class. A ring all-gather or
reduce-scatter of a buffer of ``S`` bytes over ``k`` ranks takes ``k - 1`` steps, each sending ``S / k`` bytes::

    t = (k - 1) * (alpha + S / (k * beta))          (an all-reduce: twice that)

where ``alpha`` is the link's latency per step and ``beta`` the bandwidth one rank gets while every rank of the job
communicates at once (the figure the start-up probe measures). Intra-group collectives are the backend's own; its
reduce-scatter is multiplied by the cluster's ``reduce_scatter_factor`` (1 for ring algorithms, about 2 for gloo).
Inter-group (rail) collectives run on HO-Ring's inter phase: point to point, the ideal volume, two chunks posted, so
latency is paid about once per chunk step (one step: all-to-all between two groups; k - 1 steps: a ring over more)
and no reduce-scatter factor applies.

A global collective is an HO-Ring (``comm/ho_ring.py``): its intra and inter phases send the ideal volume point to
point to all peers at once with two chunks posted (latency hidden behind the previous chunk, no reduce-scatter factor)
and overlap chunk by chunk. With phase times ``t_i`` and ``k`` chunks of ``chunk_bytes`` of the full buffer, it is a
pipeline::

    t = max_i t_i + (sum_i t_i - max_i t_i) / k

so a large buffer costs about its slowest phase, and a buffer of one chunk the sum of its phases. A phase's transfer
time is multiplied by the cluster's ``hierarchical_factor`` (1 for NCCL-like backends; the probe measures it, as
HO-Ring's point-to-point sends can use a link better than the backend's collective does).

**Timeline of one micro-step** (the engine issues all collectives of a rank on one first-in-first-out communication
thread; compute runs on the caller's thread). The model has ``L`` units of equal size and a root unit holding the
rest; compute is spread over them in proportion to their parameters. With ``a`` the time to gather one unit's
parameters (0 when P = N), ``r`` the time to reduce-scatter one unit's gradient (0 when G = N), ``a_root`` and
``r_root`` the same for the root unit, and ``c_f``, ``c_b`` one unit's forward and backward compute::

    forward  = a + c_f + (L - 1) * beside(c_f, a)                 next unit's gather prefetched during compute
    backward = a + beside(c_b, a) + (L - 2) * beside(c_b, a + r)  gather of unit k-1 and reduce-scatter of unit k+1
               + beside(c_b, r) + r                               share the thread while unit k computes
    micro    = a_root + root compute + forward + backward + r_root

where ``beside(c, t) = max(c + t_cpu, t)`` is compute ``c`` running beside collectives of time ``t``, of which
``t_cpu`` needs the processor the compute runs on: each phase's time times ``1 - overlap`` of its link. With
engines of their own for the transfers (``overlap = 1``: NVLink, NICs) that is ``max(c, t)``; where the transfers
take the same CPU cores as the compute (``overlap = 0``: gloo over TCP between processes of one machine) the two add
up, ``c + t``. The start-up probe measures ``overlap`` per link class.

The first gather of the forward and of the backward cannot be prefetched (nothing runs before them), the root is
gathered synchronously at the start of a micro-step, and the last reduce-scatters finish before the next micro-step
can gather (the thread is first-in-first-out). Without prefetching (``prefetch=0``) every gather is exposed:
``forward = L * (a + c_f)`` and ``backward = L * (a + c_b + r)``. When only the last ``L_b`` units hold trainable
parameters (``Workload.backward_units``: a PEFT run that trains the top blocks), backward runs through those alone:
``L_b`` replaces ``L`` in ``backward``, and the backward compute and trainable bytes are spread over them.

**Once per optimizer step** nothing overlaps::

    step = A * micro + t_syncg + t_control + t_update + t_syncp

``t_syncg`` brings the gradients to the optimizer-state level, ``t_control`` is the small all-reduce of
"parameter used" flags (latency only), ``t_update`` is the optimizer reading and writing its shard from device memory,
and ``t_syncp`` brings the updated parameters back to level P. The engine issues ``t_syncp`` asynchronously, but the
first unit used in the next step is the root, whose sync is issued last on the first-in-first-out thread, so the
whole sync is waited for before the next forward starts: the model counts it as exposed.

**Memory per rank** is ``model_state_bytes`` of ``volumes.py`` (section 5 of the design), plus the buffers in flight
(the gathered root and up to ``1 + prefetch`` gathered units when P != N; the root's and two units' full gradients
while they are reduce-scattered when G != N) and the activations of one micro-batch when they are given.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

from lightning_paro.strategy.levels import VALID_STRATEGIES, Level, ShardingSpec
from lightning_paro.strategy.volumes import Traffic, model_state_bytes, step_traffic

GBIT = 1e9 / 8
"""Bytes per second in one Gbit/s."""

HO_RING_CHUNKS_IN_FLIGHT = 2
"""Chunks an HO-Ring phase keeps posted (``comm.ho_ring.CHUNKS_IN_FLIGHT``; a test keeps the two equal)."""

Scope = Literal["intra", "inter"]
Op = Literal["all_gather", "reduce_scatter", "all_reduce"]


# ------------------------------------------------------------------------------------------------------------ inputs
@dataclass(frozen=True)
class Link:
    """One link class (intra-group or inter-group) in the alpha-beta model."""

    bandwidth: float
    """Bytes per second one rank sends while every rank of the job communicates at once."""
    latency: float = 0.0
    """Seconds per step of a ring collective (alpha)."""
    overlap: float = 1.0
    """Share of a transfer's time that hides behind compute running at the same time: 1 where the transfer has
    engines of its own (NVLink copy engines, NICs), 0 where it needs the processor the compute runs on for all its
    time (TCP between processes sharing CPU cores), so compute and transfer add up. The start-up probe measures it."""

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"Link bandwidth must be > 0 bytes/s, got {self.bandwidth!r}.")
        if not self.latency >= 0:
            raise ValueError(f"Link latency must be >= 0 s, got {self.latency!r}.")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"Link overlap must be in [0, 1] (the share of a transfer hidden behind compute), got"
                             f" {self.overlap!r}.")

    @classmethod
    def gbit(cls, gbit_per_s: float, latency_us: float = 0.0, overlap: float = 1.0) -> Link:
        """A link of ``gbit_per_s`` Gbit/s per rank and ``latency_us`` microseconds per ring step."""
        return cls(gbit_per_s * GBIT, latency_us * 1e-6, overlap)


UNUSED_LINK = Link(math.inf, 0.0)
"""Stands in for a link class the topology has no collectives over (m = 1 or g = 1)."""


@dataclass(frozen=True)
class Cluster:
    """The ranks and the links between them."""

    world_size: int
    """n: ranks in the job."""
    group_size: int
    """m: ranks per group (normally the devices of one node); must divide n."""
    intra: Link
    """Links between ranks of one group (NVLink, shared memory)."""
    inter: Link
    """Links between groups (the network between nodes)."""
    device_memory: float
    """Bytes of memory one rank may use (device memory, or its share of host memory on CPU)."""
    reduce_scatter_factor: float = 1.0
    """Time of a reduce-scatter over the time of an all-gather of the same buffer: 1 for ring algorithms (NCCL);
    about 2 for gloo, whose reduce-scatter moves twice the ideal volume. The start-up probe measures it."""
    chunk_bytes: float = 2 * 2**20
    """HO-Ring pipeline chunk (the strategy's ``chunk_bytes``); ``math.inf`` runs a global collective's phases one
    after the other."""
    hierarchical_factor: float = 1.0
    """Time of an HO-Ring phase over the backend's collective moving the same bytes on the same link: 1 where both
    use the link alike (NCCL); below 1 where HO-Ring's point-to-point sends, one group per direction and two chunks
    in flight, use it better (gloo over TCP). The start-up probe measures it."""

    def __post_init__(self) -> None:
        if not self.reduce_scatter_factor > 0:
            raise ValueError(f"reduce_scatter_factor must be > 0, got {self.reduce_scatter_factor!r}.")
        if not self.chunk_bytes > 0:
            raise ValueError(f"chunk_bytes must be > 0, got {self.chunk_bytes!r}.")
        if not self.hierarchical_factor > 0:
            raise ValueError(f"hierarchical_factor must be > 0, got {self.hierarchical_factor!r}.")
        if self.world_size < 1 or self.group_size < 1 or self.world_size % self.group_size:
            raise ValueError(
                f"group_size={self.group_size} must divide world_size={self.world_size} (n = groups x ranks per group)."
            )
        if not self.device_memory > 0:
            raise ValueError(f"device_memory must be > 0 bytes, got {self.device_memory!r}.")

    @property
    def num_groups(self) -> int:
        """g = n / m."""
        return self.world_size // self.group_size


@dataclass(frozen=True)
class Workload:
    """The model and how it is trained, as far as step time and memory depend on it."""

    num_params: float
    """Psi: all parameters."""
    num_trainable: float
    """Psi': parameters with gradients and optimizer states (Psi for full training, a few percent for PEFT)."""
    accumulation: int = 1
    """A: micro-steps per optimizer step (``accumulate_grad_batches``)."""
    num_units: int = 32
    """L: units (the repeated blocks) gathered and freed one at a time; 0 puts everything in the root unit."""
    root_fraction: float = 0.04
    """Share of the parameters outside the units (embeddings, final norm, head): gathered once per micro-step."""
    tokens_per_micro_batch: float = 2048
    """Micro-batch size times sequence length: sets compute time (with a FLOP rate) and activation memory."""
    param_bytes: int = 2
    """b_p: bytes per compute parameter (2 for bf16, 4 for fp32)."""
    grad_bytes: int = 2
    """b_g: bytes per gradient element."""
    optim_bytes: int = 12
    """K: optimizer-state bytes per trainable parameter (Adam: 8, plus 4 for a separate fp32 master)."""
    activation_bytes_per_token: float = 0.0
    """Activation memory per token of the micro-batch on one rank (0: not counted; leave headroom instead)."""
    backward_units: int | None = None
    """Units the backward pass runs through (from the first one holding a trainable parameter to the last); the
    frozen units before them are neither gathered again nor computed in backward. None: all of them."""

    def __post_init__(self) -> None:
        if self.backward_units is not None and not 0 <= self.backward_units <= self.num_units:
            raise ValueError(f"backward_units must be between 0 and num_units={self.num_units}, got"
                             f" {self.backward_units!r}.")
        if not self.num_params > 0:
            raise ValueError(f"num_params must be > 0, got {self.num_params!r}.")
        if not 0 <= self.num_trainable <= self.num_params:
            raise ValueError(
                f"num_trainable must be between 0 and num_params={self.num_params}, got {self.num_trainable!r}.")
        if self.accumulation < 1:
            raise ValueError(f"accumulation must be >= 1 micro-step per optimizer step, got {self.accumulation!r}.")
        if self.num_units < 0:
            raise ValueError(f"num_units must be >= 0, got {self.num_units!r}.")
        if not 0 <= self.root_fraction <= 1 or (self.num_units == 0 and self.root_fraction != 1):
            raise ValueError(
                f"root_fraction must be in [0, 1] (and 1 when num_units is 0), got {self.root_fraction!r} with"
                f" num_units={self.num_units}."
            )
        if self.tokens_per_micro_batch < 0 or self.activation_bytes_per_token < 0:
            raise ValueError("tokens_per_micro_batch and activation_bytes_per_token must be >= 0.")

    @property
    def trainable_fraction(self) -> float:
        """Psi' / Psi."""
        return self.num_trainable / self.num_params


@dataclass(frozen=True)
class Compute:
    """How long one rank computes: measured, or from an achieved FLOP rate."""

    micro_step_seconds: float | None = None
    """Measured forward plus backward time of one micro-step on one rank (takes precedence)."""
    flops_per_second: float | None = None
    """Achieved FLOP/s of one rank; a micro-step costs (4 Psi + 2 Psi') FLOPs per token."""
    memory_bandwidth: float = 1e12
    """Device memory bytes per second, for the optimizer update."""

    def __post_init__(self) -> None:
        if self.micro_step_seconds is not None and self.micro_step_seconds < 0:
            raise ValueError(f"micro_step_seconds must be >= 0, got {self.micro_step_seconds!r}.")
        if self.flops_per_second is not None and not self.flops_per_second > 0:
            raise ValueError(f"flops_per_second must be > 0, got {self.flops_per_second!r}.")
        if not self.memory_bandwidth > 0:
            raise ValueError(f"memory_bandwidth must be > 0 bytes/s, got {self.memory_bandwidth!r}.")


# ------------------------------------------------------------------------------------------------------ collectives
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
        it; inside a global collective its transfer is scaled by the cluster's ``hierarchical_factor``."""
        link = cluster.intra if self.scope == "intra" else cluster.inter
        transfer = self.sent_bytes / link.bandwidth
        if self.point_to_point:
            # all-to-all: one step per chunk; a ring (inter phases over more than two groups): k - 1 steps
            per_chunk = (2 if self.op == "all_reduce" else 1) * (self.ranks - 1 if self.ring else 1)
            if self.hierarchical:
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


def gather_phases(level: Level, nbytes: float, cluster: Cluster) -> tuple[Phase, ...]:
    """All-gather a buffer of ``nbytes`` from level-``level`` shards (G: inter then intra)."""
    m, g = cluster.group_size, cluster.num_groups
    if level == Level.N:
        return ()
    if level == Level.I:
        return _phases(Phase("all_gather", "intra", m, nbytes))
    return _global(Phase("all_gather", "inter", g, nbytes / m), Phase("all_gather", "intra", m, nbytes))


def reduce_scatter_phases(level: Level, nbytes: float, cluster: Cluster) -> tuple[Phase, ...]:
    """Reduce-scatter a full buffer of ``nbytes`` into level-``level`` shards (G: intra then inter)."""
    m, g = cluster.group_size, cluster.num_groups
    if level == Level.N:
        return ()
    if level == Level.I:
        return _phases(Phase("reduce_scatter", "intra", m, nbytes))
    return _global(Phase("reduce_scatter", "intra", m, nbytes), Phase("reduce_scatter", "inter", g, nbytes / m))


def grad_sync_phases(spec: ShardingSpec, nbytes: float, cluster: Cluster) -> tuple[Phase, ...]:
    """Once per step: bring ``nbytes`` of accumulated gradient from level G to level OS (design, section 4)."""
    m, g = cluster.group_size, cluster.num_groups
    G, OS = spec.grads, spec.optim
    if G == Level.N and OS == Level.N:  # a global all-reduce
        return _global(Phase("reduce_scatter", "intra", m, nbytes), Phase("all_reduce", "inter", g, nbytes / m),
                       Phase("all_gather", "intra", m, nbytes))
    if G == Level.N and OS == Level.I:
        return _phases(Phase("reduce_scatter", "intra", m, nbytes), Phase("all_reduce", "inter", g, nbytes / m))
    if G == Level.N:
        return reduce_scatter_phases(Level.G, nbytes, cluster)
    if G == Level.I and OS == Level.I:
        return _phases(Phase("all_reduce", "inter", g, nbytes / m))
    if G == Level.I:
        return _phases(Phase("reduce_scatter", "inter", g, nbytes / m))
    return ()


def param_sync_phases(spec: ShardingSpec, nbytes: float, cluster: Cluster) -> tuple[Phase, ...]:
    """Once per step, after the update: bring ``nbytes`` of trainable parameters from level OS to level P."""
    P, OS = spec.params, spec.optim
    if P == OS:
        return ()
    if P == Level.N:
        return gather_phases(OS, nbytes, cluster)
    return _phases(Phase("all_gather", "inter", cluster.num_groups, nbytes / cluster.group_size))  # G -> I


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
    return _seconds_and_processor_seconds(phases, cluster)[1]


def _seconds_and_processor_seconds(phases: tuple[Phase, ...], cluster: Cluster) -> tuple[float, float]:
    """:func:`seconds` and :func:`processor_seconds` of one collective, its phases timed once."""
    t, each = _phase_seconds(phases, cluster)
    link = {"intra": cluster.intra, "inter": cluster.inter}
    return t, min(t, sum(s * (1.0 - link[p.scope].overlap) for p, s in each))


CHUNK_CHOICES = tuple(2**k * 2**20 for k in range(1, 7))
"""HO-Ring chunks :func:`fastest_chunk_bytes` picks from: 2 MiB (the engine's default) to 64 MiB."""


def fastest_chunk_bytes(workload: Workload, cluster: Cluster, choices: tuple[int, ...] = CHUNK_CHOICES) -> int:
    """The HO-Ring chunk the model predicts fastest for a global all-reduce of the largest unit (parameters or
    gradients, whichever is larger; the root unit too).

    Small chunks overlap the phases of a collective more finely; every chunk pays the phases' latency, and an inter
    phase over g groups runs as a ring of g - 1 steps per chunk. At large scale (many groups, fast links) a 2 MiB
    chunk leaves each ring step a few KiB, so latency, not bandwidth, bounds the collective; a larger chunk restores
    the bandwidth bound. Ties go to the smallest chunk (the finest overlap, the least memory in flight).
    """
    split = _split(workload)
    nbytes = max(split.unit_params, split.unit_trainable, split.root_params) or workload.param_bytes
    phases = grad_sync_phases(ShardingSpec.parse("NNN"), nbytes, cluster)
    best, best_t = choices[0], math.inf
    for chunk in choices:
        t = seconds(phases, dataclasses.replace(cluster, chunk_bytes=chunk))
        if t < best_t * (1 - 1e-9):
            best, best_t = chunk, t
    return best


# ------------------------------------------------------------------------------------------------------ predictions
@dataclass(frozen=True)
class StepTerms:
    """The terms of one optimizer step's predicted time, in seconds."""

    compute: float
    """A times the forward plus backward compute of one micro-step."""
    exposed_micro_comm: float
    """A times the per-micro-step communication not hidden behind compute."""
    grad_sync: float
    """t_syncg: gradients to the optimizer-state level."""
    control: float
    """The per-step all-reduce of "parameter used" flags (latency)."""
    update: float
    """The optimizer update of this rank's shard."""
    param_sync: float
    """t_syncp: updated parameters back to level P."""

    @property
    def total(self) -> float:
        """Predicted seconds per optimizer step."""
        return self.compute + self.exposed_micro_comm + self.grad_sync + self.control + self.update + self.param_sync


@dataclass(frozen=True)
class Memory:
    """Predicted per-rank memory, in bytes."""

    params: float
    """Compute parameters held at level P."""
    grads: float
    """Gradient accumulators at level G."""
    optim: float
    """Optimizer states (and fp32 master) at level OS."""
    transient: float
    """Gathered parameters and full gradients of the units in flight."""
    activations: float
    """Activations of one micro-batch (0 when not given)."""

    @property
    def model_states(self) -> float:
        """params + grads + optim: the design's section 5 formula."""
        return self.params + self.grads + self.optim

    @property
    def total(self) -> float:
        """Everything this model counts."""
        return self.model_states + self.transient + self.activations


@dataclass(frozen=True)
class Prediction:
    """What the model predicts for one strategy."""

    strategy: str
    """Three letters, e.g. ``"IIG"``."""
    terms: StepTerms
    """Step time, term by term."""
    memory: Memory
    """Per-rank memory."""
    traffic: Traffic = field(repr=False)
    """Bytes one rank sends per optimizer step, by link class."""
    tokens_per_step: float = 0.0
    """Tokens one rank processes per optimizer step."""

    @property
    def step_seconds(self) -> float:
        """Predicted seconds per optimizer step."""
        return self.terms.total

    @property
    def tokens_per_second(self) -> float:
        """Predicted tokens per second per rank."""
        return self.tokens_per_step / self.step_seconds if self.step_seconds > 0 else math.inf


@dataclass(frozen=True)
class _Split:
    """Bytes of the root unit and of one unit (parameters S, trainable T)."""

    unit_params: float
    unit_trainable: float
    root_params: float
    root_trainable: float


def _split(w: Workload) -> _Split:
    units = w.num_units
    root = w.root_fraction if units else 1.0
    per_unit = (1.0 - root) / units if units else 0.0
    S, T = w.param_bytes * w.num_params, w.grad_bytes * w.num_trainable
    return _Split(S * per_unit, T * per_unit, S * root, T * root)


def micro_step_compute_seconds(workload: Workload, compute: Compute) -> float:
    """Forward plus backward compute of one micro-step: measured, or (4 Psi + 2 Psi') FLOPs per token at the given
    rate (forward 2 Psi; backward 2 Psi for activation gradients and 2 Psi' for weight gradients), or 0."""
    if compute.micro_step_seconds is not None:
        return compute.micro_step_seconds
    if compute.flops_per_second is not None:
        flops = (4 * workload.num_params + 2 * workload.num_trainable) * workload.tokens_per_micro_batch
        return flops / compute.flops_per_second
    return 0.0


def micro_step_seconds(spec: ShardingSpec, workload: Workload, cluster: Cluster, compute_seconds: float,
                       prefetch: int = 1) -> float:
    """One micro-step on this engine's timeline (module docstring): compute plus the communication it cannot hide."""
    split = _split(workload)
    L = workload.num_units
    Lb = L if workload.backward_units is None else workload.backward_units
    gather = gather_phases(spec.params, split.unit_params, cluster)
    # the units' trainable parameters are spread over the units backward runs through
    unit_trainable = split.unit_trainable * L / Lb if Lb else 0.0
    reduce = reduce_scatter_phases(spec.grads, unit_trainable, cluster)
    a, a_cpu = _seconds_and_processor_seconds(gather, cluster)
    r, r_cpu = _seconds_and_processor_seconds(reduce, cluster)

    def beside(compute: float, comm: float, comm_cpu: float) -> float:
        """Compute beside collectives on the communication thread: the longer of the two, and at least the compute
        plus the part of the collectives it cannot run beside (the links' ``overlap``)."""
        return max(compute + comm_cpu, comm)

    a_root = seconds(gather_phases(spec.params, split.root_params, cluster), cluster)
    r_root = seconds(reduce_scatter_phases(spec.grads, split.root_trainable, cluster), cluster)
    root = workload.root_fraction if L else 1.0
    # Forward is 2 Psi FLOPs per token, backward 2 Psi + 2 Psi': split the compute in that ratio.
    f = workload.trainable_fraction
    forward_share = 1.0 / (2.0 + f)
    c_f = compute_seconds * (1.0 - root) * forward_share / L if L else 0.0
    c_b = compute_seconds * (1.0 - root) * (1.0 - forward_share) / Lb if Lb else 0.0
    if L == 0:
        forward = 0.0
    elif prefetch <= 0:
        forward = L * (a + c_f)
    else:
        forward = a + c_f + (L - 1) * beside(c_f, a, a_cpu)
    if Lb == 0:
        backward = 0.0
    elif prefetch <= 0:
        backward = Lb * (a + c_b + r)
    elif Lb == 1:
        backward = a + c_b + r
    else:
        backward = (a + beside(c_b, a, a_cpu) + (Lb - 2) * beside(c_b, a + r, a_cpu + r_cpu)
                    + beside(c_b, r, r_cpu) + r)
    return a_root + compute_seconds * root + forward + backward + r_root


def step_terms(spec: ShardingSpec, workload: Workload, cluster: Cluster, compute: Compute,
               prefetch: int = 1) -> StepTerms:
    """Predicted time of one optimizer step of ``spec``, term by term."""
    A = workload.accumulation
    c = micro_step_compute_seconds(workload, compute)
    micro = micro_step_seconds(spec, workload, cluster, c, prefetch)
    T = workload.grad_bytes * workload.num_trainable
    n = cluster.world_size
    slowest = cluster.inter if cluster.num_groups > 1 else cluster.intra
    control = 2 * (n - 1) * slowest.latency if n > 1 else 0.0
    shard = workload.num_trainable / spec.optim.degree(cluster.group_size, n)
    # Adam-like update: read and write every optimizer state (and master), read the gradient, write the parameter.
    update_bytes = shard * (2 * workload.optim_bytes + workload.grad_bytes + workload.param_bytes)
    return StepTerms(
        compute=A * c,
        exposed_micro_comm=A * (micro - c),
        grad_sync=seconds(grad_sync_phases(spec, T, cluster), cluster),
        control=control,
        update=update_bytes / compute.memory_bandwidth,
        param_sync=seconds(param_sync_phases(spec, T, cluster), cluster),
    )


def memory(spec: ShardingSpec, workload: Workload, cluster: Cluster, prefetch: int = 1) -> Memory:
    """Predicted per-rank memory of ``spec``: model states (``volumes.model_state_bytes``) plus what is in flight."""
    m, n = cluster.group_size, cluster.world_size
    states = model_state_bytes(spec, workload.num_params, workload.num_trainable, m, n,
                               param_bytes=workload.param_bytes, grad_bytes=workload.grad_bytes,
                               optim_bytes=workload.optim_bytes)
    split = _split(workload)
    in_flight = min(workload.num_units, 1 + max(0, prefetch))
    transient = 0.0
    if spec.params != Level.N:
        transient += split.root_params + in_flight * split.unit_params
    if spec.grads != Level.N:
        # the unit computing its gradient and the previous one still being reduce-scattered
        transient += split.root_trainable + min(workload.num_units, 2) * split.unit_trainable
    return Memory(params=states["params"], grads=states["grads"], optim=states["optim"], transient=transient,
                  activations=workload.activation_bytes_per_token * workload.tokens_per_micro_batch)


def traffic(spec: ShardingSpec, workload: Workload, cluster: Cluster) -> Traffic:
    """Bytes one rank sends per optimizer step (``volumes.step_traffic``; units gathered twice, the root once)."""
    split = _split(workload)
    m, g, A = cluster.group_size, cluster.num_groups, workload.accumulation
    units = step_traffic(spec, split.unit_params * workload.num_units, split.unit_trainable * workload.num_units,
                         m, g, A, gathers=2)
    root = step_traffic(spec, split.root_params, split.root_trainable, m, g, A, gathers=1)
    return Traffic(units.intra + root.intra, units.inter + root.inter)


def predict(spec: ShardingSpec | str, workload: Workload, cluster: Cluster, compute: Compute,
            prefetch: int = 1) -> Prediction:
    """Step time, memory and traffic of one strategy."""
    spec = ShardingSpec.parse(spec)
    return Prediction(strategy=spec.name, terms=step_terms(spec, workload, cluster, compute, prefetch),
                      memory=memory(spec, workload, cluster, prefetch), traffic=traffic(spec, workload, cluster),
                      tokens_per_step=workload.accumulation * workload.tokens_per_micro_batch)


def predict_all(workload: Workload, cluster: Cluster, compute: Compute, prefetch: int = 1,
                strategies: tuple[str, ...] = VALID_STRATEGIES) -> tuple[Prediction, ...]:
    """:func:`predict` for each strategy, in the order given."""
    return tuple(predict(s, workload, cluster, compute, prefetch) for s in strategies)
