"""The int8 hop's error feedback over a fit, on 4 processes (2 groups of 2, ``IIG``, ``inter_quant="int8"``,
``error_feedback=True``): a sharded checkpoint carries every rank's buffer, a resume at another group size starts
it from zero with a note, a non-finite gradient leaves it finite, and a size the public quantized collectives
cannot split is an error naming the size and the divisor."""

import json

import pytest
from launch import launch

WORLD = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("error_feedback")
    logs = launch("error_feedback.py", WORLD, str(out), timeout=300)
    return logs, [json.loads((out / f"{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.timeout(360)
def test_a_sharded_checkpoint_carries_each_ranks_error_feedback(runs):
    _, ranks = runs
    for r in ranks:
        assert r["buffers"] > 0 and r["saved_nonzero"]
        assert r["resumed_equal"] and all(r["resumed_equal"])


@pytest.mark.timeout(360)
def test_another_group_size_starts_the_error_feedback_from_zero_with_a_note(runs):
    logs, ranks = runs
    assert all(r["other_layout_zero"] and all(r["other_layout_zero"]) for r in ranks)
    note = "error feedback of the quantized gradient hop starts from zero"
    assert note in logs[0] and "4 ranks in 4 groups" in logs[0]
    assert note not in "".join(logs[1:])  # rank 0 says it


@pytest.mark.timeout(360)
def test_a_full_checkpoint_resumes_the_error_feedback_from_zero_with_a_note(runs):
    logs, ranks = runs
    assert all(r["from_full_zero"] and all(r["from_full_zero"]) for r in ranks)
    assert "a full checkpoint does not hold it" in logs[0]


@pytest.mark.timeout(360)
def test_a_non_finite_gradient_leaves_the_error_feedback_finite(runs):
    """Rank 0's gradient holds one inf on the second step: every rank's buffers stay finite on every step."""
    _, ranks = runs
    for r in ranks:
        assert r["finite_after_each_step"] == [True] * 3


@pytest.mark.timeout(360)
def test_a_quantized_collective_refuses_a_size_it_cannot_split(runs):
    _, ranks = runs
    for r in ranks:
        assert r["odd_size_error"] is not None and "10 elements" in r["odd_size_error"]
        assert "multiple of 4" in r["odd_size_error"]
