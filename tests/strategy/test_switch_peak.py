"""sharding="auto" checks a switch's resharding peak before it switches: on two processes, the same re-plan's switch
from NNN to GGG is made where the ranks have the memory for it and declined, with the reason logged, where they do
not (the peak holds NNN's states, the model gathered and GGG's states at once)."""

import pytest


@pytest.fixture(scope="module")
def fits(auto_fits):
    """``workers/switch_peak.py``'s fits, run in the shared two-process launch (``workers/auto_fits.py``); its
    messages are the only ones there about NNN and GGG."""
    logs, load = auto_fits
    return logs, lambda name: load("switch_peak", name)


@pytest.mark.timeout(360)
def test_a_switch_is_made_when_its_peak_fits_the_ranks_memory(fits):
    _, load = fits
    for r in load("fits"):
        assert r["switches"] == [["NNN", "GGG"]] and r["in_use"] == "GGG" and r["global_step"] == 5
        assert r["replans"][-1]["declined"] is None


@pytest.mark.timeout(360)
def test_a_switch_whose_peak_does_not_fit_is_declined_with_its_reason(fits):
    logs, load = fits
    for r in load("short"):
        assert r["switches"] == [] and r["in_use"] == "NNN" and r["global_step"] == 5
        last = r["replans"][-1]
        assert last["switch_to"] == "GGG" and "does not fit the budget" in last["reason"]  # the re-plan asked
        assert "at its peak" in last["declined"] and "NNN stays" in last["declined"]
    assert "declined the switch from NNN to GGG" in logs[0]
