"""Failures during set-up and in the heartbeat: nothing is left behind and the worker is told."""

from __future__ import annotations

import multiprocessing
import time

import lightning as L
import pytest
from torch.utils.data import DataLoader

from lightning_paro.predict import run as run_module
from lightning_paro.predict.config import ElasticPredictConfig
from lightning_paro.predict.db import LedgerUnavailableError
from lightning_paro.predict.heartbeat import Heartbeat, HeartbeatFailedError, ProgressClock
from lightning_paro.predict.ledger import COMMITTED, LEASED, JobMismatchError, Ledger
from lightning_paro.predict.pipeline import PipelineStage, run_pipeline
from lightning_paro.predict.run import WorkerRun
from predict_app import Affine, JobSpec, RowsDataset, make_callback
from test_predict_pipeline import build_embed, build_head

SECRET = "s3cr3t-pw"


def _loader(rows: int) -> DataLoader:
    return DataLoader(RowsDataset(JobSpec(output_dir="unused", rows=rows)), batch_size=10)


def _existing_job(location: str, job: str, rows: int, shard_size: int) -> None:
    ledger = Ledger(location, job)
    try:
        ledger.ensure_job(rows, shard_size)
    finally:
        ledger.close()


def test_a_refused_job_closes_the_ledger_connection_it_opened(tmp_path, monkeypatch):
    out = tmp_path / "out"
    location = str(tmp_path / "ledger.sqlite")
    _existing_job(location, "job", rows=50, shard_size=10)
    opened, closed = [], []

    class CountingLedger(Ledger):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            opened.append(self)

        def close(self):
            closed.append(self)
            super().close()

    monkeypatch.setattr(run_module, "Ledger", CountingLedger)
    config = ElasticPredictConfig(output_dir=str(out), ledger=location, job_name="job", shard_size=10)
    with pytest.raises(JobMismatchError, match="40 rows"):
        WorkerRun(config, _loader(40))
    assert len(opened) == 1
    assert closed == opened


def _pipeline_children() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("pipeline-")]


@pytest.mark.timeout(120)
def test_a_pipeline_refused_at_set_up_leaves_no_stage_process_behind(tmp_path):
    out = tmp_path / "out"
    location = str(tmp_path / "ledger.sqlite")
    _existing_job(location, "job", rows=50, shard_size=10)
    stages = [PipelineStage("embed", build_embed, replicas=1), PipelineStage("head", build_head, replicas=1)]
    assert _pipeline_children() == []
    with pytest.raises(JobMismatchError):
        run_pipeline(stages, _loader(40), str(out), ledger=location, job_name="job", shard_size=10)
    deadline = time.monotonic() + 10
    while _pipeline_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _pipeline_children() == []


def test_a_heartbeat_that_cannot_open_its_ledger_reports_why_without_the_password(tmp_path):
    url = f"postgresql://paro:{SECRET}@127.0.0.1:1/ledger"

    heartbeat = Heartbeat(lambda: Ledger(url, "job"), "w1", lease_ttl_s=5.0, interval_s=0.05,
                          stall_timeout_s=60.0, clock=ProgressClock(), ledger_display=url)
    heartbeat.start()
    heartbeat.join(timeout=60)
    assert not heartbeat.is_alive()
    with pytest.raises(HeartbeatFailedError) as info:
        heartbeat.check()
    text = str(info.value)
    assert "heartbeat of worker w1 could not open the ledger" in text
    assert "127.0.0.1" in text and SECRET not in text
    assert isinstance(info.value, LedgerUnavailableError)


@pytest.mark.timeout(300)
def test_a_worker_whose_heartbeat_cannot_open_the_ledger_stops_instead_of_losing_its_leases(tmp_path, monkeypatch):
    out = tmp_path / "out"
    spec = JobSpec(output_dir=str(out), rows=400, batch_size=10, shard_size=40, step_sleep_s=0.05, lease_ttl_s=30.0)

    class BrokenHeartbeat(Heartbeat):
        def __init__(self, ledger_factory, *args, **kwargs):
            def unreachable():
                raise LedgerUnavailableError(f"connection to postgresql://paro:{SECRET}@db.example/ledger refused")

            super().__init__(unreachable, *args, **kwargs)

    monkeypatch.setattr(run_module, "Heartbeat", BrokenHeartbeat)
    callback = make_callback(spec)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[callback], enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    loader = DataLoader(RowsDataset(spec), batch_size=spec.batch_size)
    with pytest.raises(HeartbeatFailedError) as info:
        trainer.predict(Affine(spec), dataloaders=loader)
    text = str(info.value)
    assert "could not open the ledger" in text and "refused" in text
    assert SECRET not in text
    ledger = Ledger(str(out / "_ledger.sqlite"), str(out.resolve()))
    try:
        shards = ledger.shards()
        # it stopped early (at its first batch unless the heartbeat thread was slow to start on a busy machine),
        # and handed its lease back instead of letting it run out
        assert sum(s.state == COMMITTED for s in shards) < len(shards) // 2
        assert all(s.state != LEASED or s.lease_expires < time.time() for s in shards)
    finally:
        ledger.close()
