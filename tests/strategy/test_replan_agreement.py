"""sharding="auto"'s re-planning decisions are rank 0's on every rank: two processes whose fits have different steps
left (and different step times) still take the same decisions, trial included, and finish (no hang)."""

import json

import pytest


@pytest.mark.timeout(360)
def test_ranks_with_different_steps_left_take_rank_0s_decisions(auto_fits):
    # workers/replan_agree.py, run last in the shared two-process launch (workers/auto_fits.py)
    out = auto_fits[1].dir / "replan_agree"
    ranks = [json.loads((out / f"{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["decisions"] == ranks[1]["decisions"]
    assert ranks[0]["step_seconds"] == ranks[1]["step_seconds"]
    # rank 0 has steps left for a trial (rank 1, alone, would have decided against one)
    trial = [d for d in ranks[0]["decisions"] if d is not None and "a trial of NGG" in d[1]]
    assert len(trial) == 1 and trial[0][0] == "NGG"
    assert ranks[0]["tried"] == ranks[1]["tried"] == "NGG"
