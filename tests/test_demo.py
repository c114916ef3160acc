import json
import os
import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
def test_demo_runs_end_to_end(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "lightning_paro.demo", "--steps", "3", "--devices", "2", "--group-size", "1",
           "--train-bytes", "30000", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["sharding"] == "IIG" and summary["processes"] == 2
    assert summary["inter_bytes_per_step"] > 0  # group size 1: every gather crosses groups
    assert summary["memory_rank0"]["params"] > 0
    assert (tmp_path / "checkpoint" / "meta.pt").is_file()
    from lightning_paro.demo.model import GPT

    model = GPT.load_from_checkpoint(tmp_path / "gpt.ckpt", weights_only=True)
    assert sum(p.numel() for p in model.parameters()) == summary["parameters"]
    assert "PaRO strategy IIG" in proc.stdout
