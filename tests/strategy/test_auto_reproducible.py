"""Reproducible ``sharding="auto"`` and the run's record of it, on two processes: with ``Trainer(deterministic=True)``
the fit never re-plans or switches on measured timings (the same fit without it tries a near-tie on them), the log
says so, and rank 0 writes the chosen strategy and every figure it used to ``paro_auto.json`` in ``trainer.log_dir``."""

import json
from pathlib import Path

import pytest

from lightning_paro.planner import AutoConfig
from lightning_paro.strategy.auto_session import RECORD_FILE
from lightning_paro.strategy.options import OptionError


@pytest.fixture(scope="module")
def fits(auto_fits):
    """``workers/auto_record.py``'s fits, run in the shared two-process launch (``workers/auto_fits.py``); only its
    fit is deterministic there."""
    logs, load = auto_fits
    return logs, lambda name: load("auto_record", name)


@pytest.mark.timeout(360)
def test_deterministic_auto_never_switches_on_timings_and_says_so(fits):
    logs, load = fits
    timed, kept = load("timed"), load("deterministic")
    assert timed[0]["replans"] >= 1 and ["NNG", "NGG"] in timed[0]["switches"]  # the timed fit tried NGG
    for r in kept:
        assert r["replans"] == 0 and r["switches"] == [] and r["in_use"] == "NNG"
    assert "reproducible (deterministic)" in logs[0] and "never switched on measured timings" in logs[0]


@pytest.mark.timeout(360)
def test_the_run_records_the_chosen_strategy_and_every_figure_in_its_log_dir(fits):
    _, load = fits
    for name, reproducible in (("timed", False), ("deterministic", True)):
        ranks = load(name)
        record = json.loads((Path(ranks[0]["log_dir"]) / RECORD_FILE).read_text())
        assert record["reproducible"] is reproducible
        assert record["strategy_chosen"] in ("NNG", "NGG") and record["first_plan"] == "NNG"
        assert record["strategy_in_use"] == ranks[0]["in_use"]
        plan = record["start_plan"]
        assert plan["cluster"]["inter"]["bandwidth"] == pytest.approx(1e9 / 8)  # the given link, 1 Gbit/s
        assert plan["compute"]["memory_bandwidth"] == 1e10 and plan["cluster"]["device_memory"] == 4e9
        assert {c["strategy"] for c in plan["candidates"]} == {"NNG", "NGG"}
        assert all(c["step_seconds"] > 0 and c["memory_bytes"] >= c["memory"]["params"] > 0 for c in plan["candidates"])
        assert any("links given" in note for note in plan["notes"])
        assert len(record["replans"]) == ranks[0]["replans"]
        assert [[s["from_strategy"], s["to_strategy"]] for s in record["switches"]] == ranks[0]["switches"]


def test_the_deterministic_option_is_checked_and_follows_torch_when_unset():
    import torch

    with pytest.raises(OptionError, match="deterministic"):
        AutoConfig(deterministic="yes")
    assert AutoConfig(deterministic=True).reproducible() and not AutoConfig(deterministic=False).reproducible()
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert AutoConfig().reproducible()
        torch.use_deterministic_algorithms(False)
        assert not AutoConfig().reproducible()
    finally:
        torch.use_deterministic_algorithms(before)
