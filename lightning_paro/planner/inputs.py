"""The cost model's inputs: the links, the cluster, the workload and the compute, as frozen dataclasses.

Each validates itself on construction, so every function of the planner can take them as given. The start-up probe
(``probe.py``) measures a :class:`Link`; ``workload.py`` describes a running job's model as a :class:`Workload`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lightning_paro.strategy.transitions import EXACT, CommDtypes

GBIT = 1e9 / 8
"""Bytes per second in one Gbit/s."""


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
    """Time of a point-to-point (HO-Ring) phase, global or rail, over what the links predict for it: 1 where the
    links' figures hold for HO-Ring's sends (NCCL); below 1 where those sends, one group per direction and two chunks
    in flight, use a link better than the backend's collective does (gloo over TCP). The start-up probe measures it
    on a global all-gather larger than the links' own timings."""

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
    activation_bytes: float | None = None
    """Activation memory of one micro-batch on one rank, measured in the job; None: ``activation_bytes_per_token``
    times ``tokens_per_micro_batch``."""
    backward_units: int | None = None
    """Units the backward pass runs through (from the first one holding a trainable parameter to the last); the
    frozen units before them are neither gathered again nor computed in backward. None: all of them."""
    comm: CommDtypes = EXACT
    """The dtypes parameters and gradients travel in (``PaROStrategy(param_dtype=..., reduce_dtype=...)``); the
    default sends each in its own (``param_bytes``, ``grad_bytes``)."""

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype the engine keeps the optimizer's shards (the master weights) in: fp64 for fp64 parameters, fp32
        for any narrower ones."""
        return torch.float64 if self.param_bytes >= 8 else torch.float32

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
        if self.activation_bytes is not None and not self.activation_bytes >= 0:
            raise ValueError(f"activation_bytes must be >= 0 or None, got {self.activation_bytes!r}.")

    @property
    def trainable_fraction(self) -> float:
        """Psi' / Psi."""
        return self.num_trainable / self.num_params

    @property
    def micro_batch_activation_bytes(self) -> float:
        """Activation memory of one micro-batch on one rank: measured, else per token times tokens."""
        if self.activation_bytes is not None:
            return self.activation_bytes
        return self.activation_bytes_per_token * self.tokens_per_micro_batch


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
