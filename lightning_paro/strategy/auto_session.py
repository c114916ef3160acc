"""``sharding="auto"`` over a strategy's life: the start-up plan, the re-planner during ``fit``, the switches it
makes in place, and the run's record of them (:data:`RECORD_FILE`). The strategy (``strategy.py``) calls it from its
hooks; the planning itself is the planner's (``lightning_paro.planner``) and the resharding ``reshard.py``'s.

Every decision that leads to a collective is rank 0's, taken by every rank: the start-up plan is broadcast whole, and
the re-planner broadcasts each decision it makes (``JobReplanner.end_step``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

from lightning_paro.planner import AutoConfig, Plan, format_bytes, format_plan, plan_for_job
from lightning_paro.planner.job import JobReplanner
from lightning_paro.planner.memory import agreed_maximum
from lightning_paro.planner.replan import Switch
from lightning_paro.planner.report import plan_record
from lightning_paro.strategy.engine import PaROEngine
from lightning_paro.strategy.reshard import switch_peak_bytes

RECORD_FILE = "paro_auto.json"
"""The run's record of ``sharding="auto"`` (:meth:`AutoSession.record`), written by rank 0 into the Trainer's
``log_dir`` when the Trainer has a logger, after the start-up plan and after every re-plan, trial and switch."""


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
        """Each re-plan: after which step, the strategy in use, its measured and predicted step time, the decision, and
        why the switch it asked for was declined (``declined``; None: made, or none asked for)."""
        self.start_plan: Optional[Plan] = None
        """The plan made at start-up (:attr:`plan` is the latest)."""
        self.current: Optional[str] = None
        """The strategy in use."""
        self.reproducible = False
        """Whether this fit plans reproducibly (:meth:`AutoConfig.reproducible`): no switch on measured timings."""
        self.record_dir: Optional[Path] = None
        """Where :data:`RECORD_FILE` is written (None: nowhere; :meth:`record` still holds it)."""
        self._group: Any = None
        self._reduce_on: Optional[torch.device] = None

    def plan_at_setup(self, module, optimizers: list, topology, device, accumulation: int, ranks_on_host: int,
                      units, prefetch: int, chunk_bytes: Optional[int], comm, broadcast: Callable[[Any], Any]) -> str:
        """Collective: probe, plan and return the strategy to start with (the plan's choice, or ``first_plan``)."""
        started = time.perf_counter()
        result = plan_for_job(module, optimizers, topology, device, accumulation=accumulation,
                              ranks_on_host=ranks_on_host, units=units, prefetch=prefetch, config=self.config,
                              chunk_bytes=chunk_bytes, comm=comm)
        first = self.config.first_plan
        # rank 0's plan on every rank: the re-plans start from it, and a switch they decide on is collective
        result, name = broadcast((result, first or result.choice))
        if name is None:
            raise RuntimeError(f"sharding='auto' found no strategy that fits: {result.reason}")
        self.plan = self.start_plan = result
        self.current = name
        self.plan_seconds = time.perf_counter() - started
        self.reproducible = self.config.reproducible()
        forced = f" (AutoConfig.first_plan; the plan's choice: {result.choice})" if first else ""
        rank_zero_info(f"PaRO sharding='auto' chose {name}{forced}{self._reproducible_note()}\n{format_plan(result)}")
        return name

    def _reproducible_note(self) -> str:
        if not self.reproducible:
            return ""
        return ("; reproducible (deterministic): planned from the start-up probe's figures, which are timings and may"
                " differ from run to run (AutoConfig.first_plan fixes the start), and never switched on"
                " measured timings: no re-plan on the steps' times and no trial; only a strategy that does not fit"
                " the first step's activations is replaced")

    def start_fit(self, current: str, device, waited: Callable[[], float], traffic: Callable[[], tuple[float, float]],
                  module, group, prefetch: int, manual: bool, steps_left: Optional[Callable[[], float]] = None,
                  record_dir: Optional[str | Path] = None) -> None:
        """At the start of fit: measure the first optimizer steps for the re-plans (not under manual optimization,
        whose steps the strategy does not see, nor with ``replan_after_steps=0``). ``steps_left``: the optimizer steps
        the fit has left after the one just made (a trial runs only if it can pay back; rank 0's count decides).
        ``record_dir``: where rank 0 writes :data:`RECORD_FILE` (None: nowhere)."""
        self.replanner = None
        self.current = current
        self.reproducible = self.config.reproducible()
        self.record_dir = Path(record_dir) if record_dir is not None else None
        self._group, self._reduce_on = group, (device if torch.device(device).type == "cuda" else None)
        self._write_record()
        if self.plan is None or not self.config.replan_after_steps or manual:
            return
        self.replanner = JobReplanner(
            self.config, self.plan, current, device, waited=waited, traffic=traffic, prefetch=prefetch, group=group,
            steps_left=steps_left, reproducible=self.reproducible,
            excluded_storages=lambda: {p.untyped_storage().data_ptr() for p in module.parameters()})

    def record(self) -> dict[str, Any]:
        """The run's record: the strategy chosen at start-up and the one in use, whether the fit planned reproducibly,
        the start-up and latest plans with every figure they used (``planner.report.plan_record``), and every
        re-plan and switch."""
        return {
            "strategy_chosen": self.start_plan.choice if self.start_plan is not None else None,
            "first_plan": self.config.first_plan, "strategy_in_use": self.current,
            "reproducible": self.reproducible, "plan_seconds": self.plan_seconds,
            "config": dataclasses.asdict(self.config),
            "start_plan": plan_record(self.start_plan) if self.start_plan is not None else None,
            "plan": plan_record(self.plan) if self.plan is not None else None,
            "replans": self.replans, "switches": [dataclasses.asdict(s) for s in self.switches],
        }

    def _switch_refusal(self, engine: PaROEngine, plan: Plan, to: str) -> Optional[str]:
        """Collective: why a switch to ``to`` does not fit, or None when it fits. Its peak (``reshard.py``: the old
        and new model states and the whole model gathered; each rank's own, the largest decides on every rank) must
        fit the memory the plan counts per rank (``Cluster.device_memory``), not only the budget's share of it: a
        switch runs between steps, when no activation or in-flight buffer is alive, which the budget keeps room for."""
        new_states = plan.candidate(to).prediction.memory.model_states
        peak = agreed_maximum(switch_peak_bytes(engine, new_states), self._group, self._reduce_on)
        memory = plan.cluster.device_memory
        if peak <= memory:
            return None
        return (f"resharding would hold {format_bytes(peak)} at its peak (the old and new model states and the whole"
                f" model gathered) on the rank that needs most, over its {format_bytes(memory)} of memory;"
                f" {self.current} stays")

    @rank_zero_only
    def _write_record(self) -> None:
        if self.record_dir is None:
            return
        self.record_dir.mkdir(parents=True, exist_ok=True)
        staged = self.record_dir / f".{RECORD_FILE}.partial"
        staged.write_text(json.dumps(self.record(), indent=1, default=str))
        staged.replace(self.record_dir / RECORD_FILE)  # a reader never sees half a record

    def forward(self) -> ContextManager[None]:
        """Around a micro-step's forward."""
        return self.replanner.forward() if self.replanner is not None else contextlib.nullcontext()

    def end_backward(self) -> None:
        if self.replanner is not None:
            self.replanner.end_backward()

    def after_step(self, step: int, switch: Callable[[str], None], settle: Callable[[], None] = lambda: None,
                   engine: Optional[PaROEngine] = None) -> None:
        """After optimizer step ``step`` (collective while re-planning): feed the re-planner and, when its decision
        says so, call ``switch(strategy)`` and record the switch with its cost. ``settle`` waits for the step's own
        collectives still in flight (the parameter sync), which the step pays for either way, before the switch's
        clock starts. ``engine``: the engine in use, whose switch's peak memory (``reshard.switch_peak_bytes``, the
        largest over the ranks) must fit the rank's memory, else the switch is declined with a logged reason."""
        planner = self.replanner
        if planner is None:
            return
        decision = planner.end_step()
        if decision is not None:
            self.plan = planner.plan
            declined = None if decision.switch_to is None or engine is None else self._switch_refusal(
                engine, planner.plan, decision.switch_to)
            self.replans.append({
                "step": step, "in_use": planner.current, "switch_to": decision.switch_to, "reason": decision.reason,
                "measured_step_seconds": planner.figures.step_seconds if planner.figures else None,
                "predicted_step_seconds": planner.plan.candidate(planner.current).prediction.step_seconds,
                "predicted_speedup": decision.predicted_speedup,
                "micro_step_seconds": planner.figures.micro_step_seconds if planner.figures else None,
                "declined": declined})
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
            if declined is not None:
                planner.decline()
                rank_zero_info(f"PaRO sharding='auto' declined the switch from {planner.current} to"
                               f" {decision.switch_to} after step {step}: {declined}")
            elif decision.switch_to is not None:
                settle()
                previous, started = planner.current, time.perf_counter()
                switch(decision.switch_to)
                seconds = time.perf_counter() - started
                planner.current = self.current = decision.switch_to
                self.switches.append(Switch(step, previous, decision.switch_to, decision.reason, seconds))
                rank_zero_info(f"PaRO sharding='auto' switched from {previous} to {decision.switch_to} after step"
                               f" {step} in {seconds:.3g} s: {decision.reason}")
            self._write_record()
        if planner.finished:
            self.replanner = None
