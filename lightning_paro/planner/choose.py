"""Choosing a strategy: predict every candidate, keep those whose memory fits the budget, take the fastest.

Pure: a :class:`Workload`, a :class:`Cluster` and a :class:`Compute` in, a :class:`Plan` (the candidate table and
the choice) out. Nothing here measures, reads the machine or talks to other ranks (``job.py`` does that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from lightning_paro.planner.cost_model import Prediction, predict_all
from lightning_paro.planner.inputs import Cluster, Compute, Workload
from lightning_paro.planner.sizes import format_bytes
from lightning_paro.strategy.levels import VALID_STRATEGIES

DEFAULT_MEMORY_BUDGET = 0.7
"""Share of a rank's memory the model states, in-flight buffers and declared activations may use. The rest is
headroom for undeclared activations, the allocator's cache and the framework."""

GB = 1e9
"""Bytes in one (decimal) gigabyte."""


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
    compute: Compute = Compute()
    """The compute time and update bandwidth the plan is for."""
    notes: tuple[str, ...] = ()
    """Where each figure came from (measured, given, or left out), in the order they were taken."""

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
    return Plan(tuple(rows), choice.strategy if choice else None, budget, reason, workload, cluster, compute)
