"""``sharding="auto"``: measure the links and the memory, run the cost model, pick the fastest strategy that fits.

:func:`plan` is pure: inputs in, a candidate table and a choice out. :func:`plan_for_job` is what a running job calls
on every rank (collectively): it probes the intra- and inter-group links with a few timed all-gathers, reads the
device memory, describes the model from its module and optimizers, and calls :func:`plan`. Every measurement is
reduced over the ranks (slowest link, smallest memory), so every rank computes the same plan.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from lightning_paro.strategy.cost_model import (
    UNUSED_LINK,
    Cluster,
    Compute,
    Link,
    Prediction,
    Workload,
    fastest_chunk_bytes,
    gather_phases,
    predict_all,
    seconds,
)
from lightning_paro.strategy.levels import KNOWN_AS, VALID_STRATEGIES, Level

DEFAULT_MEMORY_BUDGET = 0.7
"""Share of a rank's memory the model states, in-flight buffers and declared activations may use. The rest is
headroom for undeclared activations, the allocator's cache and the framework."""

GB = 1e9

OVERLAP_WINDOW_S = 0.25
"""The probe times a link's overlap with compute over at least this long (at most 64 large all-gathers)."""

OVERLAP_REPEATS = 3
"""Timings of a link's overlap with compute; the probe takes their median (one varies by tens of percent on a
machine whose processors the ranks share)."""


# ---------------------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Candidate:
    """One row of the candidate table."""

    prediction: Prediction
    """The cost model's step time, memory and traffic for this strategy."""
    fits: bool
    """Whether its predicted memory is within the budget."""
    why: str
    """Why it was or was not chosen, in a few words."""

    @property
    def strategy(self) -> str:
        """Three letters, e.g. ``"IIG"``."""
        return self.prediction.strategy


@dataclass(frozen=True)
class Plan:
    """The candidate table (fastest first) and the choice."""

    candidates: tuple[Candidate, ...]
    """Every strategy considered, by predicted step time (ties: less memory first, then the canonical order)."""
    choice: str | None
    """The fastest strategy that fits, or None when none fits."""
    budget_bytes: float
    """Per-rank bytes the plan allowed for model states, in-flight buffers and activations."""
    reason: str
    """One sentence: what was chosen and why (or what to change when nothing fits)."""
    workload: Workload
    """The model and training set-up the plan is for."""
    cluster: Cluster
    """The ranks, links and memory the plan is for."""

    def candidate(self, strategy: str) -> Candidate:
        """The row of ``strategy``."""
        for c in self.candidates:
            if c.strategy == strategy.upper():
                return c
        raise KeyError(f"{strategy!r} is not among the candidates ({', '.join(c.strategy for c in self.candidates)}).")


def memory_budget_bytes(memory_budget: float, device_memory: float) -> float:
    """Bytes the plan may use: ``memory_budget`` is a fraction of ``device_memory`` when at most 1, else bytes."""
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)) or not memory_budget > 0:
        raise ValueError(
            f"memory_budget must be a fraction of device memory in (0, 1] or a number of bytes above 1, got"
            f" {memory_budget!r}."
        )
    return memory_budget * device_memory if memory_budget <= 1 else float(memory_budget)


def plan(workload: Workload, cluster: Cluster, compute: Compute, memory_budget: float = DEFAULT_MEMORY_BUDGET,
         prefetch: int = 1, strategies: Sequence[str] = VALID_STRATEGIES) -> Plan:
    """Predict every strategy and choose the fastest whose memory fits ``memory_budget``.

    Args:
        workload, cluster, compute: the cost model's inputs.
        memory_budget: a fraction of ``cluster.device_memory`` (<= 1) or bytes (> 1) for model states, in-flight
            buffers and the activations declared in ``workload``.
        prefetch: the strategy's ``prefetch`` option (units gathered ahead).
        strategies: the strategies to consider (default: all 14).
    """
    budget = memory_budget_bytes(memory_budget, cluster.device_memory)
    preds = predict_all(workload, cluster, compute, prefetch, tuple(s.upper() for s in strategies))
    order = {s: i for i, s in enumerate(VALID_STRATEGIES)}
    preds = tuple(sorted(preds, key=lambda p: (p.step_seconds, p.memory.total, order[p.strategy])))
    fitting = [p for p in preds if p.memory.total <= budget]
    choice = fitting[0] if fitting else None
    rows = []
    for p in preds:
        need = f"{format_bytes(p.memory.total)} of {format_bytes(budget)}"
        if p.memory.total > budget:
            why = f"does not fit: needs {need}"
        elif p is choice:
            why = f"chosen: fastest that fits ({need})"
        else:
            slower = p.step_seconds / choice.step_seconds - 1 if choice.step_seconds > 0 else 0.0
            why = f"fits ({need}), {100 * slower:.1f}% slower"
        rows.append(Candidate(p, p.memory.total <= budget, why))
    if choice is None:
        smallest = min(preds, key=lambda p: p.memory.total)
        reason = (
            f"No strategy fits the budget of {format_bytes(budget)} per rank: the smallest, {smallest.strategy}, needs"
            f" {format_bytes(smallest.memory.total)}. Raise memory_budget, use more ranks, a smaller micro-batch, or"
            " activation checkpointing."
        )
    else:
        fastest = preds[0]
        reason = f"{choice.strategy}: the fastest strategy that fits ({choice.step_seconds:.4g} s per optimizer step"
        if fastest is not choice:
            reason += (f"; the fastest overall, {fastest.strategy} at {fastest.step_seconds:.4g} s, needs"
                       f" {format_bytes(fastest.memory.total)} of the {format_bytes(budget)} budget")
        reason += ")."
    return Plan(tuple(rows), choice.strategy if choice else None, budget, reason, workload, cluster)


def format_bytes(nbytes: float) -> str:
    """Bytes in decimal units with three significant digits, e.g. ``"13.5 GB"``, ``"612 kB"``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def format_plan(result: Plan, markdown: bool = False) -> str:
    """The candidate table and the choice, as aligned text or as a markdown table."""
    head = ["strategy", "known as", "step s", "tokens/s/rank", "exposed comm s", "intra/step", "inter/step",
            "model states", "in flight", "total", "fits", "why"]
    body = []
    for c in result.candidates:
        p = c.prediction
        exposed = p.terms.total - p.terms.compute - p.terms.update
        body.append([p.strategy, KNOWN_AS.get(p.strategy, ""), f"{p.step_seconds:.4g}",
                     f"{p.tokens_per_second:,.0f}" if p.tokens_per_step else "-", f"{exposed:.4g}",
                     format_bytes(p.traffic.intra), format_bytes(p.traffic.inter),
                     format_bytes(p.memory.model_states), format_bytes(p.memory.transient + p.memory.activations),
                     format_bytes(p.memory.total), "yes" if c.fits else "no", c.why])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in body]
    else:
        widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [head, *body]]
    w, c = result.workload, result.cluster
    header = (f"Psi {w.num_params:.4g} (trainable {w.num_trainable:.4g}), A={w.accumulation}, {w.num_units} units,"
              f" {describe_cluster(c)}; budget {format_bytes(result.budget_bytes)} of"
              f" {format_bytes(c.device_memory)} per rank")
    return header + "\n\n" + "\n".join(lines) + f"\n\nchoice: {result.choice or 'none'}. {result.reason}"


# ------------------------------------------------------------------------------------------------ measurements
@dataclass(frozen=True)
class MeasuredLinks:
    """Links as measured by :func:`probe_links` (the same on every rank)."""

    intra: Link
    """Intra-group links (``UNUSED_LINK`` when m = 1), with the measured ``overlap``."""
    inter: Link
    """Inter-group links (``UNUSED_LINK`` when g = 1), with the measured ``overlap``."""
    reduce_scatter_factor: float = 1.0
    """A large intra-group reduce-scatter's time over the same all-gather's (the backend's collectives; rail ones are
    HO-Ring's); 1 when nothing was measured."""
    hierarchical_factor: float = 1.0
    """A global (HO-Ring) all-gather's time over what the two links predict for it; 1 when not measured (m = 1 or
    g = 1)."""


def overlap_from_times(compute: float, comm: float, both: float) -> float:
    """The share of ``comm`` that hid behind ``compute`` when both ran at once (``both`` seconds), in [0, 1].

    1: ``both`` took as long as the longer of the two (the transfer needs none of the processor the compute runs on);
    0: as long as their sum or longer (it needed it all the time, or the two slowed each other down further).
    """
    shorter = min(compute, comm)
    if shorter <= 0:
        return 1.0
    return min(1.0, max(0.0, (compute + comm - both) / shorter))


def fit_link(ranks: int, small_bytes: float, small_seconds: float, large_bytes: float, large_seconds: float) -> Link:
    """Alpha and beta from the times of two ring all-gathers over ``ranks`` ranks (full buffer sizes in bytes).

    ``t = (k - 1) alpha + (k - 1) / k * S / beta``: the bandwidth from the difference, the latency from the rest
    of the small one. If noise makes the large gather no slower than the small one, the large one alone gives the
    bandwidth and the latency is taken as 0.
    """
    k = ranks
    share = (k - 1) / k
    if large_seconds > small_seconds and large_bytes > small_bytes:
        bandwidth = share * (large_bytes - small_bytes) / (large_seconds - small_seconds)
        latency = max(0.0, small_seconds - share * small_bytes / bandwidth) / (k - 1)
        return Link(bandwidth, latency)
    return Link(share * large_bytes / max(large_seconds, 1e-9), 0.0)


@dataclass(frozen=True)
class _MatmulLoop:
    """The probe's stand-in for compute: ``count`` square matmuls; calling it runs them and returns the seconds."""

    x: Any
    y: Any
    count: int

    def __call__(self) -> float:
        import torch

        _synchronize(self.x.device)
        started = time.perf_counter()
        for _ in range(self.count):
            torch.mm(self.x, self.x, out=self.y)
        _synchronize(self.x.device)
        return time.perf_counter() - started


def _matmuls(device, seconds_wanted: float, group) -> _MatmulLoop:
    """A compute loop of square matmuls that takes about ``seconds_wanted`` while every rank of ``group`` runs it at
    once, the slowest rank's time counting; the same loop on every rank (collective: call on every rank of ``group``).

    Sized together, not on one rank alone: ranks that share processors (CPU processes on one machine) each compute
    slower together than alone, and an overlap timed against compute much longer than the transfers it hides reads
    mostly noise.
    """
    import torch
    import torch.distributed as dist

    size = 1024 if device.type == "cuda" else 192
    x = torch.randn(size, size, device=device)
    loop = _MatmulLoop(x, torch.empty_like(x), 1)
    loop()  # warm-up
    one = max(dataclasses.replace(loop, count=4)() / 4, 1e-7)
    # one count for every rank: the largest first guess, then scaled by how long it took with all of them at once
    figure = torch.tensor([float(max(1, round(seconds_wanted / one)))], dtype=torch.float64, device=device)
    dist.all_reduce(figure, op=dist.ReduceOp.MAX, group=group)
    loop = dataclasses.replace(loop, count=int(figure.item()))
    dist.barrier(group=group)
    figure = torch.tensor([loop()], dtype=torch.float64, device=device)
    dist.all_reduce(figure, op=dist.ReduceOp.MAX, group=group)
    return dataclasses.replace(loop, count=max(1, round(loop.count * seconds_wanted / max(figure.item(), 1e-9))))


def probe_links(topology, device=None, large_bytes: int = 4 * 2**20, small_bytes: int = 4 * 2**10,
                repeats: int = 3, chunk_bytes: int | None = None, global_bytes: int | None = None) -> MeasuredLinks:
    """Measure intra- and inter-group links with a few all-gathers (collective: call on every rank).

    All groups (and all rails) gather at the same time, as in training, so the figures are what one rank gets while
    every rank communicates. Each size is gathered once to warm up, then ``repeats`` times; a rank's time is the
    mean, and the slowest rank's time counts. A link's ``overlap`` is the median of ``OVERLAP_REPEATS`` readings of
    :func:`overlap_from_times`, each from three timings over ``OVERLAP_WINDOW_S`` or more, every rank at once: a run
    of large all-gathers issued on the engine's communication thread, matmuls sized to last as long while every rank
    computes, and the two together. With several
    groups of several ranks, one more all-gather of ``global_bytes`` (default: 4 x ``large_bytes``, enough chunks for
    the pipeline to fill) over the whole world runs as the engine runs it (an HO-Ring with ``chunk_bytes`` chunks),
    and its time over the links' prediction is the ``hierarchical_factor``. The probe's traffic goes to a meter of its
    own.
    """
    import torch
    import torch.distributed as dist

    from lightning_paro.comm.accounting import TrafficMeter
    from lightning_paro.comm.collectives import HOR_EXACT_SCOPES, Communicator

    device = torch.device(device) if device is not None else torch.device("cpu")
    world = topology.groups.world
    scopes = [("intra", topology.group_size), ("inter", topology.num_groups)]
    hierarchical = topology.group_size > 1 and topology.num_groups > 1
    global_elems = max(1, (global_bytes or 4 * large_bytes) // (4 * topology.world_size)) * topology.world_size
    ho_ring = HOR_EXACT_SCOPES if chunk_bytes is None else dataclasses.replace(HOR_EXACT_SCOPES,
                                                                              chunk_bytes=chunk_bytes)
    comm = Communicator(topology, TrafficMeter(), ho_ring_config=ho_ring)

    def timed(run) -> float:
        run()  # warm-up: connections, allocations
        _synchronize(device)
        dist.barrier(group=world)
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        _synchronize(device)
        return (time.perf_counter() - start) / repeats

    def beside(compute, count: int) -> float:
        """Seconds until ``count`` all-gathers issued on the communication thread (none: 0) and ``compute`` (None:
        nothing) are all done, every rank starting at once."""
        _synchronize(device)
        dist.barrier(group=world)
        start = time.perf_counter()
        handles = [comm.all_gather(out, shard, scope, async_op=True) for _ in range(count)]
        if compute is not None:
            compute()
        for handle in handles:
            handle.wait()
        _synchronize(device)
        return time.perf_counter() - start

    per_scope = 3 + 3 * OVERLAP_REPEATS
    times = []  # per scope: small all-gather, large all-gather, large reduce-scatter, then per overlap reading:
    #             gathers alone, compute alone, the two together (per gather)
    try:
        for scope, k in scopes:
            if k == 1:
                times += [0.0] * per_scope
                continue
            for nbytes in (small_bytes, large_bytes):
                elems = max(1, nbytes // (4 * k)) * k
                out = torch.empty(elems, dtype=torch.float32, device=device)
                shard = torch.ones(elems // k, dtype=torch.float32, device=device)
                times.append(timed(lambda: comm.all_gather(out, shard, scope)))
            times.append(timed(lambda: comm.reduce_scatter(shard, out, scope)))
            # overlap: enough large gathers (the same number on every rank) to fill OVERLAP_WINDOW_S
            slowest_gather = torch.tensor([times[-2]], dtype=torch.float64, device=device)
            dist.all_reduce(slowest_gather, op=dist.ReduceOp.MAX, group=world)
            count = min(64, math.ceil(OVERLAP_WINDOW_S / max(slowest_gather.item(), 1e-9)))
            # as long as the gathers while every rank computes (the same loop on every rank)
            compute = _matmuls(device, count * slowest_gather.item(), group=world)
            for _ in range(OVERLAP_REPEATS):
                times += [beside(None, count) / count, beside(compute, 0) / count, beside(compute, count) / count]
        if hierarchical:
            out = torch.empty(global_elems, dtype=torch.float32, device=device)
            shard = torch.ones(global_elems // topology.world_size, dtype=torch.float32, device=device)
            times.append(timed(lambda: comm.all_gather(out, shard, "global")))
    finally:
        comm.close()
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=world)
    t = slowest.tolist()
    links, factors = [], []
    for i, (scope, k) in enumerate(scopes):
        if k == 1:
            links.append(UNUSED_LINK)
            continue
        elems_small, elems_large = (max(1, b // (4 * k)) * k for b in (small_bytes, large_bytes))
        small, large, reduce, *readings = t[per_scope * i:per_scope * (i + 1)]
        overlap = statistics.median(overlap_from_times(compute, gathers, both)
                                    for gathers, compute, both in zip(*[iter(readings)] * 3))
        links.append(dataclasses.replace(fit_link(k, 4 * elems_small, small, 4 * elems_large, large), overlap=overlap))
        if scope == "intra":  # the backend's collective; rail ones are point to point at the ideal volume
            factors.append(reduce / large if large > 0 else 1.0)
    factor = 1.0
    if hierarchical:
        measured = t[per_scope * len(scopes)]  # after the timings of each scope
        cluster = Cluster(topology.world_size, topology.group_size, links[0], links[1], 1.0,
                          chunk_bytes=ho_ring.chunk_bytes)
        predicted = seconds(gather_phases(Level.G, 4 * global_elems, cluster), cluster)
        if predicted > 0 and measured > 0:
            factor = min(4.0, max(0.25, measured / predicted))  # clamped: a noisy probe must not dominate the plan
    return MeasuredLinks(intra=links[0], inter=links[1], reduce_scatter_factor=max(factors, default=1.0),
                         hierarchical_factor=factor)


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def available_host_memory(meminfo: Path = Path("/proc/meminfo")) -> int:
    """``MemAvailable`` of this machine in bytes (memory the kernel can hand out without swapping)."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{meminfo} has no MemAvailable line: pass device_memory to the plan explicitly.")


def device_memory_bytes(device, ranks_on_host: int = 1) -> int:
    """Memory one rank may use: free CUDA memory of its device, or its share of the host's available memory on CPU
    (``ranks_on_host`` processes of the job share one machine's memory)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        return available_host_memory() // max(1, ranks_on_host)
    raise ValueError(f"Cannot read the memory of a {device.type!r} device: pass device_memory to the plan explicitly.")


def agreed_minimum(value: float, group=None, device=None) -> float:
    """The smallest ``value`` over the ranks of ``group`` (collective), so every rank plans with the same figure."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return float(t.item())


# ------------------------------------------------------------------------------------------------ the job's model
_STATES_PER_PARAM = {
    "Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adadelta": 2, "Rprop": 2, "ASGD": 2,
    "Adagrad": 1, "SparseAdam": 2,
}


def optimizer_states_per_param(optimizer) -> float:
    """How many parameter-sized state tensors ``optimizer`` keeps (Adam: 2, SGD with momentum: 1, plain SGD: 0);
    unknown optimizers count as 2."""
    name = type(optimizer).__name__
    if name in _STATES_PER_PARAM:
        return _STATES_PER_PARAM[name]
    groups = getattr(optimizer, "param_groups", [{}])
    if name == "SGD":
        return 1 if any(g.get("momentum", 0) for g in groups) else 0
    if name == "RMSprop":
        return 1 + any(g.get("momentum", 0) for g in groups) + any(g.get("centered", False) for g in groups)
    return 2


def workload_from_module(module, optimizers: Iterable = (), units="auto", accumulation: int = 1,
                         tokens_per_micro_batch: float = 0.0, activation_bytes_per_token: float = 0.0) -> Workload:
    """Describe ``module`` as the engine will shard it: parameters, trainable ones (requiring grad and in an
    optimizer), units (the same detection as the engine), element sizes, and optimizer bytes per trainable parameter
    (the engine keeps optimizer states in fp32 and a separate fp32 master when parameters are 16-bit)."""
    from lightning_paro.strategy.units import find_units

    params = {id(p): p for p in module.parameters()}
    if not params:
        raise ValueError("The module has no parameters: there is nothing to shard or plan.")
    in_optimizer = {id(p) for o in optimizers for g in o.param_groups for p in g["params"]}
    trainable = [p for pid, p in params.items() if p.requires_grad and pid in in_optimizer]
    num_params = sum(p.numel() for p in params.values())
    num_trainable = sum(p.numel() for p in trainable)
    unit_modules = find_units(module, units)
    owners: dict[int, int] = {}
    for _name, mod in unit_modules:
        for p in mod.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    # a parameter shared by several units lives in the root unit, like in the engine
    in_units = sum(params[pid].numel() for pid, count in owners.items() if count == 1 and pid in params)
    # Backward runs from the last unit down to the first one holding a trainable parameter. A trainable parameter
    # outside the units that is registered before them (an embedding, a tied head) may be used before all of them, so
    # then backward is taken to reach every unit; one registered after them (a final norm, a head) is not.
    trainable_ids = {id(p) for p in trainable}
    unit_owned = {pid for pid, count in owners.items() if count == 1}
    order = {id(p): k for k, p in enumerate(module.parameters())}
    first_unit_param = min((order[pid] for pid in unit_owned if pid in order), default=len(order))
    if any(order[pid] < first_unit_param for pid in trainable_ids - unit_owned):
        backward_units = len(unit_modules)
    else:
        first = next((k for k, (_name, mod) in enumerate(unit_modules)
                      if any(id(p) in trainable_ids for p in mod.parameters())), len(unit_modules))
        backward_units = len(unit_modules) - first
    param_bytes = round(sum(p.numel() * p.element_size() for p in params.values()) / num_params)
    master_bytes = 4 if param_bytes < 4 else 0
    if num_trainable:
        states = sum(optimizer_states_per_param(o) * sum(p.numel() for g in o.param_groups for p in g["params"])
                     for o in optimizers) / max(1, sum(p.numel() for o in optimizers for g in o.param_groups
                                                        for p in g["params"]))
    else:
        states = 0.0
    return Workload(
        num_params=num_params, num_trainable=num_trainable, accumulation=accumulation,
        num_units=len(unit_modules), root_fraction=1 - in_units / num_params if unit_modules else 1.0,
        tokens_per_micro_batch=tokens_per_micro_batch, param_bytes=param_bytes, grad_bytes=param_bytes,
        optim_bytes=round(master_bytes + 4 * states), activation_bytes_per_token=activation_bytes_per_token,
        backward_units=backward_units,
    )


@dataclass(frozen=True)
class AutoConfig:
    """Options of ``sharding="auto"``; every measurement can be replaced by a given figure."""

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


def plan_for_job(module, optimizers: Iterable, topology, device, accumulation: int, ranks_on_host: int,
                 units="auto", prefetch: int = 1, config: AutoConfig = AutoConfig(),
                 chunk_bytes: int | None = None) -> Plan:
    """Plan for a running job (collective: call on every rank after the process groups exist).

    Measures what ``config`` leaves open (links: :func:`probe_links`; memory: :func:`device_memory_bytes`, the
    smallest over ranks), describes the model with :func:`workload_from_module` and returns :func:`plan`'s result,
    the same on every rank. ``chunk_bytes`` is the strategy's HO-Ring chunk; None plans with the chunk the cost model
    predicts fastest for these links (:func:`~lightning_paro.strategy.cost_model.fastest_chunk_bytes`), which the
    strategy then uses: ``plan.cluster.chunk_bytes``.
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
                                    config.activation_bytes_per_token)
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


def describe_links(intra: Link, inter: Link) -> str:
    """One line for the log: measured or configured link figures."""
    def one(link: Link) -> str:
        if math.isinf(link.bandwidth):
            return "unused"
        hidden = "" if link.overlap == 1 else f", {link.overlap:.0%} hidden behind compute"
        return f"{link.bandwidth * 8 / 1e9:.3g} Gbit/s, {link.latency * 1e6:.3g} us per step{hidden}"
    return f"intra {one(intra)}; inter {one(inter)}"


def describe_cluster(cluster: Cluster) -> str:
    """One line for the log: ranks, links, the reduce-scatter factor, the HO-Ring factor and chunk."""
    return (f"n={cluster.world_size} ranks in groups of m={cluster.group_size}; "
            f"{describe_links(cluster.intra, cluster.inter)}; reduce-scatter {cluster.reduce_scatter_factor:.2f}x"
            f" an all-gather; HO-Ring phases {cluster.hierarchical_factor:.2f}x the backend's time, chunks of"
            f" {cluster.chunk_bytes / 2**20:.4g} MiB")
