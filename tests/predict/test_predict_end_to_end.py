"""ElasticPredict in one process: output format, order, ids, poison rows, budget, resume, clear errors."""

from __future__ import annotations

import errno
import json
import os

import pyarrow as pa
import pytest

from lightning_paro.predict import (
    ErrorBudgetExceededError,
    JobIncompleteError,
    LedgerUnavailableError,
    OutputNotWritableError,
    iter_predictions,
    read_errors,
    read_predictions,
)
from lightning_paro.predict import shard_files
from lightning_paro.predict.ledger import COMMITTED, Ledger
from lightning_paro.predict.config import LEDGER_FILE_NAME
from predict_app import JobSpec, run_job
from predict_procs import assert_exact_output


@pytest.mark.parametrize("fmt,num_workers", [("parquet", 0), ("jsonl", 2)])
def test_every_row_once_in_input_order_with_manifest(tmp_path, fmt, num_workers):
    out = tmp_path / "out"
    spec = JobSpec(output_dir=str(out), rows=230, batch_size=16, shard_size=50, format=fmt, num_workers=num_workers,
                   id_column="key", extra={"fetch_threads": 1 + 3 * num_workers})
    callback = run_job(spec)
    table = assert_exact_output(out, 230)
    assert table.column("key").to_pylist() == [f"id-{i}" for i in range(230)]
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["num_rows"] == 230 and manifest["rows_written"] == 230 and manifest["rows_failed"] == 0
    assert [f["start_row"] for f in manifest["files"]] == [0, 50, 100, 150, 200]
    assert all(f["file"].endswith("." + fmt) for f in manifest["files"])
    assert callback.manifest == manifest
    batches = list(iter_predictions(out, batch_size=7))
    assert max(b.num_rows for b in batches) <= 7
    assert pa.Table.from_batches(batches).column("row_id").to_pylist() == list(range(230))


def test_resume_after_completion_recomputes_nothing(tmp_path):
    out = tmp_path / "out"
    log = tmp_path / "rows.log"
    spec = JobSpec(output_dir=str(out), rows=120, rows_log=str(log))
    run_job(spec)
    assert len(log.read_text().split()) == 120
    run_job(spec)
    assert len(log.read_text().split()) == 120
    assert_exact_output(out, 120)


def test_poison_rows_are_isolated_reported_and_the_rest_written(tmp_path):
    out = tmp_path / "out"
    spec = JobSpec(output_dir=str(out), rows=200, poison_dataset_rows=(7,), poison_model_rows=(42, 43, 150),
                   max_failed_rows=10, extra={"fetch_threads": 4})
    callback = run_job(spec)
    assert_exact_output(out, 200, skip={7, 42, 43, 150})
    errors = {e["row_id"]: e for e in read_errors(out)}
    assert sorted(errors) == [7, 42, 43, 150]
    assert errors[7]["stage"] == "dataset" and "corrupt record 7" in errors[7]["error"]
    assert errors[42]["stage"] == "predict_step" and "model cannot score rows [42]" in errors[42]["error"]
    assert "Traceback" in errors[150]["traceback"]
    assert callback.manifest["rows_failed"] == 4


def test_error_budget_fails_the_job_naming_rows_then_a_larger_budget_resumes(tmp_path):
    out = tmp_path / "out"
    log = tmp_path / "rows.log"
    spec = JobSpec(output_dir=str(out), rows=200, poison_model_rows=(5, 130), max_failed_rows=1, rows_log=str(log))
    with pytest.raises(ErrorBudgetExceededError, match=r"2 rows failed.*row 130.*max_failed_rows"):
        run_job(spec)
    assert not (out / "_SUCCESS").exists()
    done_before = len(log.read_text().split())
    spec.max_failed_rows = 2
    run_job(spec)
    assert_exact_output(out, 200, skip={5, 130})
    # only rows of shards that were not committed before were predicted again
    assert len(log.read_text().split()) - done_before < 200


def test_unwritable_output_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(OutputNotWritableError, match="Cannot write prediction output under .*a-file"):
        run_job(JobSpec(output_dir=str(blocker / "out"), ledger=str(tmp_path / "l.sqlite")))


def test_disk_full_midway_fails_clearly_leaves_ledger_consistent_and_resumes(tmp_path, monkeypatch):
    out = tmp_path / "out"
    real_fsync = os.fsync
    calls = {"n": 0}

    def fsync_until_full(fd):
        calls["n"] += 1
        if calls["n"] > 6:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(shard_files.os, "fsync", fsync_until_full)
    spec = JobSpec(output_dir=str(out), rows=400)
    with pytest.raises(OutputNotWritableError, match="disk is full"):
        run_job(spec)
    ledger = Ledger(str(out / LEDGER_FILE_NAME), str(out.resolve()))
    committed = ledger.shards((COMMITTED,))
    assert 0 < len(committed) < 10
    for shard in committed:  # nothing is marked done that is not on disk
        assert (out / shard.file).exists()
    assert not list(out.glob(".tmp-*"))
    assert not (out / "_manifest.json").exists()
    with pytest.raises(JobIncompleteError, match="status"):
        read_predictions(out)
    monkeypatch.setattr(shard_files.os, "fsync", real_fsync)
    run_job(spec)
    assert_exact_output(out, 400)


def test_ledger_lost_midway_marks_nothing_done_that_is_not_on_disk(tmp_path, monkeypatch):
    out = tmp_path / "out"
    calls = {"n": 0}
    real_commit = Ledger.commit

    def commit_until_unreachable(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise LedgerUnavailableError("The prediction ledger at test is unreachable (simulated)")
        return real_commit(self, *args, **kwargs)

    monkeypatch.setattr(Ledger, "commit", commit_until_unreachable)
    spec = JobSpec(output_dir=str(out), rows=400, rows_log=str(tmp_path / "rows.log"))
    with pytest.raises(LedgerUnavailableError, match="unreachable"):
        run_job(spec)
    monkeypatch.setattr(Ledger, "commit", real_commit)
    ledger = Ledger(str(out / LEDGER_FILE_NAME), str(out.resolve()))
    assert len(ledger.shards((COMMITTED,))) == 2
    # the third shard's file was published but never committed: the rerun acknowledges it
    published = sorted(p.name for p in out.glob("part-*"))
    assert len(published) == 3
    inode = (out / published[2]).stat().st_ino
    predicted_before = len((tmp_path / "rows.log").read_text().split())
    run_job(spec)
    assert_exact_output(out, 400)
    assert (out / published[2]).stat().st_ino == inode
    assert len((tmp_path / "rows.log").read_text().split()) - predicted_before == 400 - 120


def test_unreachable_ledger_is_a_clear_error(tmp_path):
    url = f"postgresql://bob:hunter2@/db?host={tmp_path}/no-server&connect_timeout=1"
    with pytest.raises(LedgerUnavailableError) as info:
        run_job(JobSpec(output_dir=str(tmp_path / "out"), ledger=url))
    assert "hunter2" not in str(info.value) and "PostgreSQL prediction ledger" in str(info.value)


def test_a_different_dataset_against_the_same_output_is_refused(tmp_path):
    out = tmp_path / "out"
    run_job(JobSpec(output_dir=str(out), rows=80))
    with pytest.raises(Exception, match="already holds job .* over 80 rows"):
        run_job(JobSpec(output_dir=str(out), rows=81))


def test_concurrent_finalisers_agree(tmp_path):
    import threading

    from lightning_paro.predict.manifest import finalize_job

    out = tmp_path / "out"
    run_job(JobSpec(output_dir=str(out), rows=100, poison_model_rows=(3,), max_failed_rows=1))
    errors: list = []

    def finalise() -> None:
        ledger = Ledger(str(out / LEDGER_FILE_NAME), str(out.resolve()))
        try:
            for _ in range(15):
                finalize_job(out, ledger, "parquet", "row_id", None, 1)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=finalise) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert_exact_output(out, 100, skip={3})
