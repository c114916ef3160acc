"""``sharding="auto"`` for a running job: its options (:class:`AutoConfig`), :func:`plan_for_job`, which every rank
calls at start-up, and :class:`JobReplanner`, which measures the first optimizer steps and plans again.

At start-up it measures what the options leave open (the links with ``probe.py``, the memory with ``memory.py``, the
optimizer update with ``measure.py``), describes the model (``workload.py``) and plans (``choose.py``); after the
first steps it plans again with their measured compute time and activation memory (``replan.py``). Every
measurement is reduced over the ranks (slowest link, smallest memory, ...), so every rank computes the same plan.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Iterable, TypeVar

from lightning_paro.planner.choose import DEFAULT_MEMORY_BUDGET, Plan, plan
from lightning_paro.planner.cost_model import fastest_chunk_bytes
from lightning_paro.planner.inputs import Cluster, Compute, Link
from lightning_paro.planner.link_cache import links_for_job, store_update
from lightning_paro.planner.measure import JobFigures, StepRecorder, agree, probe_update_bandwidth, update_key
from lightning_paro.planner.memory import agreed_maximum, agreed_minimum, device_memory_bytes
from lightning_paro.planner.replan import Decision, decide, replan, settle_trial, start_trial, trial_candidate
from lightning_paro.planner.report import describe_links
from lightning_paro.planner.sizes import format_bytes
from lightning_paro.planner.workload import workload_from_module
from lightning_paro.strategy.levels import VALID_STRATEGIES
from lightning_paro.options_base import OptionError, is_count
from lightning_paro.strategy.transitions import EXACT, CommDtypes

T = TypeVar("T")


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
    memory_bandwidth: float | None = None
    """Bytes/s of the optimizer update in the cost model's terms; None: time the job's optimizer class at start-up
    (or reuse the figure an earlier job kept with links from the link cache)."""
    probe_bytes: int = 4 * 2**20
    """Buffer size of the bandwidth probe's large all-gathers."""
    link_cache: bool = True
    """Reuse the links (and update bandwidth) an earlier job measured on the same hosts and groups once the probe's
    large all-gather per link class, timed again, confirms them (``planner/link_cache.py``); False: measure every
    time."""
    reduce_scatter_factor: float | None = None
    """Reduce-scatter time over all-gather time; None: measured by the probe when it runs, else 1."""
    hierarchical_factor: float | None = None
    """HO-Ring phase time over the backend's collective on the same link; None: measured by the probe, else 1."""
    replan_after_steps: int = 4
    """Optimizer steps of ``fit`` after which to plan again with the measured compute time and activation memory
    (the first step is not measured) and switch strategy in place if worth it; 0: plan once, at start-up."""
    replan_margin: float = 0.1
    """A re-plan switches to a strategy predicted at least this much faster (0.1: 10%), or when the one in use no
    longer fits."""
    trial_margin: float = 0.1
    """A re-plan that keeps the strategy in use tries the fastest one predicted at most this much slower (0.1: 10%)
    that differs in the gradient level only, for ``replan_after_steps`` steps, and keeps the faster measured (only
    when the fit goes on at least as many steps after the trial); 0: no trial."""
    first_plan: str | None = None
    """Start with this strategy (e.g. "NNN") instead of the start-up plan's choice; the re-plan then judges it."""
    strategies: tuple[str, ...] | None = None
    """The strategies to choose among; None: all 14."""
    deterministic: bool | None = None
    """Reproducible auto: plan once from the start-up probe and never switch strategy on measured timings (no re-plan
    on the steps' times, no trial; a strategy that does not fit the first step's activations is still replaced).
    None: follow ``Trainer(deterministic=True)`` (torch's deterministic-algorithms setting when fit starts)."""

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
        if self.memory_bandwidth is not None and not self.memory_bandwidth > 0:
            raise OptionError("memory_bandwidth", f"memory_bandwidth must be positive bytes/s, or None to time the"
                                                  f" optimizer at start-up; got {self.memory_bandwidth!r}.")
        if not (is_count(self.replan_after_steps, 2) or self.replan_after_steps == 0):
            raise OptionError("replan_after_steps", f"replan_after_steps must be 0 (plan once) or at least 2 (the"
                                                    f" first step is not measured); got {self.replan_after_steps!r}.")
        if isinstance(self.replan_margin, bool) or not self.replan_margin >= 0:
            raise OptionError("replan_margin", f"replan_margin must be 0 or more (0.1: switch for a predicted 10%"
                                               f" gain), got {self.replan_margin!r}.")
        if isinstance(self.trial_margin, bool) or not self.trial_margin >= 0:
            raise OptionError("trial_margin", f"trial_margin must be 0 (no trial) or more (0.1: try a strategy"
                                              f" predicted at most 10% slower), got {self.trial_margin!r}.")
        if self.strategies is not None:
            object.__setattr__(self, "strategies", tuple(_strategy_name(s, "strategies") for s in self.strategies))
            if not self.strategies:
                raise OptionError("strategies", "strategies must name at least one strategy, or be None for all 14.")
        if self.first_plan is not None:
            object.__setattr__(self, "first_plan", _strategy_name(self.first_plan, "first_plan"))
            if self.strategies is not None and self.first_plan not in self.strategies:
                raise OptionError("first_plan", f"first_plan {self.first_plan} is not among strategies"
                                                f" ({', '.join(self.strategies)}): the re-plan compares it with them;"
                                                " add it to strategies.")
        if not isinstance(self.link_cache, bool):
            raise OptionError("link_cache", f"link_cache must be True (reuse links measured earlier once checked) or"
                                            f" False (probe every time), got {self.link_cache!r}.")
        if self.deterministic is not None and not isinstance(self.deterministic, bool):
            raise OptionError("deterministic", f"deterministic must be True (no switch on measured timings), False"
                                               f" or None (follow Trainer(deterministic=...)), got"
                                               f" {self.deterministic!r}.")
        if not is_count(self.probe_bytes, 1):
            raise OptionError("probe_bytes", f"probe_bytes must be a positive number of bytes, got {self.probe_bytes!r}.")

    def reproducible(self) -> bool:
        """Whether this fit plans reproducibly (:attr:`deterministic`, or, when None, ``Trainer(deterministic=True)``,
        which turns on torch's deterministic algorithms)."""
        if self.deterministic is not None:
            return self.deterministic
        import torch

        return torch.are_deterministic_algorithms_enabled()


def _strategy_name(name, option: str) -> str:
    if not isinstance(name, str) or name.upper() not in VALID_STRATEGIES:
        raise OptionError(option, f"{option}: {name!r} is not a PaRO strategy; use one of"
                                  f" {', '.join(VALID_STRATEGIES)}.")
    return name.upper()


def plan_for_job(module, optimizers: Iterable, topology, device, accumulation: int, ranks_on_host: int,
                 units="auto", prefetch: int = 1, config: AutoConfig = AutoConfig(),
                 chunk_bytes: int | None = None, comm: CommDtypes = EXACT) -> Plan:
    """Plan for a running job (collective: call on every rank after the process groups exist).

    Measures what ``config`` leaves open (links: :func:`probe_links`, or the figures an earlier job stored once the
    probe's large gathers timed again confirm them, :func:`~lightning_paro.planner.link_cache.links_for_job`; the
    update bandwidth: :func:`probe_update_bandwidth`, or the figure kept with those links; memory:
    :func:`device_memory_bytes`, the smallest over ranks), describes the model with :func:`workload_from_module` and returns :func:`plan`'s result,
    the same on every rank. ``chunk_bytes`` is the strategy's HO-Ring chunk; None plans with the chunk the cost model
    predicts fastest for these links (:func:`~lightning_paro.planner.cost_model.fastest_chunk_bytes`), which the
    strategy then uses: ``plan.cluster.chunk_bytes``. ``comm``: the dtypes the strategy sends parameters and
    gradients in (its ``param_dtype`` and ``reduce_dtype``); the plan counts their bytes, and never picks them itself.
    """
    import torch

    from lightning_paro.comm.collectives import HOR_EXACT_SCOPES

    device = torch.device(device)
    optimizers = list(optimizers)
    notes: list[str] = []
    probe_chunk = chunk_bytes or HOR_EXACT_SCOPES.chunk_bytes
    links = None
    if config.intra is None or config.inter is None:
        found = links_for_job(topology, device, config.probe_bytes, probe_chunk, use_cache=config.link_cache)
        links = found.links
    intra = config.intra or links.intra
    inter = config.inter or links.inter
    notes.append(f"{'links given' if links is None else found.note}: {describe_links(intra, inter)}")
    factor = config.reduce_scatter_factor or (links.reduce_scatter_factor if links else 1.0)
    ho_factor = config.hierarchical_factor or (links.hierarchical_factor if links else 1.0)
    memory = config.device_memory
    reduce_on = device if device.type == "cuda" else None
    if memory is None:
        memory = agreed_minimum(device_memory_bytes(device, ranks_on_host), topology.groups.world, reduce_on)
        notes.append(f"memory {format_bytes(memory)} per rank, read from the "
                     f"{'device' if device.type == 'cuda' else 'host, shared by its ranks'} (smallest rank)")
    else:
        notes.append(f"memory {format_bytes(memory)} per rank, given")
    workload = workload_from_module(module, optimizers, units, accumulation, config.tokens_per_micro_batch,
                                    config.activation_bytes_per_token, comm)
    cluster = Cluster(topology.world_size, topology.group_size, intra, inter, memory, factor,
                      chunk_bytes=probe_chunk, hierarchical_factor=ho_factor)
    if chunk_bytes is None:  # the links are known now: size the chunk to them (the same on every rank)
        cluster = dataclasses.replace(cluster, chunk_bytes=fastest_chunk_bytes(workload, cluster))
    bandwidth = config.memory_bandwidth
    if bandwidth is None:
        optimizer = optimizers[0] if optimizers else None
        key = update_key(optimizer, workload)
        bandwidth = found.updates.get(key) if links is not None else None  # rank 0's record: the same on every rank
        if bandwidth is not None:
            notes.append(f"update {bandwidth / 1e9:.3g} GB/s ({key}), timed by an earlier job and kept with the links")
        else:
            probe = probe_update_bandwidth(optimizer, workload, device)
            bandwidth = agreed_minimum(probe.bandwidth, topology.groups.world, reduce_on)
            notes.append(f"{probe.describe()} on this rank; planned with the slowest rank's"
                         f" {bandwidth / 1e9:.3g} GB/s")
            if links is not None:
                store_update(found, key, bandwidth)
    else:
        notes.append(f"update {bandwidth / 1e9:.3g} GB/s, given")
    compute = Compute(config.micro_step_seconds, config.flops_per_second if config.tokens_per_micro_batch else None,
                      bandwidth)
    if config.micro_step_seconds is not None:
        notes.append(f"compute {config.micro_step_seconds * 1e3:.4g} ms per micro-step, given")
    elif compute.flops_per_second is not None:
        notes.append(f"compute from {compute.flops_per_second:.3g} FLOP/s given")
    else:
        notes.append("compute per micro-step not known yet: none assumed (no communication hidden behind it)"
                     + (f" until the re-plan after {config.replan_after_steps} steps" if config.replan_after_steps
                        else ""))
    if workload.micro_batch_activation_bytes:
        notes.append(f"activations {format_bytes(workload.micro_batch_activation_bytes)} per micro-batch, declared")
    else:
        notes.append("activations not known yet: left to the budget's headroom"
                     + (" until the re-plan" if config.replan_after_steps else ""))
    result = plan(workload, cluster, compute, config.memory_budget, prefetch,
                  config.strategies or VALID_STRATEGIES)
    return dataclasses.replace(result, notes=tuple(notes))


class JobReplanner:
    """``sharding="auto"`` during ``fit``: measures the first optimizer steps and plans again with what they measured
    (every rank the same). The strategy calls :meth:`forward`, :meth:`end_backward` and :meth:`end_step`; a switch
    :meth:`end_step` decides on is the strategy's to carry out, which then sets :attr:`current`.

    Two re-plans: after the first step, with the activation memory its micro-steps saved, switching only if the
    strategy in use does not fit with them (the start-up plan counts no activations unless they are declared); and
    after ``replan_after_steps`` steps, with the compute time of the steps after the first as well, switching when
    the new choice is ``replan_margin`` faster. When that re-plan keeps the strategy in use but another, differing in
    the gradient level only, is predicted within ``trial_margin`` of it (:func:`~.replan.trial_candidate`), and the
    fit goes on for at least ``replan_after_steps`` steps after a trial of as many, it switches to that one for
    ``replan_after_steps`` steps, measured the same way, and then keeps whichever step time measured shorter
    (:func:`~.replan.settle_trial`). A figure the user gave is kept instead of the measured one.

    Args:
        config: the options (``replan_after_steps``, ``replan_margin``, ``trial_margin``, ``strategies``, given
            figures).
        start_plan: the plan made at start-up.
        current: the strategy in use.
        device: the compute device.
        waited: seconds spent waiting for collectives so far (the communicator's counter).
        traffic: bytes sent so far, ``(intra, inter)``.
        excluded_storages: storages that hold parameters, not activations.
        group: the process group of every rank (the measurements are agreed over it).
        prefetch: the strategy's ``prefetch``.
        steps_left: optimizer steps the fit has left after the one just made (each rank's own count: the first
            rank's decides); None: not known, as many as needed.
        reproducible: no re-plan on measured timings (:meth:`AutoConfig.reproducible`): after the first step's
            activation check, which replaces the strategy in use only when it does not fit, the replanner is done.
    """

    def __init__(self, config: AutoConfig, start_plan: Plan, current: str, device, waited, traffic,
                 excluded_storages, group=None, prefetch: int = 1,
                 steps_left: Callable[[], float] | None = None, reproducible: bool = False) -> None:
        import torch

        self.config = config
        self.plan = start_plan
        """The latest plan."""
        self.current = current
        """The strategy in use."""
        self.figures: JobFigures | None = None
        """What the timed steps measured (agreed over the ranks), once measured."""
        self.finished = False
        """Whether the last re-plan was made."""
        self._group = group
        self._prefetch = prefetch
        self._device = torch.device(device)
        self._fit_checked = False
        self._given_activations = start_plan.workload.micro_batch_activation_bytes > 0
        self._given_compute = config.micro_step_seconds is not None or start_plan.compute.flops_per_second is not None
        self._steps_left = steps_left
        self._reproducible = reproducible
        self.tried: str | None = None
        """The strategy tried after the re-plan, if one was."""
        self._trial: tuple[str, float] | None = None
        """While a trial runs: the strategy it left and that strategy's measured step time."""
        self._recorder = lambda: StepRecorder(config.replan_after_steps - 1, self._device, waited, traffic,
                                              excluded_storages)
        self.recorder = self._recorder()

    def forward(self):
        """Context around a micro-step's forward."""
        return self.recorder.forward()

    def end_backward(self) -> None:
        self.recorder.end_backward()

    def end_step(self) -> Decision | None:
        """After an optimizer step (collective after the first step and after the last measured one, a trial's too):
        the decision of a re-plan or trial this step completes, else None.

        Every decision is the first rank's, broadcast (:meth:`_first_rank_says`): a switch is collective, and what
        leads to it may differ between ranks (the steps a rank's own dataloader has left decide a trial; a rank's
        arithmetic on the agreed figures could round otherwise), so ranks that decided on their own could part ways
        and hang in the switch."""
        if self.finished:
            return None
        self.recorder.end_step()
        reduce_on = self._device if self._device.type == "cuda" else None
        if not self._fit_checked:
            self._fit_checked = True
            if not self._given_activations:
                activations = agreed_maximum(self.recorder.activation_bytes, self._group, reduce_on)
                checked = replan(self.plan, self.config.memory_budget, self._prefetch, self.config.strategies,
                                 activation_bytes=activations,
                                 note=f"activations {format_bytes(activations)} per micro-batch, measured on the first"
                                      " step")
                fit = None if checked.candidate(self.current).fits else decide(checked, self.current, math.inf)
                checked, fit = self._first_rank_says((checked, fit))
                if fit is not None:
                    self.plan = checked
                    self.finished = self._reproducible
                    return fit
            if self._reproducible:  # no re-plan on measured timings
                self.finished = True
                return None
        if not self.recorder.done:
            return None
        figures = agree(self.recorder.figures(), self._group, reduce_on)
        if self._trial is not None:  # the trial's steps are measured: keep the faster
            before, before_seconds = self._trial
            self.figures, settled = self._first_rank_says((figures, settle_trial(
                before, before_seconds, self.current, figures.step_seconds,
                self.plan.candidate(self.current).prediction.step_seconds)))
            self.finished = True
            return settled
        new_plan = replan(self.plan, self.config.memory_budget, self._prefetch, self.config.strategies,
                          micro_step_seconds=None if self._given_compute else figures.micro_step_seconds,
                          activation_bytes=None if self._given_activations else figures.activation_bytes,
                          note=f"re-planned with {figures.describe()}")
        decision = decide(new_plan, self.current, self.config.replan_margin, figures.step_seconds)
        steps = self.config.replan_after_steps
        tried = None if decision.switch_to is not None else trial_candidate(
            new_plan, self.current, self.config.trial_margin)
        if tried is not None and self._steps_left is not None and self._steps_left() < 2 * steps:
            tried = None  # too few steps left for the trial and as many again after it: it could not pay back
        self.figures, self.plan, decision, tried = self._first_rank_says((figures, new_plan, decision, tried))
        if tried is None:
            self.finished = True
            return decision
        self._trial, self.tried = (self.current, self.figures.step_seconds), tried
        self.recorder = self._recorder()
        return start_trial(decision, self.plan, self.current, tried, steps)

    def decline(self) -> None:
        """The switch the last decision asked for was not made (its peak does not fit the ranks' memory): no
        trial runs, the strategy in use stays, and no re-plan follows."""
        self.finished = True
        self.tried, self._trial = None, None

    def _first_rank_says(self, outcome: T) -> T:
        """Collective: ``outcome`` as the group's first rank computed it, on every rank."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return outcome
        holder = [outcome]
        src = dist.get_global_rank(self._group, 0) if self._group is not None else 0
        dist.broadcast_object_list(holder, src=src, group=self._group,
                                   device=self._device if self._device.type == "cuda" else None)
        return holder[0]
