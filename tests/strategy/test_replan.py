"""sharding="auto" measures the job and re-plans in place: the recorder's figures by hand, the switch rule, and a
switch mid-fit against the save/resume path."""

from __future__ import annotations

import json
import math
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from launch import launch
from lightning_paro.planner import AutoConfig, Cluster, Compute, Link, Workload, plan
from lightning_paro.planner.measure import StepRecorder
from lightning_paro.planner.job import JobReplanner
from lightning_paro.planner.replan import decide, replan, settle_trial, trial_candidate
from lightning_paro.strategy.options import OptionError


def _recorder(**kwargs) -> StepRecorder:
    args = {"steps": 1, "device": torch.device("cpu"), "waited": lambda: 0.0, "traffic": lambda: (0.0, 0.0),
            "excluded_storages": set, "skip": 0}
    return StepRecorder(**{**args, **kwargs})


def test_activation_bytes_are_what_autograd_saves_without_the_weights():
    """Linear(4, 8) -> ReLU -> Linear(8, 2) on a batch of 3 in fp32 saves, for backward: the input of the first
    linear (3 x 4 x 4 B = 48 B, for its weight's gradient) and the ReLU's output (3 x 8 x 4 B = 96 B, for the ReLU's
    own backward and, the same tensor, the second linear's weight gradient). The weights are saved too but are
    parameters, not activations: 144 B in all."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def saved(batch: int) -> float:
        recorder = _recorder()
        with recorder.forward():
            loss = model(torch.randn(batch, 4)).sum()
        loss.backward()
        recorder.end_backward()
        recorder.end_step()
        return recorder.figures().activation_bytes

    assert saved(3) == 144
    assert saved(6) == 288  # twice the batch, twice the activations


def test_compute_time_leaves_out_waiting():
    """A micro-step that computes for a while and then waits 0.3 s (a collective): on the CPU clock the wait costs no
    CPU time; on the wall clock the communicator's counter of seconds waited is taken out."""
    waited = [0.0]

    def micro_step(recorder):
        with recorder.forward():
            x = torch.randn(256, 256, requires_grad=True)
            loss = (x @ x).sum()
        started = time.perf_counter()
        time.sleep(0.3)
        waited[0] += time.perf_counter() - started
        loss.backward()
        recorder.end_backward()
        recorder.end_step()
        return recorder.figures().micro_step_seconds

    torch.set_num_threads(1)
    cpu = micro_step(_recorder())
    assert 0 < cpu < 0.15
    wall = _recorder(waited=lambda: waited[0])
    wall._cpu_clock = False  # as on CUDA, or with several intra-op threads
    assert 0 < micro_step(wall) < 0.15
    unaware = _recorder()
    unaware._cpu_clock = False  # no counter: the wait is counted as compute
    assert micro_step(unaware) >= 0.3


def test_the_first_step_is_not_measured():
    recorder = _recorder(steps=2, skip=1)
    assert not recorder.measuring
    recorder.end_step()
    assert recorder.measuring and not recorder.done
    recorder.end_step()
    recorder.end_step()
    assert recorder.done and not recorder.measuring


def _plan(memory_budget: float, compute: float | None = None) -> tuple:
    # 100M parameters, 2 groups of 4 ranks, a slow link between groups; A = 1.
    work = Workload(num_params=1e8, num_trainable=1e8, accumulation=1, num_units=8, param_bytes=4, grad_bytes=4,
                    optim_bytes=8, tokens_per_micro_batch=1024)
    cluster = Cluster(8, 4, Link.gbit(100, 5), Link.gbit(1, 50), device_memory=4e9)
    return plan(work, cluster, Compute(compute, memory_bandwidth=1e11), memory_budget), work


def test_replan_takes_the_measured_compute_and_activations():
    start, _ = _plan(0.9)
    new = replan(start, 0.9, micro_step_seconds=0.5, activation_bytes=2e8, note="measured")
    assert new.compute.micro_step_seconds == 0.5 and new.workload.activation_bytes == 2e8
    assert all(c.prediction.memory.activations == 2e8 for c in new.candidates)
    assert new.notes[-1] == "measured"
    kept = replan(start, 0.9)
    assert kept.compute.micro_step_seconds is None and kept.workload.activation_bytes is None


def test_decide_switches_only_for_the_margin_or_when_the_strategy_in_use_does_not_fit():
    new = replan(_plan(0.9)[0], 0.9, micro_step_seconds=0.05, activation_bytes=0.0)
    best = new.choice
    slowest = new.candidates[-1].strategy
    speedup = new.candidate(slowest).prediction.step_seconds / new.candidate(best).prediction.step_seconds
    assert speedup > 1.1  # the margin below is 0.1
    d = decide(new, slowest, margin=0.1)
    assert d.switch_to == best and d.predicted_speedup == pytest.approx(speedup)
    assert decide(new, slowest, margin=speedup).switch_to is None  # below the margin asked
    assert decide(new, slowest, margin=math.inf).switch_to is None  # the fit check alone: it fits
    assert decide(new, best, margin=0.0).switch_to is None
    # 100M fp32 parameters with Adam: NNN holds 16 B per parameter = 1.6 GB of model states; with 1.5 GB of
    # activations measured it needs more than 0.7 x 4 GB = 2.8 GB, so it must give way whatever the margin.
    tight = replan(_plan(0.7)[0], 0.7, micro_step_seconds=0.05, activation_bytes=1.5e9)
    assert not tight.candidate("NNN").fits
    forced = decide(tight, "NNN", margin=math.inf)
    assert forced.switch_to == tight.choice and "does not fit" in forced.reason
    measured = 2 * tight.candidate("NNN").prediction.step_seconds
    assert decide(tight, "NNN", 0.0, measured).measured_over_predicted == pytest.approx(2.0)


def _table(**seconds):
    """A plan's candidate table by hand: strategy=step seconds; a name ending in _ does not fit."""
    rows = [SimpleNamespace(strategy=name.rstrip("_"), fits=not name.endswith("_"),
                            prediction=SimpleNamespace(step_seconds=t)) for name, t in seconds.items()]
    return SimpleNamespace(candidates=rows, candidate=lambda s: next(r for r in rows if r.strategy == s))


def test_a_trial_is_the_fastest_near_tie_that_differs_in_the_gradient_level_only():
    """NNG in use at 1.00 s. Its gradient-only neighbours: NGG (1.04 s), NIG (1.02 s, does not fit). NNN (0.99 s)
    changes the optimizer states' level and IGG (1.01 s) the parameters': moving those states is no free trial."""
    table = _table(NNG=1.0, NGG=1.04, NIG_=1.02, NNN=0.99, IGG=1.01)
    assert trial_candidate(table, "NNG", 0.05) == "NGG"  # 1.04 <= 1.00 x 1.05
    assert trial_candidate(table, "NNG", 0.03) is None  # 1.04 > 1.03; NIG would be near enough but does not fit
    assert trial_candidate(table, "NNG", 0.0) is None  # off
    # faster by less than a switch's margin: tried as well, the fastest of two neighbours first
    assert trial_candidate(_table(NNG=1.0, NGG=0.97, NIG=0.98), "NNG", 0.05) == "NGG"
    assert trial_candidate(_table(IIG=2.0, IGG=2.08, NIG=2.0), "IIG", 0.05) == "IGG"  # 2.08 <= 2.10; NIG: params


def test_a_trial_keeps_the_faster_measured():
    kept = settle_trial("NNG", 0.50, "NGG", 0.45)
    assert kept.switch_to is None and "keep NGG" in kept.reason and "0.45 s" in kept.reason
    back = settle_trial("NNG", 0.50, "NGG", 0.55)
    assert back.switch_to == "NNG" and back.predicted_speedup == pytest.approx(1.1)
    assert settle_trial("NNG", 0.50, "NGG", 0.50).switch_to == "NNG"  # a tie: back to the strategy chosen first


@pytest.mark.parametrize("tried_seconds, kept", [(0.01, "NGG"), (0.12, "NNG")])
def test_the_replanner_tries_a_near_tie_and_keeps_the_faster(world_of_one, tried_seconds, kept):
    """NNG in use with NGG its only gradient-only neighbour, the trial margin wide enough for any prediction and no
    switch margin: re-planned after 2 steps (the first not timed), NGG is tried for 2 steps and kept only if its timed
    step (slept ``tried_seconds``) is shorter than NNG's (slept 0.06 s), and only where the fit goes on long enough."""
    config = AutoConfig(strategies=("NNG", "NGG"), replan_after_steps=2, replan_margin=1e9, trial_margin=1e9)
    start, _ = _plan(0.9)
    model = nn.Linear(4, 4)

    def step(seconds: float):
        with planner.forward():
            loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        planner.end_backward()
        time.sleep(seconds)
        return planner.end_step()

    # a fit of 5 steps has 3 left after the re-plan's second: too few for a trial of 2 and 2 more after it
    planner = JobReplanner(config, start, "NNG", "cpu", waited=lambda: 0.0, traffic=lambda: (0.0, 0.0),
                           excluded_storages=set, steps_left=lambda: 3)
    assert step(0.0) is None and step(0.0).switch_to is None and planner.finished
    planner = JobReplanner(config, start, "NNG", "cpu", waited=lambda: 0.0, traffic=lambda: (0.0, 0.0),
                           excluded_storages=set, steps_left=lambda: 4)
    assert step(0.06) is None  # the activation check: NNG fits
    trial = step(0.06)
    assert trial.switch_to == "NGG" and "a trial of NGG for 2 steps" in trial.reason and not planner.finished
    planner.current = "NGG"
    assert step(tried_seconds * 5) is None  # the trial's first step is not timed
    settled = step(tried_seconds)
    assert planner.finished and planner.tried == "NGG" and step(0.0) is None
    assert (settled.switch_to or "NGG") == kept
    assert planner.figures.step_seconds == pytest.approx(tried_seconds, abs=0.03)


@pytest.mark.parametrize("kwargs, option", [({"replan_after_steps": 1}, "replan_after_steps"),
                                            ({"replan_margin": -0.1}, "replan_margin"),
                                            ({"trial_margin": -0.05}, "trial_margin"),
                                            ({"first_plan": "XYZ"}, "first_plan"),
                                            ({"strategies": ("NNN", "ABC")}, "strategies"),
                                            ({"first_plan": "GGG", "strategies": ("NNN",)}, "first_plan"),
                                            ({"memory_bandwidth": 0}, "memory_bandwidth")])
def test_replan_options_are_checked(kwargs, option):
    with pytest.raises(OptionError, match=option):
        AutoConfig(**kwargs)
    assert AutoConfig(first_plan="ggg", strategies=["nnn", "GGG"]).strategies == ("NNN", "GGG")


@pytest.fixture(scope="module")
def replan_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("replan")
    logs = launch("replan.py", 4, str(out), timeout=420, extra_env={"LIGHTNING_PARO_CACHE_DIR": str(out / "links")})

    def result(job, rank=0):
        return json.loads((out / f"{job}.{rank}.json").read_text())

    return result, lambda job: torch.load(out / f"{job}.pt", weights_only=True), logs[0]


@pytest.mark.timeout(480)
def test_switch_in_place_equals_saving_and_resuming_under_the_new_strategy(replan_runs):
    """NNN forced first, not fitting the budget: after 2 optimizer steps the re-plan switches to GGG in place; the
    losses after the switch and the final weights equal, bit for bit, NNN saved after 2 steps and GGG resumed."""
    result, weights, _ = replan_runs
    for rank in range(4):
        switched, first, resumed = result("switch", rank), result("first", rank), result("resumed", rank)
        assert switched["strategy"] == "GGG" and switched["global_step"] == resumed["global_step"] == 4
        assert switched["losses"] == first["losses"] + resumed["losses"]
        [switch] = switched["switches"]
        assert (switch["step"], switch["from"], switch["to"]) == (2, "NNN", "GGG")
        assert "NNN does not fit" in switch["reason"] and switch["seconds"] > 0
    a, b = weights("switch"), weights("resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(480)
@pytest.mark.parametrize("label, first, then", [("widen", "GGG", "NNN"), ("rail", "IIG", "NII")])
def test_a_switch_to_coarser_levels_gathers_and_equals_saving_and_resuming(replan_runs, label, first, then):
    """GGG -> NNN (parameters and optimizer states gathered over all ranks) and IIG -> NII (parameters over the group,
    optimizer states over the rail between groups): the same losses and weights as the save/resume path."""
    result, weights, _ = replan_runs
    for rank in range(4):
        switched = result(f"{label}-switch", rank)
        [switch] = switched["switches"]
        assert (switch["step"], switch["from"], switch["to"]) == (2, first, then)
        assert switched["losses"] == result(f"{label}-first", rank)["losses"] + result(f"{label}-resumed", rank)["losses"]
    a, b = weights(f"{label}-switch"), weights(f"{label}-resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(480)
def test_a_trial_switches_to_a_near_tie_and_keeps_the_faster_measured(replan_runs):
    """NNG forced first, NGG within the trial margin: after step 2 every rank switches to NGG, after step 4 it keeps
    NGG or switches back, by the step times measured (the same on every rank); the losses follow NNG's alone (the
    gradient level changes only how gradients are reduced, so up to summation order)."""
    result, _, log = replan_runs
    runs = [result("trial", r) for r in range(4)]
    made = [[(s["step"], s["from"], s["to"], s["reason"]) for s in r["switches"]] for r in runs]
    assert all(m == made[0] for m in made)
    first, *back = runs[0]["switches"]
    assert (first["step"], first["from"], first["to"]) == (2, "NNG", "NGG")
    assert "a trial of NGG for 2 steps" in first["reason"]
    if back:
        [back] = back
        assert (back["step"], back["from"], back["to"]) == (4, "NGG", "NNG") and "back to NNG" in back["reason"]
    else:
        assert "keep NGG after its trial" in log
    assert "ended the trial of NGG after 4 steps: measured" in log
    assert runs[0]["strategy"] == ("NNG" if back else "NGG") and runs[0]["global_step"] == 6
    alone = result("trial-nng")["losses"]
    assert len(runs[0]["losses"]) == len(alone) and torch.allclose(torch.tensor(runs[0]["losses"]),
                                                                   torch.tensor(alone), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(480)
def test_the_plan_keeps_every_figure_it_measured(replan_runs):
    """Nothing but the links given: the update bandwidth is timed at start-up, the compute and activations on steps
    2 and 3, all kept in ``auto_plan`` and logged with the candidate table."""
    result, _, log = replan_runs
    measured = result("measured")
    assert measured["micro_step_seconds"] > 0 and measured["activation_bytes"] > 0
    assert 1e6 < measured["memory_bandwidth"] < 1e13
    notes = "\n".join(measured["notes"])
    assert "stepped over" in notes and "re-planned with compute" in notes and "links given" in notes
    assert "re-planned after 3 steps: measured" in log
    # the same figures on every rank
    assert all(result("measured", r)["activation_bytes"] == measured["activation_bytes"] for r in range(4))
    early = result("early")
    [switch] = early["switches"]
    assert (switch["step"], switch["from"], switch["to"]) == (1, "NNN", "GGG") and "does not fit" in switch["reason"]
    assert early["strategy"] == "GGG" and "measured on the first step" in "\n".join(early["notes"])
    off = result("off")
    assert off["switches"] == [] and "re-plan" not in "\n".join(off["notes"])


@pytest.mark.timeout(480)
def test_a_second_job_plans_with_the_links_the_first_probed(replan_runs):
    """Two fits under sharding="auto" with nothing given, one after the other: the first probes and stores its links,
    the second checks them by timing the large gathers again and plans with the same figures, on every rank."""
    result, _, _ = replan_runs
    for r in range(4):
        first, second = result("probed", r), result("probed-again", r)
        assert first["notes"][0].startswith("links measured by the start-up probe (no stored links")
        assert second["notes"][0].startswith("links from the link cache, checked: large all-gathers at")
        assert second["links"] == first["links"] == result("probed", 0)["links"]
