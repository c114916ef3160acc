"""On the CPU (gloo) a flat all-gather or reduce-scatter goes in pieces: the same result as the single collective,
with the backend's staging copy one piece instead of the whole buffer (worker: ``workers/pieces_checks.py``)."""

from pathlib import Path

import pytest
from launch import launch

WORKER = Path(__file__).parent / "workers" / "pieces_checks.py"


@pytest.mark.timeout(120)
def test_pieces_match_the_single_collective_and_stage_one_piece():
    outputs = launch(str(WORKER), 2, timeout=100)
    lines = [line for out in outputs for line in out.splitlines() if line.startswith("RESULT")]
    assert len(lines) == 2 * 10, outputs
    failed = [line for line in lines if " FAIL" in line]
    assert not failed, failed
