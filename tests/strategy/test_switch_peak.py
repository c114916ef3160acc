"""sharding="auto" checks a switch's resharding peak before it switches: on two processes, the same re-plan's switch
from NNN to GGG is made where the ranks have the memory for it and declined, with the reason logged, where they do
not (the peak holds NNN's states, the model gathered and GGG's states at once)."""

import json

import pytest
from launch import launch


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    out = tmp_path_factory.mktemp("switch_peak")
    logs = launch("switch_peak.py", 2, str(out), timeout=200)
    return logs, lambda name: [json.loads((out / f"{name}.{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(240)
def test_a_switch_is_made_when_its_peak_fits_the_ranks_memory(fits):
    _, load = fits
    for r in load("fits"):
        assert r["switches"] == [["NNN", "GGG"]] and r["in_use"] == "GGG" and r["global_step"] == 5
        assert r["replans"][-1]["declined"] is None


@pytest.mark.timeout(240)
def test_a_switch_whose_peak_does_not_fit_is_declined_with_its_reason(fits):
    logs, load = fits
    for r in load("short"):
        assert r["switches"] == [] and r["in_use"] == "NNN" and r["global_step"] == 5
        last = r["replans"][-1]
        assert last["switch_to"] == "GGG" and "does not fit the budget" in last["reason"]  # the re-plan asked
        assert "at its peak" in last["declined"] and "NNN stays" in last["declined"]
    assert "declined the switch from NNN to GGG" in logs[0]
