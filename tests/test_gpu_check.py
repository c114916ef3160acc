"""scripts/gpu_check.sh keeps working where no GPU is: its checks run on the CPU with --cpu (a GPU run is recorded
in README)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_gpu_check_script_passes_on_cpu():
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu"], env=env, capture_output=True,
                          text=True, timeout=280)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("gpu_check: ")]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(lines) == 6 and lines[-1].startswith("gpu_check: PASS 5/5 on cpu"), lines
