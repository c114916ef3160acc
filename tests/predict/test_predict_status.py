"""The global progress view and the ``status`` command."""

from __future__ import annotations

import json
import subprocess
import sys

from lightning_paro.predict.__main__ import main
from lightning_paro.predict.ledger import Ledger
from lightning_paro.predict.progress import read_progress
from ledger_time import pass_time
from predict_app import JobSpec, run_job


def test_progress_counts_rows_speed_eta_retries_and_failures(ledger_location, job_name):
    ledger = Ledger(ledger_location, job_name)
    ledger.ensure_job(100, 10)
    for i in range(4):
        lease = ledger.lease("a", lease_ttl_s=5)
        pass_time(ledger, 2)
        ledger.commit(lease.shard_id, "a", 10 - (i == 3), int(i == 3), "f")
    ledger.lease("a", lease_ttl_s=5)
    pass_time(ledger, 10)  # that lease expires and is taken over: one retry
    ledger.lease("b", lease_ttl_s=5)
    # read as of 16 s after the first commit on the database's clock (the test itself takes time on a busy machine)
    first_commit = min(s.committed_at for s in ledger.shards() if s.committed_at is not None)
    progress = read_progress(ledger, now=first_commit + 16, window_s=60)
    assert (progress.done_rows, progress.total_rows, progress.failed_rows) == (40, 100, 1)
    assert (progress.committed_shards, progress.leased_shards, progress.total_shards) == (4, 1, 10)
    assert progress.retries == 1 and progress.active_workers == 1
    # 3 shards (30 rows) committed over the 16 s since the first commit
    assert abs(progress.rows_per_s - 30 / 16) < 1e-9
    assert abs(progress.eta_s - 60 / (30 / 16)) < 1e-6
    assert "40/100 rows (40.0%)" in progress.summary()


def test_status_command_reports_a_finished_job(tmp_path, capsys):
    out = tmp_path / "out"
    run_job(JobSpec(output_dir=str(out), rows=90, poison_model_rows=(4,), max_failed_rows=1))
    assert main(["status", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["progress"]["done_rows"] == 90 and report["progress"]["failed_rows"] == 1
    assert report["progress"]["complete"] and report["success"]
    assert main(["status", str(out)]) == 0
    text = capsys.readouterr().out
    assert "(complete)" in text and "90/90 rows (100.0%)" in text


def test_status_command_explains_a_missing_job(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_paro.predict", "status", str(tmp_path / "nothing")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "No prediction ledger" in proc.stderr
