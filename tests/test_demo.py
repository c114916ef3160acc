import os
import subprocess
import sys

import pytest
import pyarrow.parquet  # noqa: F401  (the predictions are Parquet)


@pytest.mark.timeout(400)
def test_demo_runs_end_to_end(tmp_path):
    """The demo's whole path (fit with PaRO, checkpoint, elastic batch prediction, summary) on a tiny config."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "lightning_paro.demo", "model=gpt_tiny", "data=stdlib_tiny", "trainer.devices=2",
           "strategy.group_size=1", "trainer.max_steps=3", "trainer.limit_val_batches=2", f"run.dir={tmp_path}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "demo summary: paro IIG" in out
    assert "between groups" in out and "model states on rank 0" in out
    assert "validation at the end of fit" in out and "the first 4096 of each of the" in out
    import pandas as pd

    table = pd.read_parquet(tmp_path / "predictions")
    assert len(table) > 0 and {"path", "bits_per_byte", "bytes_scored"} <= set(table.columns)
    assert (tmp_path / "weights.ckpt").exists()
    # the plot beside the summary: a PNG, named in the summary
    plot = tmp_path / "summary.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot         {plot}" in out
