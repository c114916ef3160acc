"""A lease costs the same however many shards of the job are already committed.

Measured deterministically on SQLite: the number of virtual-machine instructions the ledger's statements execute
(SQLite's progress handler, called at every instruction), and the query plans of those statements.
"""

from __future__ import annotations

import pytest

from lightning_paro.predict.ledger import COMMITTED, LEASED, TODO, Lease, Ledger, LeaseWait
from ledger_time import pass_time


def _job(tmp_path, name: str, shards: int, committed: int, leased_by_other: int = 0) -> Ledger:
    """A job of ``shards`` one-row shards, the first ``committed`` committed, the next ``leased_by_other`` leased."""
    ledger = Ledger(str(tmp_path / f"{name}.sqlite"), "job")
    ledger.ensure_job(shards, 1)
    with ledger.db.transaction("job") as tx:
        tx.execute(
            "UPDATE paro_predict_shards SET state = $1, rows_written = 1, rows_failed = 0, file = 'f', "
            "committed_at = 1.0, committed_by = 'w0' WHERE job = $2 AND shard_id < $3",
            (COMMITTED, "job", committed),
        )
        tx.execute(
            "UPDATE paro_predict_shards SET state = $1, owner = 'other', lease_expires = 1e12, leased_at = 1.0, "
            "attempts = 1 WHERE job = $2 AND shard_id >= $3 AND shard_id < $4",
            (LEASED, "job", committed, committed + leased_by_other),
        )
    return ledger


class _Meter:
    """Counts SQLite VM instructions and records the statements run on one ledger connection."""

    def __init__(self, ledger: Ledger) -> None:
        self.conn = ledger.db._conn._conn  # the sqlite3 connection under the autocommit shim
        self.steps = 0
        self.statements: list[str] = []

    def __enter__(self) -> "_Meter":
        def tick() -> int:
            self.steps += 1
            return 0

        self.conn.set_progress_handler(tick, 1)
        self.conn.set_trace_callback(self.statements.append)
        return self

    def __exit__(self, *exc) -> None:
        self.conn.set_progress_handler(None, 1)
        self.conn.set_trace_callback(None)

    def plans(self) -> dict:
        """The query plan of every data statement recorded (parameters already expanded by the trace)."""
        out = {}
        for sql in self.statements:
            if sql.split()[0].upper() in {"SELECT", "UPDATE", "DELETE"}:
                out[sql] = [row[3] for row in self.conn.execute("EXPLAIN QUERY PLAN " + sql).fetchall()]
        return out


def _lease_and_commit_steps(ledger: Ledger) -> tuple[int, int, _Meter]:
    with _Meter(ledger) as lease_meter:
        lease = ledger.lease("me", lease_ttl_s=60.0)
    assert isinstance(lease, Lease)
    with _Meter(ledger) as commit_meter:
        ledger.commit(lease.shard_id, "me", 1, 0, "file")
    return lease_meter.steps, commit_meter.steps, lease_meter



def test_lease_and_commit_cost_the_same_at_100_and_at_10000_committed_shards(tmp_path):
    small = _job(tmp_path, "small", shards=200, committed=100)
    large = _job(tmp_path, "large", shards=10_100, committed=10_000)
    try:
        small_lease, small_commit, _ = _lease_and_commit_steps(small)
        large_lease, large_commit, meter = _lease_and_commit_steps(large)
        # a scan of the committed shards would cost 100x more at 10,000; index lookups cost a few more steps
        # per level of the B-tree (one more level at most)
        assert large_lease <= 1.5 * small_lease, (small_lease, large_lease)
        assert large_commit <= 1.5 * small_commit, (small_commit, large_commit)
        for sql, plan in meter.plans().items():
            assert all("SCAN" not in step and "TEMP B-TREE" not in step for step in plan), (sql, plan)
    finally:
        small.close()
        large.close()


@pytest.mark.parametrize("leased_by_other, expected", [(0, LeaseWait.DONE), (3, LeaseWait.WAIT)])
def test_a_lease_that_finds_nothing_costs_the_same_at_100_and_at_10000_committed_shards(
    tmp_path, leased_by_other, expected
):
    small = _job(tmp_path, "small", shards=100 + leased_by_other, committed=100, leased_by_other=leased_by_other)
    large = _job(tmp_path, "large", shards=10_000 + leased_by_other, committed=10_000, leased_by_other=leased_by_other)
    try:
        with _Meter(small) as small_meter:
            assert small.lease("me", lease_ttl_s=60.0) is expected
        with _Meter(large) as large_meter:
            assert large.lease("me", lease_ttl_s=60.0) is expected
        assert large_meter.steps <= 1.5 * small_meter.steps, (small_meter.steps, large_meter.steps)
        for sql, plan in large_meter.plans().items():
            assert all("SCAN" not in step and "TEMP B-TREE" not in step for step in plan), (sql, plan)
        assert not any("COUNT(" in sql.upper() for sql in large_meter.statements)
    finally:
        small.close()
        large.close()


def test_renew_costs_the_same_at_100_and_at_10000_committed_shards(tmp_path):
    small = _job(tmp_path, "small", shards=101, committed=100)
    large = _job(tmp_path, "large", shards=10_001, committed=10_000)
    try:
        steps = []
        for ledger in (small, large):
            assert isinstance(ledger.lease("me", lease_ttl_s=60.0), Lease)
            with _Meter(ledger) as meter:
                assert ledger.renew("me", lease_ttl_s=60.0) == 1
            steps.append(meter.steps)
        assert steps[1] <= 1.5 * steps[0], steps
    finally:
        small.close()
        large.close()


def test_the_state_index_leaves_the_shards_in_row_order(tmp_path):
    ledger = _job(tmp_path, "order", shards=50, committed=10)
    try:
        leases = [ledger.lease(f"w{i}", lease_ttl_s=5.0) for i in range(3)]
        assert [l.start_row for l in leases] == [10, 11, 12]
        pass_time(ledger, 10)  # all three expired: the earliest rows come back first, before later todo rows
        again = ledger.lease("w9", lease_ttl_s=5.0)
        assert again.start_row == 10 and again.attempt == 2
        assert {s.state for s in ledger.shards() if s.start_row >= 13} == {TODO}
    finally:
        ledger.close()


def test_postgres_plans_of_lease_commit_and_renew_use_indexes_not_scans(postgres_url, job_name, monkeypatch):
    """On PostgreSQL: every statement a lease, a commit, a renewal and a done/wait answer run is planned as an
    index lookup (no sequential scan of the shards, no sort) on a job with 10,000 of 10,100 shards committed."""
    from lightning_paro.predict import db as db_module

    ledger = Ledger(postgres_url, job_name)
    try:
        ledger.ensure_job(10_100, 1)
        with ledger.db.transaction(job_name) as tx:
            tx.execute(
                "UPDATE paro_predict_shards SET state = $1, committed_at = 1.0 WHERE job = $2 AND shard_id < $3",
                (COMMITTED, job_name, 10_000),
            )
        # no ANALYZE here: the statistics are those ensure_job left (every shard todo)
        seen: list = []
        for name in ("execute", "fetchone"):
            original = getattr(db_module._Transaction, name)

            def recording(self, statement, params=(), _original=original):
                seen.append((statement, tuple(params)))
                return _original(self, statement, params)

            monkeypatch.setattr(db_module._Transaction, name, recording)
        lease = ledger.lease("me", lease_ttl_s=60.0)
        ledger.renew("me", lease_ttl_s=60.0)
        ledger.commit(lease.shard_id, "me", 1, 0, "file")
        for i in range(99):
            ledger.commit(ledger.lease("me", lease_ttl_s=60.0).shard_id, "me", 1, 0, "file")
        assert ledger.lease("me", lease_ttl_s=60.0) is LeaseWait.DONE
        monkeypatch.undo()
        # the shard table's statements (the workers table has one row per worker)
        statements = {s: p for s, p in seen
                      if s.split()[0].upper() in {"SELECT", "UPDATE", "DELETE"} and "paro_predict_shards" in s}
        assert any("FOR UPDATE SKIP LOCKED" in s for s in statements)
        for statement, params in statements.items():
            plan = "\n".join(r[0] for r in ledger.db.query("EXPLAIN " + statement, params))
            assert "Seq Scan" not in plan and "Sort" not in plan, (statement, plan)
    finally:
        with ledger.db.transaction(job_name) as tx:
            tx.execute("DELETE FROM paro_predict_shards WHERE job = $1", (job_name,))
            tx.execute("DELETE FROM paro_predict_jobs WHERE job = $1", (job_name,))
        ledger.close()


def test_postgres_jobs_do_not_wait_for_each_others_locks(postgres_url, job_name):
    """A transaction holding one job's lock (as job creation and shard splits do) leaves other jobs running."""
    import threading

    busy = Ledger(postgres_url, job_name + "-busy")
    other = Ledger(postgres_url, job_name + "-other")
    done = threading.Event()
    try:
        busy.ensure_job(10, 5)
        with busy.db.transaction(busy.job):  # holds the busy job's advisory lock until the block ends

            def work() -> None:
                other.ensure_job(10, 5)
                lease = other.lease("w", lease_ttl_s=30.0)
                other.commit(lease.shard_id, "w", 5, 0, "f")
                done.set()

            thread = threading.Thread(target=work, daemon=True)
            thread.start()
            assert done.wait(timeout=20), "the other job waited for the busy job's lock"
        thread.join(timeout=20)
    finally:
        for ledger in (busy, other):
            with ledger.db.transaction(ledger.job) as tx:
                tx.execute("DELETE FROM paro_predict_shards WHERE job = $1", (ledger.job,))
                tx.execute("DELETE FROM paro_predict_jobs WHERE job = $1", (ledger.job,))
            ledger.close()
