"""Database connections for the shard ledger: an embedded SQLite file or a PostgreSQL server.

Every statement is written once, for both drivers, with PostgreSQL's own numbered parameters ``$1``, ``$2``, ...
(a number may appear several times). Both take that text as it is: PostgreSQL natively (psycopg's ``RawCursor``
sends the statement to the server without reading it), and SQLite as named parameters (``$AAAA``, here named
``1``, ``2``, ...), so the parameters are passed to SQLite as ``{"1": first, "2": second, ...}``. No statement is
ever read or rewritten on its way to the database: a ``%``, a ``?`` or a ``$1`` inside a string literal stays text.
A query builder (SQLAlchemy Core) would reach the same through a dependency and a layer the ledger's few, fixed
statements do not need.
"""

from __future__ import annotations

import hashlib
import os
import re
import sqlite3
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence


class LedgerUnavailableError(RuntimeError):
    """The ledger database could not be reached or used."""


def redact_url(url: str) -> str:
    """Returns ``url`` with any password replaced by ``***`` so it can be printed or logged."""
    # user:password@host in the authority part
    url = re.sub(r"(://[^:/@?#]*:)[^@/?#]*@", r"\1***@", url)
    # password=... as a query or keyword parameter
    return re.sub(r"(password=)[^&\s]*", r"\1***", url, flags=re.IGNORECASE)


def is_postgres_url(location: str) -> bool:
    """Whether ``location`` names a PostgreSQL server rather than a SQLite file."""
    return location.startswith(("postgresql://", "postgres://"))


@dataclass(frozen=True)
class Dialect:
    """The few SQL differences between the two backends."""

    name: str
    """``"sqlite"`` or ``"postgres"``."""
    now: str
    """The database's clock in Unix seconds, as an SQL expression: every lease time is read and written with it, so
    workers whose own clocks disagree still agree on when a lease expires."""


SQLITE = Dialect(
    name="sqlite",
    # the clock of the process that runs the statement; SQLite serves one machine, so every writer reads one clock
    now="((julianday('now') - 2440587.5) * 86400.0)",
)
POSTGRES = Dialect(
    name="postgres",
    # the server's clock, at the start of the (short) transaction
    now="CAST(EXTRACT(EPOCH FROM now()) AS DOUBLE PRECISION)",
)

# Arbitrary constant key for the PostgreSQL advisory lock of transactions not scoped to one job (creating the
# tables: concurrent CREATE TABLE IF NOT EXISTS can collide in PostgreSQL's catalog).
_PG_ADVISORY_KEY = 727_001


def advisory_key(scope: str) -> int:
    """The PostgreSQL advisory lock key of ``scope`` (a job name): a stable signed 64-bit hash.

    Transactions of different jobs take different keys, so jobs sharing one database never wait for each other
    (a hash collision between two jobs would only serialise them, never break them).
    """
    digest = hashlib.blake2b(scope.encode("utf-8"), digest_size=8, person=b"paro-ledger").digest()
    return int.from_bytes(digest, "big", signed=True)


def sqlite_params(params: Sequence[Any]) -> dict:
    """Positional parameters as SQLite binds ``$1``, ``$2``, ...: named parameters called ``1``, ``2``, ..."""
    return {str(number): value for number, value in enumerate(params, 1)}


class Database:
    """One connection to the ledger database, with a transaction helper shared by both backends.

    Statements are written with ``$1``, ``$2``, ... parameter markers, which both drivers take as they are (see the
    module's docstring). Every ledger transaction of a job is serialised (``BEGIN IMMEDIATE`` on SQLite, which
    locks the whole file; on PostgreSQL an advisory transaction lock keyed by the job, so other jobs in the same
    database run in parallel): ledger transactions are tiny (a few index lookups), so mutual exclusion keeps the
    leasing logic identical on both backends at a cost measured in bench/predict/ledger_scale.py.
    """

    def __init__(self, location: str, connect_timeout_s: float = 10.0) -> None:
        self.location = location
        self.display_location = redact_url(location)
        if is_postgres_url(location):
            self.dialect = POSTGRES
            self._conn = _connect_postgres(location, connect_timeout_s, self.display_location)
        else:
            self.dialect = SQLITE
            self._conn = _connect_sqlite(location, connect_timeout_s)

    def close(self) -> None:
        try:
            self._conn.close()
        except Exception:  # closing a broken connection must never mask the original problem
            pass

    def _params(self, params: Sequence[Any]) -> Any:
        """``params`` as this connection's driver binds ``$1``, ``$2``, ..."""
        return tuple(params) if self.dialect is POSTGRES else sqlite_params(params)

    def transaction(self, scope: Optional[str] = None, exclusive: bool = True) -> "_Transaction":
        """A serialised read-write transaction: ``with db.transaction(job) as tx: tx.execute(...)``.

        On PostgreSQL, transactions with the same ``scope`` (a job name) exclude each other; None is the scope of
        work on the tables themselves. ``exclusive=False`` leaves the scope's lock to ``tx.lock()`` (statements
        that lock their rows need none). SQLite has a single writer: every transaction excludes every other.
        """
        return _Transaction(self, scope, exclusive)

    def query(self, statement: str, params: Sequence[Any] = ()) -> list[tuple]:
        """Runs one read-only statement in its own short transaction and returns all rows."""
        try:
            cur = self._conn.cursor()
            cur.execute(statement, self._params(params))
            rows = cur.fetchall()
            self._conn.commit()
            return rows
        except Exception as exc:
            self._rollback()
            raise self._wrap(exc) from exc

    def _rollback(self) -> None:
        try:
            self._conn.rollback()
        except Exception:
            pass

    def _wrap(self, exc: Exception) -> Exception:
        if isinstance(exc, LedgerUnavailableError):
            return exc
        if _is_connection_error(exc):
            return LedgerUnavailableError(
                f"The prediction ledger at {self.display_location} is unreachable ({type(exc).__name__}: "
                f"{redact_url(str(exc)).strip()}). Check that the database is running and reachable from this "
                "machine; no shard was marked done by the failed operation, so rerunning the job resumes safely."
            )
        return exc


class _Transaction:
    def __init__(self, db: Database, scope: Optional[str], exclusive: bool = True) -> None:
        self._db = db
        self._key = _PG_ADVISORY_KEY if scope is None else advisory_key(scope)
        self._exclusive = exclusive
        self._locked = False
        self._cur: Any = None

    @property
    def dialect(self) -> Dialect:
        return self._db.dialect

    def lock(self) -> None:
        """Takes the scope's lock now (PostgreSQL), if the transaction does not hold it yet."""
        if self._db.dialect is POSTGRES and not self._locked:
            self._cur.execute("SELECT pg_advisory_xact_lock($1)", (self._key,))
        self._locked = True

    def __enter__(self) -> "_Transaction":
        db = self._db
        try:
            self._cur = db._conn.cursor()
            if db.dialect is SQLITE:
                self._cur.execute("BEGIN IMMEDIATE")
                self._locked = True
            elif self._exclusive:
                self.lock()
        except Exception as exc:
            db._rollback()
            raise db._wrap(exc) from exc
        return self

    def execute(self, statement: str, params: Sequence[Any] = ()) -> int:
        """Runs a statement; returns the number of rows it changed."""
        self._cur.execute(statement, self._db._params(params))
        return self._cur.rowcount

    def executemany(self, statement: str, rows: Iterable[Sequence[Any]]) -> None:
        self._cur.executemany(statement, [self._db._params(r) for r in rows])

    def insert_rows(self, table: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
        """Inserts many rows at once: ``COPY ... FROM STDIN`` on PostgreSQL, one prepared statement on SQLite.

        ``table`` and ``columns`` are identifiers written by this package, never user input.
        """
        names = ", ".join(columns)
        if self._db.dialect is POSTGRES:
            with self._cur.copy(f"COPY {table} ({names}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)
            return
        marks = ", ".join(f"${number}" for number in range(1, len(columns) + 1))
        self._cur.executemany(f"INSERT INTO {table} ({names}) VALUES ({marks})", (sqlite_params(r) for r in rows))

    def fetchall(self, statement: str, params: Sequence[Any] = ()) -> list[tuple]:
        self._cur.execute(statement, self._db._params(params))
        return self._cur.fetchall()

    def fetchone(self, statement: str, params: Sequence[Any] = ()) -> Optional[tuple]:
        self._cur.execute(statement, self._db._params(params))
        return self._cur.fetchone()

    def __exit__(self, exc_type, exc, tb) -> None:
        db = self._db
        if exc_type is None:
            try:
                db._conn.commit()
                return
            except Exception as commit_exc:
                db._rollback()
                raise db._wrap(commit_exc) from commit_exc
        db._rollback()
        if exc is not None and _is_connection_error(exc):
            raise db._wrap(exc) from exc


def _is_connection_error(exc: BaseException) -> bool:
    if isinstance(exc, sqlite3.OperationalError):
        text = str(exc).lower()
        return "unable to open" in text or "disk i/o" in text or "locked" in text or "readonly" in text
    module = type(exc).__module__
    if module.startswith("psycopg"):
        import psycopg

        return isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError))
    return False


def _connect_sqlite(path: str, timeout_s: float) -> sqlite3.Connection:
    file = Path(path)
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: transactions are opened explicitly with BEGIN IMMEDIATE
        timeout_s = max(timeout_s, 30.0)
        conn = sqlite3.connect(str(file), timeout=timeout_s, isolation_level=None, check_same_thread=False)
        _enable_wal(conn, timeout_s)
        conn.execute("PRAGMA synchronous=FULL")
    except (sqlite3.Error, OSError) as exc:
        raise LedgerUnavailableError(
            f"Cannot open the SQLite prediction ledger {file} ({exc}). The file must be on a local, writable "
            "disk next to the output; pass ledger='postgresql://...' when workers run on several machines."
        ) from exc
    return _SqliteAutocommitShim(conn)


def _enable_wal(conn: sqlite3.Connection, timeout_s: float) -> None:
    """Puts the ledger file in write-ahead-log mode, waiting for peers that are opening it at the same moment.

    Switching the journal mode needs an exclusive lock. When another connection holds a write lock on a file
    still in rollback mode (a worker creating the fresh ledger's tables), SQLite answers "database is locked"
    at once instead of calling its busy handler, so the wait is done here.
    """
    deadline = time.monotonic() + timeout_s
    pause_s = 0.005
    while True:
        try:
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() == "wal":
                return
            problem = f"the file stayed in journal mode {mode!r}"
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc).lower() and "busy" not in str(exc).lower():
                raise
            problem = str(exc)
        if time.monotonic() >= deadline:
            raise sqlite3.OperationalError(f"cannot switch to write-ahead logging after {timeout_s:.0f} s: {problem}")
        time.sleep(pause_s)
        pause_s = min(2 * pause_s, 0.2)


_open_sqlite: weakref.WeakSet = weakref.WeakSet()
"""The SQLite connections of this process (through their shims)."""
_inherited_sqlite: list = []
"""In a forked child: the parent's SQLite connections, kept so that they are never freed here."""


def _keep_inherited_sqlite() -> None:
    """After a fork, in the child (a DataLoader worker, say): never free the parent's SQLite connections.

    Another thread of the parent (a heartbeat, a writer) may have been inside SQLite at the fork and held one of its
    mutexes; the child inherits the mutex locked and no thread to unlock it, so freeing the inherited connection when
    the child collects garbage would wait forever. The child never uses them; the parent's copies are untouched.
    """
    _inherited_sqlite.extend(shim._conn for shim in list(_open_sqlite))


os.register_at_fork(after_in_child=_keep_inherited_sqlite)


class _SqliteAutocommitShim:
    """Gives the autocommit-mode sqlite3 connection the commit/rollback interface of a DB-API driver."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        _open_sqlite.add(self)

    def cursor(self) -> sqlite3.Cursor:
        return self._conn.cursor()

    def commit(self) -> None:
        if self._conn.in_transaction:
            self._conn.execute("COMMIT")

    def rollback(self) -> None:
        if self._conn.in_transaction:
            self._conn.execute("ROLLBACK")

    def close(self) -> None:
        self._conn.close()


def _connect_postgres(url: str, timeout_s: float, display: str) -> Any:
    try:
        import psycopg
    except ImportError as exc:
        raise LedgerUnavailableError(
            "A PostgreSQL ledger needs the psycopg driver: pip install 'lightning-paro[postgres]'."
        ) from exc
    try:
        # RawCursor: statements reach the server as written, with their $1, $2, ... parameters
        return psycopg.connect(url, connect_timeout=max(1, int(timeout_s)), cursor_factory=psycopg.RawCursor)
    except psycopg.Error as exc:
        raise LedgerUnavailableError(
            f"Cannot connect to the PostgreSQL prediction ledger at {display}: {redact_url(str(exc)).strip()}. "
            "Check the URL, that the server is running and that this machine may connect to it."
        ) from exc
