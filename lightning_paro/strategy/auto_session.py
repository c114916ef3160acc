"""``sharding="auto"`` over a strategy's life: the start-up plan, the re-planner during ``fit``, and the switches it
makes in place. The strategy (``strategy.py``) calls it from its hooks; the planning itself is the planner's
(``lightning_paro.planner``) and the resharding ``reshard.py``'s.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_paro.planner import AutoConfig, Plan, format_plan, plan_for_job
from lightning_paro.planner.job import JobReplanner
from lightning_paro.planner.replan import Switch


class AutoSession:
    """The plans and switches of one strategy under ``sharding="auto"``."""

    def __init__(self, config: AutoConfig) -> None:
        self.config = config
        self.plan: Optional[Plan] = None
        """The latest plan (the re-plan's once made)."""
        self.plan_seconds = 0.0
        """Seconds the start-up plan took (probes and planning)."""
        self.switches: list[Switch] = []
        """The switches made in place during fit."""
        self.replanner: Optional[JobReplanner] = None
        self.replans: list[dict[str, Any]] = []
        """Each re-plan: after which step, the strategy in use, its measured and predicted step time, the decision."""

    def plan_at_setup(self, module, optimizers: list, topology, device, accumulation: int, ranks_on_host: int,
                      units, prefetch: int, chunk_bytes: Optional[int], comm, broadcast: Callable[[Any], Any]) -> str:
        """Collective: probe, plan and return the strategy to start with (the plan's choice, or ``first_plan``)."""
        started = time.perf_counter()
        result = plan_for_job(module, optimizers, topology, device, accumulation=accumulation,
                              ranks_on_host=ranks_on_host, units=units, prefetch=prefetch, config=self.config,
                              chunk_bytes=chunk_bytes, comm=comm)
        first = self.config.first_plan
        if result.choice is None and first is None:
            raise RuntimeError(f"sharding='auto' found no strategy that fits: {result.reason}")
        name = broadcast(first or result.choice)
        self.plan = result
        self.plan_seconds = time.perf_counter() - started
        forced = f" (AutoConfig.first_plan; the plan's choice: {result.choice})" if first else ""
        rank_zero_info(f"PaRO sharding='auto' chose {name}{forced}\n{format_plan(result)}")
        return name

    def start_fit(self, current: str, device, waited: Callable[[], float], traffic: Callable[[], tuple[float, float]],
                  module, group, prefetch: int, manual: bool, steps_left: Optional[Callable[[], float]] = None) -> None:
        """At the start of fit: measure the first optimizer steps for the re-plans (not under manual optimization,
        whose steps the strategy does not see, nor with ``replan_after_steps=0``). ``steps_left``: the optimizer steps
        the fit has left after the one just made (a trial runs only if it can pay back)."""
        self.replanner = None
        if self.plan is None or not self.config.replan_after_steps or manual:
            return
        self.replanner = JobReplanner(
            self.config, self.plan, current, device, waited=waited, traffic=traffic, prefetch=prefetch, group=group,
            steps_left=steps_left,
            excluded_storages=lambda: {p.untyped_storage().data_ptr() for p in module.parameters()})

    def forward(self) -> ContextManager[None]:
        """Around a micro-step's forward."""
        return self.replanner.forward() if self.replanner is not None else contextlib.nullcontext()

    def end_backward(self) -> None:
        if self.replanner is not None:
            self.replanner.end_backward()

    def after_step(self, step: int, switch: Callable[[str], None], settle: Callable[[], None] = lambda: None) -> None:
        """After optimizer step ``step`` (collective while re-planning): feed the re-planner and, when its decision
        says so, call ``switch(strategy)`` and record the switch with its cost. ``settle`` waits for the step's own
        collectives still in flight (the parameter sync), which the step pays for either way, before the switch's
        clock starts."""
        planner = self.replanner
        if planner is None:
            return
        decision = planner.end_step()
        if decision is not None:
            self.plan = planner.plan
            self.replans.append({
                "step": step, "in_use": planner.current, "switch_to": decision.switch_to, "reason": decision.reason,
                "measured_step_seconds": planner.figures.step_seconds if planner.figures else None,
                "predicted_step_seconds": planner.plan.candidate(planner.current).prediction.step_seconds,
                "predicted_speedup": decision.predicted_speedup,
                "micro_step_seconds": planner.figures.micro_step_seconds if planner.figures else None})
            measured = "" if planner.figures is None else (
                f" measured {planner.figures.step_seconds:.4g} s per optimizer step under {planner.current},"
                f" {decision.measured_over_predicted:.2f}x the re-plan's prediction for it.")
            steps = f"{step} step{'s' if step != 1 else ''}"
            if planner.tried is not None and planner.finished:  # the trial's end: measured, the plan is unchanged
                rank_zero_info(f"PaRO sharding='auto' ended the trial of {planner.tried} after {steps}:{measured}"
                               f" {decision.reason}")
            else:
                rank_zero_info(f"PaRO sharding='auto' re-planned after {steps}:{measured} {decision.reason}\n"
                               f"{format_plan(planner.plan)}")
            if decision.switch_to is not None:
                settle()
                previous, started = planner.current, time.perf_counter()
                switch(decision.switch_to)
                seconds = time.perf_counter() - started
                planner.current = decision.switch_to
                self.switches.append(Switch(step, previous, decision.switch_to, decision.reason, seconds))
                rank_zero_info(f"PaRO sharding='auto' switched from {previous} to {decision.switch_to} after step"
                               f" {step} in {seconds:.3g} s: {decision.reason}")
        if planner.finished:
            self.replanner = None
