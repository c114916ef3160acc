"""Independent worker processes under faults: kill -9, hangs, crash between publish and commit, late joiners."""

from __future__ import annotations

import random
import time

import pytest

from lightning_paro.predict.config import LEDGER_FILE_NAME
from lightning_paro.predict.ledger import COMMITTED, LEASED, Ledger
from lightning_paro.predict.progress import read_progress, wait_for_completion
from predict_app import JobSpec
from predict_procs import Workers, assert_exact_output


@pytest.fixture
def workers():
    pool = Workers()
    yield pool
    pool.cleanup()


def ledger_for(spec: JobSpec, out) -> Ledger:
    return Ledger(spec.ledger or str(out / LEDGER_FILE_NAME), spec.job_name or str(out.resolve()))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_random_kill9_of_workers_then_completion_is_exact(tmp_path, workers, backend, request, job_name):
    out = tmp_path / "out"
    ledger = request.getfixturevalue("postgres_url") if backend == "postgres" else None
    spec = JobSpec(output_dir=str(out), ledger=ledger, job_name=job_name, rows=1500, batch_size=10, shard_size=30,
                   step_sleep_s=0.05, lease_ttl_s=0.8, max_attempts=6)
    rng = random.Random(1234)
    for i in range(3):
        spec.worker_name = f"w{i}"
        workers.start(spec)
    kills = 0
    deadline = time.monotonic() + 60
    while kills < 6 and time.monotonic() < deadline:
        time.sleep(rng.uniform(0.2, 0.7))
        alive = workers.alive()
        if not alive:
            break
        workers.kill(rng.choice(alive))
        kills += 1
        spec.worker_name = f"replacement{kills}"
        workers.start(spec)
    assert kills >= 3, "the job finished before the test could kill workers: make it longer"
    codes = workers.wait_all(timeout_s=90)
    assert all(code in (0, -9) for code in codes), codes
    progress = wait_for_completion(ledger_for(spec, out), timeout_s=5)
    assert progress.done_rows == 1500 and progress.failed_rows == 0
    assert_exact_output(out, 1500)


@pytest.mark.timeout(60)
def test_hung_worker_loses_its_shard_to_lease_expiry(tmp_path, workers):
    out = tmp_path / "out"
    hung = JobSpec(output_dir=str(out), rows=300, shard_size=30, worker_name="hung", hang_rows=(35,),
                   lease_ttl_s=0.8, stall_timeout_s=1.0)
    proc = workers.start(hung)
    ledger = ledger_for(hung, out)
    deadline = time.monotonic() + 20
    while not any(s.owner == "hung" and s.start_row == 30 for s in ledger.shards((LEASED,))):
        assert time.monotonic() < deadline, "the hung worker never leased the shard it hangs on"
        time.sleep(0.05)
    healthy = JobSpec(**{**hung.__dict__, "worker_name": "healthy", "hang_rows": ()})
    helper = workers.start(healthy)
    helper.join(timeout=40)
    assert helper.exitcode == 0
    assert proc.is_alive(), "the hung worker should still be hanging"
    shard = next(s for s in ledger.shards() if s.start_row == 30)
    assert shard.state == COMMITTED and shard.committed_by == "healthy" and shard.attempts >= 2
    workers.kill(proc)
    assert_exact_output(out, 300)


@pytest.mark.timeout(60)
def test_crash_between_publish_and_commit_is_acknowledged_not_recomputed(tmp_path, workers):
    out = tmp_path / "out"
    log = tmp_path / "rows.log"
    spec = JobSpec(output_dir=str(out), rows=200, shard_size=40, worker_name="crasher", crash_after_publishes=2,
                   lease_ttl_s=0.5, rows_log=str(log))
    crasher = workers.start(spec)
    crasher.join(timeout=30)
    assert crasher.exitcode == -9
    ledger = ledger_for(spec, out)
    committed = ledger.shards((COMMITTED,))
    published = sorted(out.glob("part-*.parquet"))
    assert len(committed) == 1 and len(published) == 2  # second file renamed into place, never committed
    orphan = published[1]
    inode = orphan.stat().st_ino
    rows_before = len(log.read_text().split())
    rescuer = workers.start(JobSpec(**{**spec.__dict__, "worker_name": "rescuer", "crash_after_publishes": None}))
    rescuer.join(timeout=30)
    assert rescuer.exitcode == 0
    assert orphan.stat().st_ino == inode  # acknowledged, not rewritten
    assert len(log.read_text().split()) - rows_before == 200 - 80  # the two published shards were not recomputed
    shard = next(s for s in ledger.shards() if s.file == orphan.name)
    assert shard.committed_by == "rescuer"
    assert_exact_output(out, 200)


@pytest.mark.timeout(60)
def test_full_restart_after_killing_every_worker_resumes(tmp_path, workers):
    out = tmp_path / "out"
    log = tmp_path / "rows.log"
    # both workers are SIGKILLed right after their third published shard: each leaves two committed
    # shards and one published but uncommitted, whatever the timing
    spec = JobSpec(output_dir=str(out), rows=600, shard_size=30, step_sleep_s=0.005, lease_ttl_s=0.5,
                   rows_log=str(log), crash_after_publishes=3)
    first = []
    for i in range(2):
        spec.worker_name = f"first{i}"
        first.append(workers.start(spec))
    for proc in first:
        proc.join(timeout=40)
        assert proc.exitcode == -9
    ledger = ledger_for(spec, out)
    committed_rows = sum(s.num_rows for s in ledger.shards((COMMITTED,)))
    on_disk_rows = 30 * len(list(out.glob("part-*.parquet")))
    # (a worker may have acknowledged the other's orphan file before dying itself, hence >=)
    assert committed_rows >= 4 * 30 and on_disk_rows > committed_rows
    predicted_before = len(log.read_text().split())
    again = workers.start(JobSpec(**{**spec.__dict__, "worker_name": "second", "crash_after_publishes": None}))
    again.join(timeout=40)
    assert again.exitcode == 0
    recomputed = len(log.read_text().split()) - predicted_before
    # the restart predicts every row that was not on disk, and nothing else
    assert recomputed == 600 - on_disk_rows
    assert_exact_output(out, 600)


@pytest.mark.timeout(60)
def test_late_joiner_takes_shards_at_once_and_tail_is_speculated(tmp_path, workers):
    out = tmp_path / "out"
    spec = JobSpec(output_dir=str(out), rows=1200, shard_size=40, step_sleep_s=0.04, worker_name="early",
                   lease_ttl_s=2.0, speculate_after_s=0.5)
    workers.start(spec)
    ledger = ledger_for(spec, out)
    deadline = time.monotonic() + 30
    while not (out / LEDGER_FILE_NAME).exists() or len(ledger.shards((COMMITTED,))) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    workers.start(JobSpec(**{**spec.__dict__, "worker_name": "late"}))
    deadline = time.monotonic() + 30
    while not any(s.owner == "late" for s in ledger.shards()):
        assert time.monotonic() < deadline, "the late worker never took a shard"
        time.sleep(0.02)
    # measured from the moment it joined the job (registered in the ledger), not from process start-up
    [(joined_at,)] = ledger.db.query(
        "SELECT started_at FROM paro_predict_workers WHERE job = $1 AND owner = $2", (ledger.job, "late")
    )
    [(first_lease,)] = ledger.db.query(
        "SELECT MIN(leased_at) FROM paro_predict_shards WHERE job = $1 AND owner = $2", (ledger.job, "late")
    )
    # it took work while the early worker was still running, without waiting for any rendezvous or expiry
    # (the bound is loose only because a loaded test machine can be slow to build a Trainer)
    assert first_lease - joined_at < 10.0, f"the late worker waited {first_lease - joined_at:.1f} s for its first shard"
    codes = workers.wait_all(timeout_s=60)
    early_last_commit = max(s.committed_at for s in ledger.shards((COMMITTED,)) if s.committed_by == "early")
    assert first_lease < early_last_commit
    assert codes == [0, 0]
    by_worker = {}
    for shard in ledger.shards((COMMITTED,)):
        by_worker[shard.committed_by] = by_worker.get(shard.committed_by, 0) + 1
    assert by_worker.get("late", 0) >= 2 and by_worker.get("early", 0) >= 2
    progress = read_progress(ledger)
    assert progress.complete and progress.done_rows == 1200
    assert_exact_output(out, 1200)


@pytest.mark.timeout(60)
def test_two_workers_with_dataloader_processes_share_a_job_exactly(tmp_path, workers):
    out = tmp_path / "out"
    spec = JobSpec(output_dir=str(out), rows=600, shard_size=30, num_workers=2, step_sleep_s=0.005,
                   extra={"fetch_threads": 3})
    for name in ("a", "b"):
        spec.worker_name = name
        workers.start(spec)
    assert workers.wait_all(timeout_s=45) == [0, 0]
    committers = {s.committed_by for s in ledger_for(spec, out).shards((COMMITTED,))}
    assert committers == {"a", "b"}
    assert_exact_output(out, 600)
