"""The shard ledger: the job's single source of truth about which rows are done, leased or failed.

Shards are half-open row ranges ``[start_row, end_row)`` of the dataset's index space. A shard is
``todo``, ``leased`` (to an owner until an expiry that heartbeats push forward), ``committed`` (its
output file is on disk), ``poisoned`` (its single row crashed its worker too many times) or
``split`` (replaced by two halves after repeated failures, so a row that kills workers is isolated
by bisection instead of sinking its whole shard).

Every time in the ledger is the database's (``Dialect.now``): a lease's expiry is written and compared on one clock,
so a worker whose own clock is off never takes a live lease or loses its own. A lease handed back gracefully
(``release``) is not an attempt; one that expired, or whose dead worker's process was found gone
(``reclaim``, ``reclaim_dead_neighbours``), is.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from enum import Enum
from typing import Optional, Sequence, Union

from lightning_paro.predict.db import POSTGRES, Database
from lightning_paro.predict.processes import local_process_space, process_gone, process_started
from lightning_paro.predict.ledger_tables import (  # the states and ShardRecord: imported through here too
    COMMITTED,
    LAST_SCHEMA_OBJECT,
    LEASED,
    POISONED,
    SCHEMA,
    SHARD_COLUMNS,
    SHARD_FIELDS,
    SHARD_INSERT_COLUMNS,
    SPLIT,
    TODO,
    ShardRecord,
)

log = logging.getLogger(__name__)


class JobMismatchError(RuntimeError):
    """The ledger already holds a job under this name with a different shape."""


@dataclass(frozen=True)
class Lease:
    """A shard handed to one worker."""

    shard_id: int
    """The shard's id in the ledger."""
    start_row: int
    """First row index of the shard (inclusive)."""
    end_row: int
    """Row index one past the shard's last row."""
    attempt: int
    """This lease and the earlier ones that ended in a failure (not those handed back gracefully)."""
    speculative: bool
    """True when this is a tail duplicate of a shard another worker still holds."""


class LeaseWait(Enum):
    """Why ``Ledger.lease`` returned no shard."""

    WAIT = "wait"
    """Nothing free now, but other workers hold leases that may still expire or fail."""
    DONE = "done"
    """Every shard is committed or poisoned."""


class CommitResult(Enum):
    """What happened to a commit."""

    COMMITTED = "committed"
    """This call committed the shard."""
    ALREADY_COMMITTED = "already_committed"
    """Another attempt (a redo or a speculative duplicate) committed it first."""
    SUPERSEDED = "superseded"
    """The shard was split or poisoned meanwhile: this output must not become visible."""


def describe_input_change(stored: list, given: list, limit: int = 3) -> str:
    """What differs between two unit lists (``[[id, rows, fingerprint], ...]``), in a few words; "" if nothing."""
    old = {u[0]: (int(u[1]), str(u[2])) for u in stored}
    new = {u[0]: (int(u[1]), str(u[2])) for u in given}
    changes = [f"{uid} removed" for uid in old if uid not in new]
    changes += [f"{uid} added" for uid in new if uid not in old]
    for uid, (rows, fingerprint) in new.items():
        if uid in old and old[uid] != (rows, fingerprint):
            was_rows, was_fp = old[uid]
            what = [f"rows {was_rows} -> {rows}"] if was_rows != rows else []
            what += [f"{was_fp or 'none'} -> {fingerprint or 'none'}"] if was_fp != fingerprint else []
            changes.append(f"{uid}: {', '.join(what)}")
    if not changes and [u[0] for u in stored] != [u[0] for u in given]:
        changes.append("the same units in a different order")
    shown = "; ".join(changes[:limit])
    return shown + (f"; and {len(changes) - limit} more" if len(changes) > limit else "")


class Ledger:
    """Leases, renews, commits and reports the shards of one prediction job.

    Args:
        location: a SQLite file path or a ``postgresql://`` URL.
        job: the job's name; several jobs can share one PostgreSQL database.
        clock: this process's own clock (Unix seconds), for pacing local work such as how often a worker reads the
            progress. It is never compared with a time in the ledger: those are all the database's (``now``).
    """

    def __init__(self, location: str, job: str, clock=time.time) -> None:
        self.db = Database(location)
        self.job = job
        self.clock = clock
        self._now = self.db.dialect.now
        try:
            with self.db.transaction(None) as tx:
                if self.db.dialect is POSTGRES and tx.fetchone(f"SELECT to_regclass('{LAST_SCHEMA_OBJECT}')")[0]:
                    # already there: CREATE INDEX IF NOT EXISTS would still lock the shard table against writes
                    return
                for statement in SCHEMA:
                    tx.execute(statement)
        except BaseException:
            self.db.close()
            raise

    @property
    def display_location(self) -> str:
        return self.db.display_location

    def close(self) -> None:
        self.db.close()

    # ---- set-up -------------------------------------------------------------------------------

    def ensure_job(
        self,
        num_rows: int,
        shard_size: int,
        ranges: Optional[Sequence[tuple[int, int]]] = None,
        inputs: Optional[list] = None,
    ) -> bool:
        """Creates the job's shards, or checks that an existing job has the same shape and inputs.

        ``ranges`` replaces the even split into ``shard_size`` rows (a sharded source plans its own
        shards along its units); ``inputs`` are a source's units as ``[[id, rows, fingerprint], ...]``,
        stored so a resume over changed inputs is refused. Returns True if this call created the job.
        Safe to call from many workers at once.
        """
        if num_rows < 0 or shard_size <= 0:
            raise ValueError(f"num_rows must be >= 0 and shard_size > 0, got {num_rows} and {shard_size}")
        if ranges is None:
            ranges = [(start, min(start + shard_size, num_rows)) for start in range(0, num_rows, shard_size)]
        with self.db.transaction(self.job) as tx:
            row = tx.fetchone("SELECT num_rows, shard_size FROM paro_predict_jobs WHERE job = $1", (self.job,))
            if row is not None:
                stored = tx.fetchone("SELECT units FROM paro_predict_inputs WHERE job = $1", (self.job,))
                self._check_inputs(None if stored is None else json.loads(stored[0]), inputs)
                if (int(row[0]), int(row[1])) != (num_rows, shard_size):
                    raise JobMismatchError(
                        f"The ledger at {self.display_location} already holds job {self.job!r} over {row[0]} rows "
                        f"in shards of {row[1]}, but this run has {num_rows} rows in shards of {shard_size}. "
                        "Resume with the same dataset and shard size, or write to a new output directory."
                    )
                return False
            tx.execute(
                "INSERT INTO paro_predict_jobs (job, num_rows, shard_size, created_at) "
                f"VALUES ($1, $2, $3, {self._now})",
                (self.job, num_rows, shard_size),
            )
            if inputs is not None:
                tx.execute("INSERT INTO paro_predict_inputs (job, units) VALUES ($1, $2)",
                           (self.job, json.dumps(inputs)))
            # one bulk insert in the same transaction (COPY on PostgreSQL): 100,000 shards in about a second
            tx.insert_rows(
                "paro_predict_shards",
                SHARD_INSERT_COLUMNS,
                ((self.job, i, start, end, TODO, 0) for i, (start, end) in enumerate(ranges)),
            )
        self._refresh_statistics()
        return True

    def _refresh_statistics(self) -> None:
        """On PostgreSQL, brings the planner's statistics up to date after a job's shards were inserted.

        With statistics from before the insert (a few rows per job), PostgreSQL plans a lease as a walk over all
        the job's shards by primary key and a sort, whose cost grows with the job; with fresh statistics it takes
        the state index. Best effort: a failure (a concurrent VACUUM holding the table, no right to analyse it)
        leaves the statistics to autovacuum.
        """
        if self.db.dialect is not POSTGRES:
            return
        try:
            with self.db.transaction(None, exclusive=False) as tx:
                tx.execute("SET LOCAL lock_timeout = '2s'")
                tx.execute("ANALYZE paro_predict_shards")
        except Exception as exc:
            log.info("could not refresh the statistics of the prediction ledger at %s: %s", self.display_location, exc)

    def _check_inputs(self, stored: Optional[list], given: Optional[list]) -> None:
        """Refuses to resume a job whose source units differ from those it started with."""
        fix = "Resume with the inputs the job started with, or give this run a new output_dir (or job_name)."
        if stored is None and given is None:
            return
        if stored is None or given is None:
            started, now = ("a sharded source", "a dataset's index space") if given is None else (
                "a dataset's index space", "a sharded source")
            raise JobMismatchError(
                f"Job {self.job!r} in the ledger at {self.display_location} was started over {started}, but this "
                f"run reads {now}. {fix}"
            )
        change = describe_input_change(stored, given)
        if change:
            raise JobMismatchError(
                f"The inputs of job {self.job!r} changed since it started ({change}), so this is a different job. {fix}"
            )

    def job_shape(self) -> Optional[tuple[int, int]]:
        """``(num_rows, shard_size)`` of the job, or None if it was never created."""
        rows = self.db.query("SELECT num_rows, shard_size FROM paro_predict_jobs WHERE job = $1", (self.job,))
        return (int(rows[0][0]), int(rows[0][1])) if rows else None

    def now(self) -> float:
        """The database's clock (Unix seconds): the time every lease expiry is measured against."""
        return float(self.db.query(f"SELECT {self._now}")[0][0])

    def register_worker(self, owner: str, host: str, pid: int) -> None:
        """Records a worker whose process ``pid`` runs in this process's space (``local_process_space``), with the
        pid's start time, so that a worker in the same space can tell when the process has ended
        (``reclaim_dead_neighbours``)."""
        space = local_process_space()
        started = process_started(pid) if space is not None else None
        with self.db.transaction(self.job) as tx:
            for table in ("paro_predict_workers", "paro_predict_processes"):
                tx.execute(f"DELETE FROM {table} WHERE job = $1 AND owner = $2", (self.job, owner))
            tx.execute(
                "INSERT INTO paro_predict_workers (job, owner, host, pid, started_at, last_seen) "
                f"VALUES ($1, $2, $3, $4, {self._now}, {self._now})",
                (self.job, owner, host, pid),
            )
            tx.execute(
                "INSERT INTO paro_predict_processes (job, owner, process_space, pid, pid_started) "
                "VALUES ($1, $2, $3, $4, $5)",
                (self.job, owner, space, pid, started),
            )

    # ---- leasing ------------------------------------------------------------------------------

    def lease(
        self,
        owner: str,
        lease_ttl_s: float,
        max_attempts: int = 3,
        speculate_after_s: Optional[float] = None,
    ) -> Union[Lease, LeaseWait]:
        """Hands ``owner`` the first free shard (todo, or leased with an expired lease).

        A shard whose ``max_attempts`` leases all ended in a failure (expired or reclaimed; a graceful release does
        not count) is split in two (or, at a single row, poisoned) instead of being handed out again. With nothing
        free and ``speculate_after_s`` set, the oldest lease held by another worker for longer than that is shared
        speculatively; whichever worker commits first wins. With nothing free, the leases of workers in this
        process space whose process has ended are reclaimed first (``reclaim_dead_neighbours``).
        """
        outcome = self._lease(owner, lease_ttl_s, max_attempts, speculate_after_s)
        if outcome is LeaseWait.WAIT and self.reclaim_dead_neighbours():
            outcome = self._lease(owner, lease_ttl_s, max_attempts, speculate_after_s)
        return outcome

    def _lease(
        self, owner: str, lease_ttl_s: float, max_attempts: int, speculate_after_s: Optional[float]
    ) -> Union[Lease, LeaseWait]:
        now = self._now
        # SQLite: the transaction holds the file's write lock. PostgreSQL: workers do not queue for one lock; each
        # candidate row is locked as it is read and rows other workers are leasing right now are skipped
        lock_rows = " FOR UPDATE SKIP LOCKED" if self.db.dialect is POSTGRES else ""
        with self.db.transaction(self.job, exclusive=False) as tx:
            while True:
                # the first free shard in row order: the first todo shard or the first expired lease, each found
                # by one ordered step along the state index (two lookups, never a scan of the job's shards)
                todo = tx.fetchone(
                    "SELECT shard_id, start_row, end_row, attempts FROM paro_predict_shards "
                    "WHERE job = $1 AND state = $2 ORDER BY start_row, shard_id LIMIT 1" + lock_rows,
                    (self.job, TODO),
                )
                expired = tx.fetchone(
                    "SELECT shard_id, start_row, end_row, attempts FROM paro_predict_shards "
                    f"WHERE job = $1 AND state = $2 AND lease_expires < {now} "
                    f"AND (spec_owner IS NULL OR spec_expires < {now}) "
                    "ORDER BY start_row, shard_id LIMIT 1" + lock_rows,
                    (self.job, LEASED),
                )
                candidates = [r for r in (todo, expired) if r is not None]
                if not candidates:
                    break
                row = min(candidates, key=lambda r: (int(r[1]), int(r[0])))
                shard_id, start, end, attempts = (int(v) for v in row)
                if attempts >= max_attempts:
                    self._isolate(tx, shard_id, start, end, attempts)
                    continue
                tx.execute(
                    f"UPDATE paro_predict_shards SET state = $1, owner = $2, lease_expires = {now} + $3, "
                    f"leased_at = {now}, attempts = attempts + 1, spec_owner = NULL, spec_expires = NULL "
                    "WHERE job = $4 AND shard_id = $5",
                    (LEASED, owner, lease_ttl_s, self.job, shard_id),
                )
                return Lease(shard_id, start, end, attempts + 1, speculative=False)

            if speculate_after_s is not None:
                row = tx.fetchone(
                    "SELECT shard_id, start_row, end_row, attempts FROM paro_predict_shards "
                    f"WHERE job = $1 AND state = $2 AND owner <> $3 AND lease_expires >= {now} "
                    f"AND leased_at <= {now} - $4 AND (spec_owner IS NULL OR spec_expires < {now}) "
                    "ORDER BY leased_at, shard_id LIMIT 1" + lock_rows,
                    (self.job, LEASED, owner, speculate_after_s),
                )
                if row is not None:
                    shard_id, start, end, attempts = (int(v) for v in row)
                    tx.execute(
                        f"UPDATE paro_predict_shards SET spec_owner = $1, spec_expires = {now} + $2 "
                        "WHERE job = $3 AND shard_id = $4",
                        (owner, lease_ttl_s, self.job, shard_id),
                    )
                    return Lease(shard_id, start, end, attempts, speculative=True)

            # the job is done when no shard is todo or leased (a todo shard skipped above is being leased by another
            # worker): index probes that stop at the first such shard, not a count of the remaining shards (the
            # ORDER BY keeps PostgreSQL on the state index even when its statistics think most shards are todo)
            for state in (LEASED, TODO):
                if tx.fetchone(
                    "SELECT 1 FROM paro_predict_shards WHERE job = $1 AND state = $2 "
                    "ORDER BY start_row, shard_id LIMIT 1",
                    (self.job, state),
                ) is not None:
                    return LeaseWait.WAIT
            return LeaseWait.DONE

    def _isolate(self, tx, shard_id: int, start: int, end: int, attempts: int) -> None:
        """Splits a repeatedly failing shard in two, or poisons it when it is a single row."""
        if end - start <= 1:
            tx.execute(
                "UPDATE paro_predict_shards SET state = $1, rows_failed = $2, error = $3 "
                "WHERE job = $4 AND shard_id = $5",
                (
                    POISONED,
                    end - start,
                    f"row {start}: {attempts} attempts ended without a commit (the worker died, hung or was "
                    "killed while predicting this row)",
                    self.job,
                    shard_id,
                ),
            )
            return
        mid = (start + end) // 2
        tx.lock()  # new shard ids are allocated one job-wide transaction at a time
        next_id = int(tx.fetchone("SELECT MAX(shard_id) FROM paro_predict_shards WHERE job = $1", (self.job,))[0]) + 1
        tx.execute("UPDATE paro_predict_shards SET state = $1 WHERE job = $2 AND shard_id = $3",
                   (SPLIT, self.job, shard_id))
        tx.executemany(
            "INSERT INTO paro_predict_shards (job, shard_id, start_row, end_row, state, attempts, parent) "
            "VALUES ($1, $2, $3, $4, $5, 0, $6)",
            [(self.job, next_id, start, mid, TODO, shard_id), (self.job, next_id + 1, mid, end, TODO, shard_id)],
        )

    def renew(self, owner: str, lease_ttl_s: float) -> int:
        """Pushes forward the expiry of every lease ``owner`` holds; returns how many."""
        now = self._now
        with self.db.transaction(self.job, exclusive=False) as tx:  # row locks suffice
            renewed = tx.execute(
                f"UPDATE paro_predict_shards SET lease_expires = {now} + $1 "
                "WHERE job = $2 AND owner = $3 AND state = $4",
                (lease_ttl_s, self.job, owner, LEASED),
            )
            renewed += tx.execute(
                f"UPDATE paro_predict_shards SET spec_expires = {now} + $1 "
                "WHERE job = $2 AND spec_owner = $3 AND state = $4",
                (lease_ttl_s, self.job, owner, LEASED),
            )
            tx.execute(
                f"UPDATE paro_predict_workers SET last_seen = {now} WHERE job = $1 AND owner = $2", (self.job, owner)
            )
        return max(renewed, 0)

    def release(self, owner: str) -> None:
        """Hands ``owner``'s leases back at once, as a graceful stop (scale-down, SIGTERM, a supervisor stopping a
        replica): its shards are todo again and the lease is not counted as an attempt, so releases never split a
        shard. Use ``reclaim`` for a worker that died."""
        with self.db.transaction(self.job) as tx:
            tx.execute(
                "UPDATE paro_predict_shards SET state = $1, owner = NULL, lease_expires = NULL, leased_at = NULL, "
                "attempts = attempts - 1 WHERE job = $2 AND owner = $3 AND state = $4",
                (TODO, self.job, owner, LEASED),
            )
            self._drop_speculation(tx, owner)

    def reclaim(self, owner: str) -> None:
        """Expires the leases of ``owner``, a worker that died, at once: other workers take its shards without waiting
        for the expiry, and each lease counts as an attempt (a row that kills its workers is still isolated)."""
        with self.db.transaction(self.job) as tx:
            tx.execute(
                f"UPDATE paro_predict_shards SET lease_expires = {self._now} - 1 "
                "WHERE job = $1 AND owner = $2 AND state = $3",
                (self.job, owner, LEASED),
            )
            self._drop_speculation(tx, owner)

    def _drop_speculation(self, tx, owner: str) -> None:
        tx.execute(
            "UPDATE paro_predict_shards SET spec_owner = NULL, spec_expires = NULL "
            "WHERE job = $1 AND spec_owner = $2 AND state = $3",
            (self.job, owner, LEASED),
        )

    def reclaim_dead_neighbours(self) -> list[str]:
        """Reclaims the live leases of workers in this process's space (same boot and pid namespace) whose process
        has ended; returns their names. Workers elsewhere are left to their leases' expiry."""
        space = local_process_space()
        if space is None:
            return []
        rows = self.db.query(
            "SELECT DISTINCT p.owner, p.pid, p.pid_started FROM paro_predict_processes p "
            "JOIN paro_predict_shards s ON s.job = p.job "
            f"AND ((s.owner = p.owner AND s.lease_expires >= {self._now}) "
            f"OR (s.spec_owner = p.owner AND s.spec_expires >= {self._now})) "
            "WHERE p.job = $1 AND p.process_space = $2 AND s.state = $3",
            (self.job, space, LEASED),
        )
        dead = [owner for owner, pid, started in rows if process_gone(int(pid), started)]
        for owner in dead:
            log.warning("worker %s of job %s is gone: its leases are taken over now", owner, self.job)
            self.reclaim(owner)
        return dead

    # ---- completion ---------------------------------------------------------------------------

    def commit(self, shard_id: int, owner: str, rows_written: int, rows_failed: int, file: str) -> CommitResult:
        """Marks a shard committed once its file is durably on disk. The first commit wins."""
        with self.db.transaction(self.job, exclusive=False) as tx:  # row locks suffice
            changed = tx.execute(
                "UPDATE paro_predict_shards SET state = $1, rows_written = $2, rows_failed = $3, file = $4, "
                f"committed_at = {self._now}, committed_by = $5, spec_owner = NULL WHERE job = $6 AND shard_id = $7 "
                "AND state IN ($8, $9)",
                (COMMITTED, rows_written, rows_failed, file, owner, self.job, shard_id, TODO, LEASED),
            )
            if changed == 1:
                return CommitResult.COMMITTED
            row = tx.fetchone(
                "SELECT state FROM paro_predict_shards WHERE job = $1 AND shard_id = $2", (self.job, shard_id)
            )
        if row is not None and row[0] == COMMITTED:
            return CommitResult.ALREADY_COMMITTED
        return CommitResult.SUPERSEDED

    def shards(self, states: Optional[tuple[str, ...]] = None) -> list[ShardRecord]:
        """All shards of the job (optionally only those in ``states``), ordered by first row."""
        sql = f"SELECT {SHARD_COLUMNS} FROM paro_predict_shards WHERE job = $1"
        params: list = [self.job]
        if states:
            sql += " AND state IN (" + ", ".join(f"${n}" for n in range(2, 2 + len(states))) + ")"
            params.extend(states)
        rows = self.db.query(sql + " ORDER BY start_row, shard_id", params)
        # a status read of a 100,000-shard job builds 100,000 records: filled in one step each, not field by field
        # through the frozen dataclass's __init__ (the drivers return ints for the integer columns)
        make, fill, names = object.__new__, object.__setattr__, SHARD_FIELDS
        records = []
        for r in rows:
            record = make(ShardRecord)
            fill(record, "__dict__", dict(zip(names, r)))
            records.append(record)
        return records

    def failed_rows(self) -> int:
        """Rows isolated as poison so far, over the whole job."""
        row = self.db.query(
            "SELECT COALESCE(SUM(rows_failed), 0) FROM paro_predict_shards WHERE job = $1 AND state IN ($2, $3)",
            (self.job, COMMITTED, POISONED),
        )
        return int(row[0][0])

    def workers(self) -> list[tuple[str, str, int, float, float]]:
        """``(owner, host, pid, started_at, last_seen)`` of every worker that ever joined the job."""
        rows = self.db.query(
            "SELECT owner, host, pid, started_at, last_seen FROM paro_predict_workers "
            "WHERE job = $1 ORDER BY started_at",
            (self.job,),
        )
        return [(r[0], r[1], int(r[2]), float(r[3]), float(r[4])) for r in rows]

    def stored_inputs(self) -> Optional[list]:
        """The job's source units as stored when it was created (``[[id, rows, fingerprint], ...]``), or None (no
        job yet, or a job over a dataset's index space): what a joining worker takes instead of listing them."""
        rows = self.db.query("SELECT units FROM paro_predict_inputs WHERE job = $1", (self.job,))
        return json.loads(rows[0][0]) if rows else None
