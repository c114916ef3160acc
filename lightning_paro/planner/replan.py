"""Planning again with what the job measured, and deciding whether to switch strategy (pure).

The start-up plan knows the links, the memory and the optimizer update's bandwidth, but not the compute time of a
micro-step nor the activation memory: :func:`replan` plans again with them measured, and :func:`decide` says whether
the strategy in use should give way to the new choice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lightning_paro.planner.choose import Plan, plan


@dataclass(frozen=True)
class Switch:
    """A strategy switch made in place during ``fit``."""

    step: int
    """The optimizer step after which it was made (``trainer.global_step`` then)."""
    from_strategy: str
    """The strategy before."""
    to_strategy: str
    """The strategy after."""
    reason: str
    """Why (the re-plan's :class:`Decision`)."""
    seconds: float
    """How long resharding took (the switch's cost; every rank waited for it)."""


@dataclass(frozen=True)
class Decision:
    """Whether to switch strategy after a re-plan, and why."""

    switch_to: str | None
    """The strategy to switch to; None: keep the one in use."""
    reason: str
    """One sentence: the predicted gain (or why none), or that the strategy in use does not fit."""
    predicted_speedup: float
    """Predicted step time of the strategy in use over the new choice's (1: no switch); after a trial, measured."""
    measured_over_predicted: float
    """The measured step time of the strategy in use over what the re-plan predicts for it: the model's error (nan
    when no step time was measured)."""


def replan(previous: Plan, memory_budget: float, prefetch: int = 1, strategies: tuple[str, ...] | None = None,
           micro_step_seconds: float | None = None, activation_bytes: float | None = None, note: str = "") -> Plan:
    """``previous``'s plan again with a measured compute time per micro-step and activation memory per micro-batch
    (each left as it was when None), among ``strategies`` (default: the previous candidates); ``note`` is added to
    the plan's notes."""
    workload = previous.workload
    if activation_bytes is not None:
        workload = dataclasses.replace(workload, activation_bytes=activation_bytes)
    compute = previous.compute
    if micro_step_seconds is not None:
        compute = dataclasses.replace(compute, micro_step_seconds=micro_step_seconds, flops_per_second=None)
    kept = tuple(c.strategy for c in previous.candidates) if strategies is None else strategies
    result = plan(workload, previous.cluster, compute, memory_budget, prefetch, kept)
    return dataclasses.replace(result, notes=(*previous.notes, note) if note else previous.notes)


def decide(new_plan: Plan, current: str, margin: float, measured_step_seconds: float | None = None) -> Decision:
    """Switch when the strategy in use does not fit the budget, or when the new choice fits and is predicted at least
    ``margin`` faster (0.1: 10%; ``math.inf``: only when the one in use does not fit). ``measured_step_seconds``: the
    strategy in use's measured step time, compared with the plan's prediction for it."""
    now = new_plan.candidate(current)
    predicted_now = now.prediction.step_seconds
    error = (measured_step_seconds / predicted_now if measured_step_seconds is not None and predicted_now > 0
             else float("nan"))
    choice = new_plan.choice
    if not now.fits and choice is not None:
        best = new_plan.candidate(choice).prediction.step_seconds
        speedup = predicted_now / best if best > 0 else float("inf")
        return Decision(choice, f"{current} does not fit the budget with the measured activations ({now.why});"
                                f" {choice} is the fastest that does.", speedup, error)
    if choice is None or choice == current:
        why = "it is still the fastest that fits" if choice == current else new_plan.reason
        return Decision(None, f"keep {current}: {why}", 1.0, error)
    best = new_plan.candidate(choice).prediction.step_seconds
    speedup = predicted_now / best if best > 0 else float("inf")
    if speedup >= 1 + margin:
        return Decision(choice, f"{choice} is predicted {speedup:.2f}x as fast as {current} with the measured figures"
                                f" (at least {1 + margin:.2f}x asked).", speedup, error)
    return Decision(None, f"keep {current}: {choice} is predicted only {speedup:.2f}x as fast (a switch needs"
                          f" {1 + margin:.2f}x).", speedup, error)


def trial_candidate(new_plan: Plan, current: str, margin: float) -> str | None:
    """The strategy a re-plan that keeps ``current`` should try for a few steps, or None: the fastest fitting other
    strategy that differs from ``current`` in its gradient level only and is predicted at most ``margin`` slower
    (0.1: 10%; faster by less than a switch's margin counts too). Such near-ties are where the model's ranking is
    least sure (its error is larger than the gap), and only the gradient level because gradients live within a
    step: switching there and back moves no state, so the trial costs at most the few steps it runs slower."""
    if margin <= 0:
        return None
    now = new_plan.candidate(current).prediction.step_seconds
    near = [c for c in new_plan.candidates
            if c.fits and c.strategy != current and c.strategy[0] == current[0] and c.strategy[2] == current[2]
            and c.prediction.step_seconds <= now * (1 + margin)]
    return min(near, key=lambda c: c.prediction.step_seconds).strategy if near else None


def start_trial(kept: Decision, new_plan: Plan, current: str, tried: str, steps: int) -> Decision:
    """The re-plan's decision ``kept`` (no switch) turned into a switch to ``tried`` for ``steps`` steps; the reason
    reads as the trial's (it is logged with the switch, where "keep" would contradict it)."""
    speedup = new_plan.candidate(current).prediction.step_seconds / new_plan.candidate(tried).prediction.step_seconds
    why = kept.reason.removeprefix(f"keep {current}: ").rstrip(".")
    return dataclasses.replace(
        kept, switch_to=tried, predicted_speedup=speedup,
        reason=f"a trial of {tried} for {steps} steps, the faster measured kept: the re-plan keeps {current} ({why}),"
               f" and {tried} is predicted {speedup:.2f}x as fast, within the trial margin.")


def settle_trial(before: str, before_seconds: float, tried: str, tried_seconds: float,
                 predicted_seconds: float = float("nan")) -> Decision:
    """After a trial: keep ``tried`` if its measured step time is shorter than ``before``'s, else switch back.
    ``predicted_seconds``: the plan's step time for ``tried`` (for the model's error)."""
    measured = f"measured {tried_seconds:.4g} s per optimizer step under {tried}, {before_seconds:.4g} s under {before}"
    error = tried_seconds / predicted_seconds if predicted_seconds > 0 else float("nan")
    if tried_seconds < before_seconds:
        return Decision(None, f"keep {tried} after its trial: {measured}.", 1.0, error)
    speedup = tried_seconds / before_seconds if before_seconds > 0 else 1.0
    return Decision(before, f"back to {before} after the trial of {tried}: {measured}.", speedup, error)
