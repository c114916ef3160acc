"""An alpha-beta cost model of this engine: predicted step time and per-rank memory of every PaRO strategy.

Volumes are the design's (``volumes.py``); times are alpha-beta per link class; what overlaps is what *this* engine
overlaps. Everything here is a pure function of frozen inputs, so a plan is reproducible and testable by hand. A
collective's time is its ring phases' (``phases.py``); this module puts them on the engine's timeline.

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

from lightning_paro.planner.inputs import Cluster, Compute, Workload
from lightning_paro.planner.phases import (
    gather_phases,
    grad_sync_phases,
    param_sync_phases,
    reduce_scatter_phases,
    seconds,
    seconds_and_processor_seconds,
)
from lightning_paro.strategy.levels import VALID_STRATEGIES, Level, ShardingSpec
from lightning_paro.strategy.transitions import keeps_error_feedback, param_sync_rounds
from lightning_paro.strategy.volumes import Traffic, model_state_bytes, step_traffic


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
    """Parameter bytes of one unit."""
    unit_trainable: float
    """Trainable (gradient) bytes of one unit."""
    root_params: float
    """Parameter bytes of the root unit."""
    root_trainable: float
    """Trainable (gradient) bytes of the root unit."""


def _split(w: Workload) -> _Split:
    units = w.num_units
    root = w.root_fraction if units else 1.0
    per_unit = (1.0 - root) / units if units else 0.0
    S, T = w.param_bytes * w.num_params, w.grad_bytes * w.num_trainable
    return _Split(S * per_unit, T * per_unit, S * root, T * root)


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
    largest = max(split.unit_params, split.unit_trainable, split.root_params, split.root_trainable)
    nbytes = largest or workload.param_bytes
    phases = grad_sync_phases(ShardingSpec.parse("NNN"), nbytes, cluster)
    best, best_t = choices[0], math.inf
    for chunk in choices:
        t = seconds(phases, dataclasses.replace(cluster, chunk_bytes=chunk))
        if t < best_t * (1 - 1e-9):
            best, best_t = chunk, t
    return best


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
    w = workload
    gather = gather_phases(spec.params, split.unit_params, cluster, w.comm, w.param_bytes)
    # the units' trainable parameters are spread over the units backward runs through
    unit_trainable = split.unit_trainable * L / Lb if Lb else 0.0
    reduce = reduce_scatter_phases(spec.grads, unit_trainable, cluster, w.comm, w.grad_bytes)
    a, a_cpu = seconds_and_processor_seconds(gather, cluster)
    r, r_cpu = seconds_and_processor_seconds(reduce, cluster)

    def beside(compute: float, comm: float, comm_cpu: float) -> float:
        """Compute beside collectives on the communication thread: the longer of the two, and at least the compute
        plus the part of the collectives it cannot run beside (the links' ``overlap``)."""
        return max(compute + comm_cpu, comm)

    a_root = seconds(gather_phases(spec.params, split.root_params, cluster, w.comm, w.param_bytes), cluster)
    r_root = seconds(reduce_scatter_phases(spec.grads, split.root_trainable, cluster, w.comm, w.grad_bytes), cluster)
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
        grad_sync=seconds(grad_sync_phases(spec, T, cluster, workload.comm, workload.grad_bytes), cluster),
        control=control,
        update=update_bytes / compute.memory_bandwidth,
        param_sync=seconds(param_sync_phases(spec, T, cluster, workload.comm, workload.grad_bytes), cluster),
    )


def memory(spec: ShardingSpec, workload: Workload, cluster: Cluster, prefetch: int = 1) -> Memory:
    """Predicted per-rank memory of ``spec``: model states (``volumes.model_state_bytes``) plus what is in flight at
    the peak, early in the backward, where the engine holds (derived from its schedule, checked against measured peaks
    by ``bench/train/memory.py``):

    * P != N: the root unit's gathered parameters (gathered for the whole micro-step) and ``1 + prefetch`` units'
      (the one computing and those prefetched);
    * G != N: the root unit's gradients (autograd fills them during the backward) and two units' worth: a unit's
      gradients as autograd computes them plus their flat copy for the reduction (the previous unit's reduction is
      waited for before the copy, so no more are in flight).

    The backend's staging of a collective is one HO-Ring chunk (on the CPU flat collectives go in pieces of that
    size) and is left out. Parameters sent in fewer bytes than they are stored in (``param_dtype``) where P differs
    from OS need a separate master copy in the optimizer shard, unless ``optim_bytes`` counts one already (16-bit
    parameters)."""
    m, n = cluster.group_size, cluster.world_size
    optim_bytes = workload.optim_bytes
    if rounds_param_sync(spec, workload):
        optim_bytes += workload.param_bytes
    states = model_state_bytes(spec, workload.num_params, workload.num_trainable, m, n,
                               param_bytes=workload.param_bytes, grad_bytes=workload.grad_bytes,
                               optim_bytes=optim_bytes)
    grads = states["grads"]
    if keeps_error_feedback(spec, workload.comm, cluster.num_groups):
        grads += 4 * workload.num_trainable / m  # the error feedback of the 1/m block that crosses groups
    split = _split(workload)
    in_flight = min(workload.num_units, 1 + max(0, prefetch))
    transient = 0.0
    if spec.params != Level.N:
        transient += split.root_params + in_flight * split.unit_params
    if spec.grads != Level.N:
        transient += split.root_trainable + min(workload.num_units, 2) * split.unit_trainable
    return Memory(params=states["params"], grads=grads, optim=states["optim"], transient=transient,
                  activations=workload.micro_batch_activation_bytes)


def rounds_param_sync(spec: ShardingSpec, workload: Workload) -> bool:
    """Whether the engine keeps a separate master copy because the OS -> P sync rounds the parameters
    (``FlatGroup.rounds_param_sync``): P differs from OS and parameters travel in fewer bytes than they are stored
    in, or quantized; not counted again when ``optim_bytes`` holds a master already (16-bit parameters)."""
    if workload.param_bytes < 4:
        return False
    return param_sync_rounds(spec, workload.comm, workload.master_dtype)


def traffic(spec: ShardingSpec, workload: Workload, cluster: Cluster) -> Traffic:
    """Bytes one rank sends per optimizer step (``volumes.step_traffic``; units gathered twice, the root once)."""
    split = _split(workload)
    m, g, A = cluster.group_size, cluster.num_groups, workload.accumulation
    units = step_traffic(spec, split.unit_params * workload.num_units, split.unit_trainable * workload.num_units,
                         m, g, A, gathers=2, comm=workload.comm, element_bytes=workload.param_bytes)
    root = step_traffic(spec, split.root_params, split.root_trainable, m, g, A, gathers=1, comm=workload.comm,
                        element_bytes=workload.param_bytes)
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
