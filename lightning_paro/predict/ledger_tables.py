"""The shard ledger's tables: the states a shard goes through, the SQL that creates the tables (SQLite and
PostgreSQL alike), and a shard's row as read back (:class:`ShardRecord`). The operations on them are
:class:`~lightning_paro.predict.ledger.Ledger`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

TODO, LEASED, COMMITTED, POISONED, SPLIT = "todo", "leased", "committed", "poisoned", "split"
"""A shard's states (:mod:`lightning_paro.predict.ledger` says what each means)."""

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS paro_predict_jobs (
        job TEXT PRIMARY KEY,
        num_rows BIGINT NOT NULL,
        shard_size BIGINT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS paro_predict_shards (
        job TEXT NOT NULL,
        shard_id BIGINT NOT NULL,
        start_row BIGINT NOT NULL,
        end_row BIGINT NOT NULL,
        state TEXT NOT NULL,
        owner TEXT,
        lease_expires DOUBLE PRECISION,
        leased_at DOUBLE PRECISION,
        spec_owner TEXT,
        spec_expires DOUBLE PRECISION,
        attempts INTEGER NOT NULL DEFAULT 0,
        parent BIGINT,
        rows_written BIGINT,
        rows_failed BIGINT,
        file TEXT,
        error TEXT,
        committed_at DOUBLE PRECISION,
        committed_by TEXT,
        PRIMARY KEY (job, shard_id)
    )""",
    """CREATE TABLE IF NOT EXISTS paro_predict_workers (
        job TEXT NOT NULL,
        owner TEXT NOT NULL,
        host TEXT,
        pid BIGINT,
        started_at DOUBLE PRECISION,
        last_seen DOUBLE PRECISION,
        PRIMARY KEY (job, owner)
    )""",
    # the units of a job over a sharded source, as JSON [[unit id, rows, fingerprint], ...]; absent for a job
    # over a dataset's index space (a table of its own, so ledgers created before it still open)
    """CREATE TABLE IF NOT EXISTS paro_predict_inputs (
        job TEXT PRIMARY KEY,
        units TEXT NOT NULL
    )""",
    # a lease, a renewal and the done check look up the few shards in one state (the first todo shard in row
    # order, the leased ones) through this index, so their cost does not grow with the shards already committed
    """CREATE INDEX IF NOT EXISTS paro_predict_shards_by_state
        ON paro_predict_shards (job, state, start_row, shard_id)""",
    # the process of each worker: a worker in the same process space (boot id and pid namespace) that finds it gone
    # hands its leases on at once (lightning_paro.predict.processes); a table of its own, so older ledgers still open
    """CREATE TABLE IF NOT EXISTS paro_predict_processes (
        job TEXT NOT NULL,
        owner TEXT NOT NULL,
        process_space TEXT,
        pid BIGINT NOT NULL,
        pid_started BIGINT,
        PRIMARY KEY (job, owner)
    )""",
)

LAST_SCHEMA_OBJECT = "paro_predict_processes"
"""Created last: where it exists, the whole schema does."""
SHARD_INSERT_COLUMNS = ("job", "shard_id", "start_row", "end_row", "state", "attempts")
"""The columns a new shard is inserted with."""


@dataclass(frozen=True)
class ShardRecord:
    """One row of the shard table, as read back for progress, manifests and tests."""

    shard_id: int
    """The shard's id."""
    start_row: int
    """First row (inclusive)."""
    end_row: int
    """One past the last row."""
    state: str
    """todo, leased, committed, poisoned or split."""
    owner: Optional[str]
    """The worker holding (or last holding) the primary lease."""
    lease_expires: Optional[float]
    """When the primary lease runs out (Unix seconds on the database's clock)."""
    leased_at: Optional[float]
    """When the primary lease was handed out (Unix seconds on the database's clock)."""
    attempts: int
    """Primary leases that ended without a commit because their worker died or stopped renewing (an expired or
    reclaimed lease), plus the one held now; a lease handed back gracefully is not counted."""
    rows_written: Optional[int]
    """Rows in the committed file."""
    rows_failed: Optional[int]
    """Rows isolated as poison (errors file) for committed shards, or all rows of a poisoned shard."""
    file: Optional[str]
    """The committed output file, relative to the output directory."""
    error: Optional[str]
    """Why a shard was poisoned."""
    committed_at: Optional[float]
    """When it was committed (Unix seconds on the database's clock)."""
    committed_by: Optional[str]
    """The worker whose commit won."""

    @property
    def num_rows(self) -> int:
        return self.end_row - self.start_row


SHARD_FIELDS = tuple(f.name for f in fields(ShardRecord))
"""The shard table's columns a :class:`ShardRecord` holds, in its order."""
SHARD_COLUMNS = ", ".join(SHARD_FIELDS)
