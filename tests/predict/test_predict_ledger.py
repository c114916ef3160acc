"""The shard ledger, run against both SQLite and PostgreSQL."""

from __future__ import annotations

import threading

import pytest

from lightning_paro.predict.db import LedgerUnavailableError, redact_url
from lightning_paro.predict.ledger import (
    COMMITTED,
    POISONED,
    SPLIT,
    CommitResult,
    JobMismatchError,
    Lease,
    Ledger,
    LeaseWait,
)
from ledger_time import pass_time


def make(location, job) -> Ledger:
    return Ledger(location, job)


def test_ensure_job_creates_shards_once_and_rejects_a_different_shape(ledger_location, job_name):
    ledger = make(ledger_location, job_name)
    assert ledger.ensure_job(10, 4) is True
    assert ledger.ensure_job(10, 4) is False
    assert [(s.start_row, s.end_row) for s in ledger.shards()] == [(0, 4), (4, 8), (8, 10)]
    assert ledger.job_shape() == (10, 4)
    with pytest.raises(JobMismatchError, match="11 rows"):
        ledger.ensure_job(11, 4)
    ledger.close()


def test_jobs_are_isolated_from_each_other(ledger_location, job_name):
    a, b = make(ledger_location, job_name + "a"), make(ledger_location, job_name + "b")
    a.ensure_job(4, 2)
    b.ensure_job(6, 3)
    assert len(a.shards()) == 2 and len(b.shards()) == 2
    assert [s.end_row for s in b.shards()] == [3, 6]


def test_leases_are_exclusive_until_they_expire(ledger_location, job_name):
    ledger = make(ledger_location, job_name)
    ledger.ensure_job(4, 2)
    first = ledger.lease("a", lease_ttl_s=10)
    second = ledger.lease("b", lease_ttl_s=10)
    assert isinstance(first, Lease) and isinstance(second, Lease)
    assert (first.start_row, second.start_row) == (0, 2)
    assert ledger.lease("c", lease_ttl_s=10) is LeaseWait.WAIT
    # a heartbeat keeps a's lease alive, b goes silent
    pass_time(ledger, 8)
    assert ledger.renew("a", lease_ttl_s=10) == 1
    pass_time(ledger, 5)
    taken = ledger.lease("c", lease_ttl_s=10)
    assert isinstance(taken, Lease)
    assert (taken.shard_id, taken.attempt) == (second.shard_id, 2)
    assert ledger.lease("d", lease_ttl_s=10) is LeaseWait.WAIT


def test_first_commit_wins_and_done_is_reported(ledger_location, job_name):
    ledger = make(ledger_location, job_name)
    ledger.ensure_job(2, 2)
    lease = ledger.lease("a", lease_ttl_s=1)
    pass_time(ledger, 5)  # a hangs, its lease expires, b redoes the shard
    redo = ledger.lease("b", lease_ttl_s=1)
    assert redo.shard_id == lease.shard_id
    assert ledger.commit(lease.shard_id, "b", 2, 0, "part.parquet") is CommitResult.COMMITTED
    assert ledger.commit(lease.shard_id, "a", 2, 0, "part.parquet") is CommitResult.ALREADY_COMMITTED
    [record] = ledger.shards()
    assert (record.state, record.committed_by, record.rows_written) == (COMMITTED, "b", 2)
    assert ledger.lease("c", lease_ttl_s=1) is LeaseWait.DONE


def test_repeated_failures_split_the_shard_down_to_a_poisoned_row(ledger_location, job_name):
    ledger = make(ledger_location, job_name)
    ledger.ensure_job(2, 2)
    bad_row = 1
    for _ in range(20):
        lease = ledger.lease("w", lease_ttl_s=1, max_attempts=2)
        if lease is LeaseWait.DONE:
            break
        if lease.start_row <= bad_row < lease.end_row:
            pass_time(ledger, 2)  # the worker dies on the bad row: the lease just expires
        else:
            assert ledger.commit(lease.shard_id, "w", lease.end_row - lease.start_row, 0, "f") is CommitResult.COMMITTED
    states = {(s.start_row, s.end_row): s.state for s in ledger.shards()}
    assert states == {(0, 2): SPLIT, (0, 1): COMMITTED, (1, 2): POISONED}
    [poisoned] = ledger.shards((POISONED,))
    assert "row 1" in poisoned.error and poisoned.rows_failed == 1
    assert ledger.failed_rows() == 1


def test_commit_of_a_split_shard_is_superseded(ledger_location, job_name):
    ledger = make(ledger_location, job_name)
    ledger.ensure_job(4, 4)
    stale = ledger.lease("a", lease_ttl_s=1, max_attempts=1)
    pass_time(ledger, 2)
    child = ledger.lease("b", lease_ttl_s=1, max_attempts=1)  # splits the parent
    assert (child.start_row, child.end_row) == (0, 2)
    assert ledger.commit(stale.shard_id, "a", 4, 0, "f") is CommitResult.SUPERSEDED


def test_tail_shards_are_speculatively_shared(ledger_location, job_name):
    ledger = make(ledger_location, job_name)
    ledger.ensure_job(4, 2)
    slow = ledger.lease("slow", lease_ttl_s=100)
    fast = ledger.lease("fast", lease_ttl_s=100)
    ledger.commit(fast.shard_id, "fast", 2, 0, "f")
    assert ledger.lease("fast", lease_ttl_s=100, speculate_after_s=5) is LeaseWait.WAIT  # too early
    pass_time(ledger, 6)
    dup = ledger.lease("fast", lease_ttl_s=100, speculate_after_s=5)
    assert isinstance(dup, Lease) and dup.speculative and dup.shard_id == slow.shard_id
    # only one speculative copy at a time
    assert ledger.lease("third", lease_ttl_s=100, speculate_after_s=5) is LeaseWait.WAIT
    assert ledger.commit(dup.shard_id, "fast", 2, 0, "f") is CommitResult.COMMITTED
    assert ledger.commit(slow.shard_id, "slow", 2, 0, "f") is CommitResult.ALREADY_COMMITTED


def test_release_lets_others_take_the_shards_at_once(ledger_location, job_name):
    ledger = make(ledger_location, job_name)
    ledger.ensure_job(2, 2)
    ledger.lease("a", lease_ttl_s=100)
    assert ledger.lease("b", lease_ttl_s=100) is LeaseWait.WAIT
    ledger.release("a")
    assert isinstance(ledger.lease("b", lease_ttl_s=100), Lease)


def test_concurrent_workers_never_share_a_lease(ledger_location, job_name):
    Ledger(ledger_location, job_name).ensure_job(200, 5)
    taken: dict[str, list[int]] = {}

    def worker(name: str) -> None:
        ledger = Ledger(ledger_location, job_name)
        mine = taken.setdefault(name, [])
        while True:
            lease = ledger.lease(name, lease_ttl_s=300)
            if lease is LeaseWait.DONE:
                break
            assert isinstance(lease, Lease)
            mine.append(lease.shard_id)
            assert ledger.commit(lease.shard_id, name, 5, 0, "f") is CommitResult.COMMITTED
        ledger.close()

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    all_ids = sorted(i for ids in taken.values() for i in ids)
    assert all_ids == list(range(40))


def test_unreachable_postgres_is_a_clear_error_without_the_password(tmp_path):
    url = f"postgresql://alice:s3cret@/nodb?host={tmp_path}/nowhere&connect_timeout=1"
    with pytest.raises(LedgerUnavailableError) as info:
        Ledger(url, "job")
    assert "s3cret" not in str(info.value)
    assert "alice:***@" in str(info.value)


def test_unopenable_sqlite_ledger_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(LedgerUnavailableError, match="SQLite prediction ledger"):
        Ledger(str(blocker / "ledger.sqlite"), "job")


@pytest.mark.timeout(30)
def test_sqlite_ledger_opens_while_a_peer_holds_the_fresh_file_locked(tmp_path):
    """Two workers opening a new ledger at once: the second waits for the first's write lock, it does not fail."""
    import sqlite3

    path = tmp_path / "ledger.sqlite"
    peer = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    peer.execute("CREATE TABLE t (x INTEGER)")
    peer.execute("BEGIN IMMEDIATE")  # a write lock on a file still in rollback-journal mode
    peer.execute("INSERT INTO t VALUES (1)")
    releaser = threading.Timer(0.3, lambda: peer.execute("COMMIT"))
    releaser.start()
    try:
        ledger = Ledger(str(path), "job")
    finally:
        releaser.join()
        peer.close()
    ledger.ensure_job(10, 5)
    assert len(ledger.shards()) == 2
    check = sqlite3.connect(str(path))
    assert check.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    check.close()
    ledger.close()


def test_redact_url_hides_passwords():
    assert redact_url("postgresql://u:pw@h:5/db") == "postgresql://u:***@h:5/db"
    assert redact_url("postgresql://h/db?password=pw&x=1") == "postgresql://h/db?password=***&x=1"
    assert redact_url("postgresql://u@h/db") == "postgresql://u@h/db"



@pytest.mark.timeout(60)
def test_a_forked_child_keeps_the_parents_sqlite_connections(tmp_path):
    """A DataLoader worker forks while another thread (the heartbeat) may be inside SQLite and hold its mutex: the
    child must never free the inherited connection (that would wait on the mutex forever), so it keeps a reference."""
    import gc
    import os
    import time

    from lightning_paro.predict import db as db_module

    db = db_module.Database(str(tmp_path / "ledger.sqlite"))
    inherited = db._conn._conn
    pid = os.fork()
    if pid == 0:  # the child: drop its own references, collect, and report whether the connection is still held
        kept = any(c is inherited for c in db_module._inherited_sqlite)
        del db, inherited
        gc.collect()
        os._exit(0 if kept else 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        status = None
    assert status == 0, "the forked child did not keep the parent's SQLite connection"
    assert not any(c is inherited for c in db_module._inherited_sqlite)  # the parent's own list stays empty
    db.close()
