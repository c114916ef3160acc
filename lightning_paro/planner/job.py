"""``sharding="auto"`` for a running job: its options (:class:`AutoConfig`) and :func:`plan_for_job`, which every
rank calls at start-up.

It measures what the options leave open (the links with ``probe.py``, the memory with ``memory.py``), describes the
model (``workload.py``) and plans (``choose.py``). Every measurement is reduced over the ranks (slowest link,
smallest memory), so every rank computes the same plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

from lightning_paro.planner.choose import DEFAULT_MEMORY_BUDGET, Plan, plan
from lightning_paro.planner.cost_model import fastest_chunk_bytes
from lightning_paro.planner.inputs import Cluster, Compute, Link
from lightning_paro.planner.memory import agreed_minimum, device_memory_bytes
from lightning_paro.planner.probe import probe_links
from lightning_paro.planner.workload import workload_from_module
from lightning_paro.strategy.options import OptionError, is_count
from lightning_paro.strategy.transitions import EXACT, CommDtypes


@dataclass(frozen=True)
class AutoConfig:
    """Options of ``sharding="auto"``; every measurement can be replaced by a given figure. Validated when created:
    a value that cannot work is an :class:`~lightning_paro.strategy.options.OptionError` naming the option."""

    memory_budget: float = DEFAULT_MEMORY_BUDGET
    """Fraction of a rank's memory (<= 1) or bytes (> 1) for model states, in-flight buffers, declared activations."""
    intra: Link | None = None
    """Intra-group link (bandwidth, latency, overlap with compute); None: measure it at start-up."""
    inter: Link | None = None
    """Inter-group link (bandwidth, latency, overlap with compute); None: measure it at start-up."""
    device_memory: float | None = None
    """Bytes of memory per rank; None: read free device memory (CPU: the rank's share of available host memory)."""
    micro_step_seconds: float | None = None
    """Measured compute time of one micro-step; None: from ``flops_per_second`` if given, else none assumed."""
    flops_per_second: float | None = None
    """Achieved FLOP/s of one rank, with ``tokens_per_micro_batch``, to estimate compute time."""
    tokens_per_micro_batch: float = 0.0
    """Micro-batch size times sequence length (for the compute estimate, activations and tokens/s)."""
    activation_bytes_per_token: float = 0.0
    """Activation memory per token per rank, counted against the budget (0: rely on the budget's headroom)."""
    memory_bandwidth: float = 1e12
    """Device memory bytes/s for the optimizer update."""
    probe_bytes: int = 4 * 2**20
    """Buffer size of the bandwidth probe's large all-gathers."""
    reduce_scatter_factor: float | None = None
    """Reduce-scatter time over all-gather time; None: measured by the probe when it runs, else 1."""
    hierarchical_factor: float | None = None
    """HO-Ring phase time over the backend's collective on the same link; None: measured by the probe, else 1."""

    def __post_init__(self) -> None:
        budget = self.memory_budget
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
            raise OptionError("memory_budget", f"memory_budget must be a share of a rank's memory in (0, 1] or a"
                                               f" number of bytes above 1, got {budget!r}.")
        for name in ("intra", "inter"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), Link):
                raise OptionError(name, f"{name} must be a Link (bandwidth, latency, overlap), or None to measure it"
                                        f" at start-up; got {getattr(self, name)!r}.")
        if self.micro_step_seconds is not None and not self.micro_step_seconds >= 0:
            raise OptionError("micro_step_seconds", f"micro_step_seconds must be 0 or more, or None (not known); got"
                                                    f" {self.micro_step_seconds!r}.")
        for name in ("device_memory", "flops_per_second", "reduce_scatter_factor", "hierarchical_factor"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise OptionError(name, f"{name} must be positive, or None to measure or leave it out; got {value!r}.")
        for name in ("tokens_per_micro_batch", "activation_bytes_per_token"):
            if not getattr(self, name) >= 0:
                raise OptionError(name, f"{name} must be 0 or more, got {getattr(self, name)!r}.")
        if not self.memory_bandwidth > 0:
            raise OptionError("memory_bandwidth", f"memory_bandwidth must be positive bytes/s, got"
                                                  f" {self.memory_bandwidth!r}.")
        if not is_count(self.probe_bytes, 1):
            raise OptionError("probe_bytes", f"probe_bytes must be a positive number of bytes, got {self.probe_bytes!r}.")


def plan_for_job(module, optimizers: Iterable, topology, device, accumulation: int, ranks_on_host: int,
                 units="auto", prefetch: int = 1, config: AutoConfig = AutoConfig(),
                 chunk_bytes: int | None = None, comm: CommDtypes = EXACT) -> Plan:
    """Plan for a running job (collective: call on every rank after the process groups exist).

    Measures what ``config`` leaves open (links: :func:`probe_links`; memory: :func:`device_memory_bytes`, the
    smallest over ranks), describes the model with :func:`workload_from_module` and returns :func:`plan`'s result,
    the same on every rank. ``chunk_bytes`` is the strategy's HO-Ring chunk; None plans with the chunk the cost model
    predicts fastest for these links (:func:`~lightning_paro.planner.cost_model.fastest_chunk_bytes`), which the
    strategy then uses: ``plan.cluster.chunk_bytes``. ``comm``: the dtypes the strategy sends parameters and
    gradients in (its ``param_dtype`` and ``reduce_dtype``); the plan counts their bytes, and never picks them itself.
    """
    import torch

    from lightning_paro.comm.collectives import HOR_EXACT_SCOPES

    device = torch.device(device)
    optimizers = list(optimizers)
    probe_chunk = chunk_bytes or HOR_EXACT_SCOPES.chunk_bytes
    links = None
    if config.intra is None or config.inter is None:
        links = probe_links(topology, device, large_bytes=config.probe_bytes, chunk_bytes=probe_chunk)
    intra = config.intra or links.intra
    inter = config.inter or links.inter
    factor = config.reduce_scatter_factor or (links.reduce_scatter_factor if links else 1.0)
    ho_factor = config.hierarchical_factor or (links.hierarchical_factor if links else 1.0)
    memory = config.device_memory
    if memory is None:
        reduce_on = device if device.type == "cuda" else None
        memory = agreed_minimum(device_memory_bytes(device, ranks_on_host), topology.groups.world, reduce_on)
    workload = workload_from_module(module, optimizers, units, accumulation, config.tokens_per_micro_batch,
                                    config.activation_bytes_per_token, comm)
    cluster = Cluster(topology.world_size, topology.group_size, intra, inter, memory, factor,
                      chunk_bytes=probe_chunk, hierarchical_factor=ho_factor)
    if chunk_bytes is None:  # the links are known now: size the chunk to them (the same on every rank)
        cluster = dataclasses.replace(cluster, chunk_bytes=fastest_chunk_bytes(workload, cluster))
    compute = Compute(config.micro_step_seconds, config.flops_per_second if config.tokens_per_micro_batch else None,
                      config.memory_bandwidth)
    result = plan(workload, cluster, compute, config.memory_budget, prefetch)
    if config.micro_step_seconds is None and compute.flops_per_second is None:
        result = dataclasses.replace(
            result, reason=result.reason + " No compute time was given, so the ranking assumes no communication"
            " hides behind compute (set micro_step_seconds, or flops_per_second with tokens_per_micro_batch).")
    return result
