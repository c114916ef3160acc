"""Leases on a real cluster: the database's clock, graceful release, and recovery from a dead worker in seconds."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import threading
import time

import pytest

from lightning_paro.predict.heartbeat import Heartbeat, ProgressClock
from lightning_paro.predict.ledger import (
    COMMITTED,
    LEASED,
    POISONED,
    SPLIT,
    TODO,
    CommitResult,
    Lease,
    Ledger,
    LeaseWait,
)
from lightning_paro.predict.progress import read_progress
from lightning_paro.predict import ReplicaFailedError, run_replicas
from ledger_time import pass_time

_FORK = multiprocessing.get_context("fork")


def _register(ledger: Ledger, owner: str) -> None:
    ledger.register_worker(owner, socket.gethostname(), os.getpid())


# ---- 1. leases on the database's clock ----------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_a_worker_whose_clock_is_ten_leases_off_takes_no_live_lease_and_splits_nothing(ledger_location, job_name):
    """Three workers, one with its clock ten lease periods ahead and one ten behind, renew their leases with the
    heartbeat thread while they work: no lease is taken from a live worker, no shard is split."""
    ttl = 2.0
    Ledger(ledger_location, job_name).ensure_job(12, 1)
    offsets = {"true": 0.0, "ahead": 10 * ttl, "behind": -10 * ttl}
    leases: list[tuple[str, int]] = []
    errors: list[BaseException] = []

    def worker(name: str, offset: float) -> None:
        def skewed() -> float:
            return time.time() + offset

        ledger = Ledger(ledger_location, job_name, clock=skewed)
        _register(ledger, name)
        beat = Heartbeat(lambda: Ledger(ledger_location, job_name, clock=skewed), name, ttl, ttl / 8, 600.0,
                         ProgressClock())
        beat.start()
        try:
            while True:
                lease = ledger.lease(name, lease_ttl_s=ttl, max_attempts=2)
                if lease is LeaseWait.DONE:
                    return
                if lease is LeaseWait.WAIT:
                    time.sleep(0.05)
                    continue
                leases.append((name, lease.shard_id))
                beat.clock.touch()
                time.sleep(0.5)  # longer than the heartbeat's interval: held across renewals
                ledger.commit(lease.shard_id, name, 1, 0, f"part-{lease.shard_id}")
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)
        finally:
            beat.stop()
            ledger.close()

    threads = [threading.Thread(target=worker, args=item, daemon=True) for item in offsets.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    ledger = Ledger(ledger_location, job_name)
    shards = ledger.shards()
    ledger.close()
    assert {s.state for s in shards} == {COMMITTED} and len(shards) == 12  # nothing split
    assert [s.attempts for s in shards] == [1] * 12
    holders = {shard: [name for name, leased in leases if leased == shard] for shard in range(12)}
    assert all(len(names) == 1 for names in holders.values()), holders  # each shard leased once
    assert {s.shard_id: s.committed_by for s in shards} == {shard: names[0] for shard, names in holders.items()}


def test_lease_times_are_the_databases_not_the_workers(ledger_location, job_name):
    far_ahead = Ledger(ledger_location, job_name, clock=lambda: time.time() + 1e6)
    try:
        far_ahead.ensure_job(2, 1)
        far_ahead.lease("w", lease_ttl_s=30)
        database_now = far_ahead.now()
        assert abs(database_now - time.time()) < 60
        leased = [s for s in far_ahead.shards() if s.owner == "w"][0]
        assert database_now < leased.lease_expires <= database_now + 30
    finally:
        far_ahead.close()


# ---- 2. release is not failure ------------------------------------------------------------------------------------


def test_a_graceful_release_is_not_an_attempt_and_a_reclaim_is(ledger_location, job_name):
    ledger = Ledger(ledger_location, job_name)
    try:
        ledger.ensure_job(2, 2)
        for _ in range(5):  # scaled down five times while holding the shard
            lease = ledger.lease("w", lease_ttl_s=60, max_attempts=2)
            assert isinstance(lease, Lease) and lease.attempt == 1
            ledger.release("w")
        [shard] = ledger.shards()
        assert (shard.state, shard.attempts, shard.owner) == (TODO, 0, None)
        # a worker that died: its lease is taken over at once, and counts
        first = ledger.lease("w", lease_ttl_s=60, max_attempts=2)
        ledger.reclaim("w")
        second = ledger.lease("v", lease_ttl_s=60, max_attempts=2)
        assert isinstance(second, Lease) and (second.shard_id, second.attempt) == (first.shard_id, 2)
        ledger.reclaim("v")
        half = ledger.lease("u", lease_ttl_s=60, max_attempts=2)  # two deaths: bisected
        assert (half.start_row, half.end_row, half.attempt) == (0, 1, 1)
        assert SPLIT in {s.state for s in ledger.shards()}
    finally:
        ledger.close()


class _LedgerWorker(threading.Thread):
    """Leases shards and "predicts" their rows (3 * row + 1) one by one; told to stop, it hands its lease back."""

    def __init__(self, location: str, job: str, name: str, output: list, lock: threading.Lock) -> None:
        super().__init__(name=name, daemon=True)
        self.location, self.job, self.output, self.lock = location, job, output, lock
        self.stop_now = threading.Event()
        self.mid_shard = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        ledger = Ledger(self.location, self.job)
        try:
            while not self.stop_now.is_set():
                lease = ledger.lease(self.name, lease_ttl_s=60, max_attempts=3)
                if lease is LeaseWait.DONE:
                    return
                if lease is LeaseWait.WAIT:
                    time.sleep(0.01)
                    continue
                rows = {}
                for row in range(lease.start_row, lease.end_row):
                    if self.stop_now.is_set():
                        break
                    rows[row] = 3 * row + 1
                    self.mid_shard.set()
                    time.sleep(0.001)
                else:
                    self.mid_shard.clear()
                    if ledger.commit(lease.shard_id, self.name, len(rows), 0, "f") is CommitResult.COMMITTED:
                        with self.lock:
                            self.output.append(rows)
            ledger.release(self.name)  # scaled down: a graceful stop
        except BaseException as exc:
            self.error = exc
        finally:
            ledger.close()


@pytest.mark.timeout(300)
def test_twenty_rounds_of_scaling_three_workers_down_to_one_and_up_again(ledger_location, job_name):
    rows = 4000
    Ledger(ledger_location, job_name).ensure_job(rows, 20)
    output: list[dict] = []
    lock = threading.Lock()
    started: list[_LedgerWorker] = []

    def start(name: str) -> _LedgerWorker:
        worker = _LedgerWorker(ledger_location, job_name, name, output, lock)
        worker.start()
        started.append(worker)
        return worker

    steady = start("steady")
    others = [start("a0"), start("b0")]
    for round_ in range(1, 21):
        for worker in others:  # each is stopped in the middle of a shard it holds
            assert worker.mid_shard.wait(timeout=60), f"{worker.name} never started a shard"
            worker.stop_now.set()
        for worker in others:
            worker.join(timeout=60)
        others = [start(f"a{round_}"), start(f"b{round_}")]
    for worker in [steady, *others]:
        worker.join(timeout=120)
    assert [w.error for w in started if w.error is not None] == []
    assert not any(w.is_alive() for w in started)

    ledger = Ledger(ledger_location, job_name)
    shards = ledger.shards()
    ledger.close()
    states = {s.state for s in shards}
    assert SPLIT not in states and POISONED not in states and states == {COMMITTED}
    assert max(s.attempts for s in shards) == 1
    written = [row for part in output for row in part]
    assert sorted(written) == list(range(rows)) and len(written) == rows  # each row once
    assert all(value == 3 * row + 1 for part in output for row, value in part.items())


@pytest.mark.timeout(120)
def test_replicas_the_supervisor_stops_hand_their_shards_back_and_a_crashed_ones_count(tmp_path):
    """``run_replicas``: a replica that crashed holding a shard loses it as an attempt; the replica the supervisor
    kills when it gives up hands its shard back, not counted."""
    location, job = str(tmp_path / "ledger.sqlite"), "replicas"
    Ledger(location, job).ensure_job(4, 2)

    def replica(context) -> None:
        ledger = Ledger(location, job)
        _register(ledger, context.worker_name)
        ledger.lease(context.worker_name, lease_ttl_s=600)
        if context.slot == 0:
            time.sleep(600)  # works until the supervisor stops it
        while len(ledger.shards((LEASED,))) < 2:  # the other replica holds its shard too
            time.sleep(0.02)
        os._exit(3)  # dies holding its shard

    with pytest.raises(ReplicaFailedError):
        run_replicas(replica, replicas_per_device=2, max_restarts=0, ledger=location, job=job, start_method="fork")
    ledger = Ledger(location, job)
    try:
        shards = {(s.owner, s.state, s.attempts) for s in ledger.shards()}
        assert (None, TODO, 0) in shards  # stopped by the supervisor: handed back
        expired = [s for s in ledger.shards((LEASED,)) if s.lease_expires < ledger.now()]
    finally:
        ledger.close()
    assert len(expired) == 1 and expired[0].owner.endswith("replica1-r0") and expired[0].attempts == 1


# ---- 9. recovery without waiting out a lease ---------------------------------------------------------------------


def _hold_a_lease(location: str, job: str, ttl: float, heartbeat_s: float, ready) -> None:
    """A worker that registers, leases a shard, renews it and works on it until it is killed."""
    ledger = Ledger(location, job)
    _register(ledger, "doomed")
    lease = ledger.lease("doomed", lease_ttl_s=ttl)
    beat = Heartbeat(lambda: Ledger(location, job), "doomed", ttl, heartbeat_s, 600.0, ProgressClock())
    beat.start()
    ready.send(lease.shard_id)
    while True:
        beat.clock.touch()
        time.sleep(0.05)


def _start_doomed(location: str, job: str, ttl: float, heartbeat_s: float):
    receive, send = _FORK.Pipe(duplex=False)
    proc = _FORK.Process(target=_hold_a_lease, args=(location, job, ttl, heartbeat_s, send), daemon=True)
    proc.start()
    assert receive.poll(60), "the worker did not lease its shard"
    return proc, receive.recv()


def _wait_for_lease(ledger: Ledger, owner: str, ttl: float, timeout_s: float) -> tuple[object, float]:
    killed = time.monotonic()
    while True:
        lease = ledger.lease(owner, lease_ttl_s=ttl)
        waited = time.monotonic() - killed
        if isinstance(lease, Lease) or waited > timeout_s:
            return lease, waited
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_a_killed_worker_on_the_same_host_loses_its_shard_at_once_and_it_counts(ledger_location, job_name):
    """kill -9 of a worker holding a 60 s lease: a worker on the same machine finds its process gone (not yet reaped
    by its parent: a zombie) and takes the shard over within a second; the death counts as an attempt."""
    ttl = 60.0
    ledger = Ledger(ledger_location, job_name)
    ledger.ensure_job(2, 2)
    _register(ledger, "survivor")
    proc, shard_id = _start_doomed(ledger_location, job_name, ttl, heartbeat_s=0.2)
    try:
        assert ledger.lease("survivor", lease_ttl_s=ttl) is LeaseWait.WAIT  # alive: its lease stays
        os.kill(proc.pid, signal.SIGKILL)
        lease, waited = _wait_for_lease(ledger, "survivor", ttl, timeout_s=10)
        assert isinstance(lease, Lease), f"the dead worker's shard was not free after {waited:.1f} s"
        assert waited < 2.0 and lease.shard_id == shard_id and lease.attempt == 2
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=30)
        ledger.close()


@pytest.mark.timeout(120)
def test_a_killed_worker_on_another_host_loses_its_shard_when_its_short_lease_expires(ledger_location, job_name):
    """Across hosts only heartbeats count: the pid of another machine is never looked up here, and the shard moves
    once the lease of a few heartbeats runs out."""
    ttl, heartbeat_s = 1.5, 0.25
    ledger = Ledger(ledger_location, job_name)
    ledger.ensure_job(2, 2)
    _register(ledger, "survivor")
    proc, shard_id = _start_doomed(ledger_location, job_name, ttl, heartbeat_s)
    try:
        with ledger.db.transaction(job_name) as tx:  # its entry now names another machine
            tx.execute("UPDATE paro_predict_processes SET process_space = 'another-boot/pid:[1]' WHERE owner = $1",
                       ("doomed",))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=30)  # reaped: its pid does not exist here any more either
        [held] = ledger.shards((LEASED,))
        assert ledger.lease("survivor", lease_ttl_s=ttl) is LeaseWait.WAIT
        lease, waited = _wait_for_lease(ledger, "survivor", ttl, timeout_s=30)
        assert isinstance(lease, Lease) and lease.shard_id == shard_id and lease.attempt == 2
        # taken when the last renewal's lease ran out on the database's clock, not before, and within the lease
        assert ledger.now() >= held.lease_expires and waited < ttl + 10
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=30)
        ledger.close()


def test_a_reused_pid_is_a_dead_worker_and_a_live_one_is_not(ledger_location, job_name):
    ledger = Ledger(ledger_location, job_name)
    try:
        ledger.ensure_job(4, 2)
        _register(ledger, "live")
        _register(ledger, "reused")
        ledger.lease("live", lease_ttl_s=60)
        ledger.lease("reused", lease_ttl_s=60)
        with ledger.db.transaction(job_name) as tx:  # this pid, but a process that started at another time
            tx.execute("UPDATE paro_predict_processes SET pid_started = pid_started - 1 WHERE job = $1 AND owner = $2",
                       (job_name, "reused"))
        assert ledger.reclaim_dead_neighbours() == ["reused"]
        assert ledger.reclaim_dead_neighbours() == []  # its leases are expired now: nothing more to reclaim
        taken = ledger.lease("next", lease_ttl_s=60)
        assert isinstance(taken, Lease) and (taken.start_row, taken.attempt) == (2, 2)
    finally:
        ledger.close()


def test_progress_counts_shards_waiting_on_a_dead_worker_in_the_eta(ledger_location, job_name):
    ledger = Ledger(ledger_location, job_name)
    try:
        ledger.ensure_job(40, 10)
        _register(ledger, "a")
        _register(ledger, "dead")
        for _ in range(3):
            lease = ledger.lease("a", lease_ttl_s=20)
            pass_time(ledger, 2)
            ledger.commit(lease.shard_id, "a", 10, 0, "f")
        ledger.lease("dead", lease_ttl_s=20)
        pass_time(ledger, 12)  # silent for 12 s with 8 s of its lease left: presumed dead
        [held] = ledger.shards((LEASED,))
        # read as of 12 s after that lease on the database's clock (the test itself takes time on a busy machine)
        progress = read_progress(ledger, now=held.leased_at + 12)
        assert (progress.waiting_shards, progress.waiting_rows, progress.active_workers) == (1, 10, 0)
        assert progress.waiting_free_in_s == pytest.approx(8)
        rate = progress.rows_per_s
        # 10 rows left: not 10 / rate away, but after the lease runs out and one worker redoes them
        assert progress.eta_s == pytest.approx(progress.waiting_free_in_s + 10 / rate)
        assert progress.eta_s > 10 / rate + 7
        assert "1 shard waiting on dead workers" in progress.summary()
        ledger.renew("dead", lease_ttl_s=20)  # it was only slow: renewed, no longer waiting
        assert read_progress(ledger).waiting_shards == 0
    finally:
        ledger.close()


@pytest.mark.timeout(180)
def test_a_worker_sent_sigterm_hands_its_shard_back_without_an_attempt(tmp_path):
    """SIGTERM (a scale-down by Kubernetes, torchrun or SLURM) stops a Lightning worker at its next batch; its shard
    goes back to todo, not counted, and a worker started later completes the job exactly."""
    from predict_app import JobSpec, run_job
    from predict_procs import Workers, assert_exact_output

    out = tmp_path / "out"
    spec = JobSpec(output_dir=str(out), rows=600, batch_size=10, shard_size=100, step_sleep_s=0.05,
                   lease_ttl_s=30.0, worker_name="leaving")
    workers = Workers()
    try:
        proc = workers.start(spec)
        ledger = None
        deadline = time.monotonic() + 60
        while True:  # wait until it is in the middle of a shard
            assert time.monotonic() < deadline, "the worker never leased a shard"
            if ledger is None and (out / "_ledger.sqlite").exists():
                ledger = Ledger(str(out / "_ledger.sqlite"), str(out.resolve()))
            if ledger is not None and ledger.job_shape() is not None and ledger.shards((LEASED,)):
                break
            time.sleep(0.05)
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(timeout=20)
        assert not proc.is_alive(), "the worker went on working after SIGTERM"
        assert proc.exitcode == 1  # the test app's code for a trainer.predict that raised (SIGTERMException)
        shards = ledger.shards()
        assert not [s for s in shards if s.state == LEASED]
        assert [s.attempts for s in shards if s.state == TODO] == [0] * sum(s.state == TODO for s in shards)
        assert any(s.state == TODO for s in shards), "the job ended before the worker was stopped"
        ledger.close()
        run_job(JobSpec(**{**spec.__dict__, "worker_name": "next", "step_sleep_s": 0.0}))
        assert_exact_output(out, 600)
        final = Ledger(str(out / "_ledger.sqlite"), str(out.resolve()))
        assert max(s.attempts for s in final.shards()) == 1
        final.close()
    finally:
        workers.cleanup()
