"""The background writer: turns step outcomes into shard files and commits them, off the model's thread."""

from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import pyarrow as pa

from lightning_paro.predict import shard_files
from lightning_paro.predict.batch import (
    BatchTicket,
    RowFailure,
    StepOutcome,
    index_array,
    take,
)
from lightning_paro.predict.columns import numpy_to_arrow, prediction_columns
from lightning_paro.predict.heartbeat import ProgressClock
from lightning_paro.predict.ledger import CommitResult, Lease, Ledger
from lightning_paro.predict.sampler import InFlightShards

log = logging.getLogger(__name__)

_STOP = object()


class ErrorBudgetExceededError(RuntimeError):
    """More rows were isolated as poison than the job's error budget allows."""


def error_budget_message(failed: int, budget: int, examples: list, output_dir: Path, index_column: str) -> str:
    shown = "; ".join(f"row {f[index_column]} ({f['stage']}): {f['error']}" for f in examples[:5])
    return (
        f"{failed} rows failed, more than the error budget of {budget} (max_failed_rows). Examples: {shown}. "
        f"All failed rows and their tracebacks are in {output_dir / shard_files.ERRORS_DIR}. Fix the data or the model, "
        "or raise max_failed_rows, then rerun the same job: committed shards are kept."
    )


def failure_record(failure: RowFailure, ticket: BatchTicket, owner: str, index_column: str) -> dict:
    return {
        index_column: failure.index,
        "row": failure.row_id,
        "stage": failure.stage,
        "error": failure.error,
        "traceback": failure.traceback,
        "shard_start": ticket.start_row,
        "shard_end": ticket.end_row,
        "attempt": ticket.attempt,
        "worker": owner,
    }


def acknowledge_existing(output_dir: Path, fmt: str, owner: str, ledger: Ledger, lease: Lease) -> bool:
    """Commits a leased shard whose data file is already published (a crash between publish and commit).

    Returns True when the shard needed no work.
    """
    final = output_dir / shard_files.shard_file_name(lease.start_row, lease.end_row, fmt)
    if not final.exists():
        return False
    rows = shard_files.count_rows(final, fmt)
    errors = shard_files.existing_errors_file(output_dir, lease.start_row, lease.end_row)
    failed = shard_files.count_rows(errors, "jsonl") if errors is not None else 0
    result = ledger.commit(lease.shard_id, owner, rows, failed, final.name)
    log.info("rows [%d, %d) were already written: %s without recomputing", lease.start_row, lease.end_row, result.value)
    if result is CommitResult.SUPERSEDED:
        final.unlink(missing_ok=True)
    return True


class _OpenShard:
    """The shard the writer is currently filling."""

    def __init__(self, ticket: BatchTicket) -> None:
        self.ticket = ticket
        self.file: Optional[shard_files.ShardFileWriter] = None
        self.failures: list[dict] = []


class ShardWriter(threading.Thread):
    """Consumes ``StepOutcome``s from a bounded queue, writes each shard's file, publishes and commits it.

    Batches of a worker arrive in the order the sampler leased them, so exactly one shard is open at
    a time and memory holds at most one batch per queue slot.
    """

    def __init__(
        self,
        ledger_factory: Callable[[], Ledger],
        output_dir: Path,
        fmt: str,
        owner: str,
        index_column: str,
        id_column: Optional[str],
        max_failed_rows: int,
        in_flight: InFlightShards,
        clock: ProgressClock,
        queue_size: int,
    ) -> None:
        super().__init__(name=f"lightning-paro-writer-{owner}", daemon=True)
        self.ledger_factory = ledger_factory
        self.output_dir = output_dir
        self.fmt = fmt
        self.owner = owner
        self.index_column = index_column
        self.id_column = id_column
        self.max_failed_rows = max_failed_rows
        self.in_flight = in_flight
        self.clock = clock
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.error: Optional[BaseException] = None
        self.rows_written = 0
        self.rows_failed = 0
        self.shards_committed = 0
        self.shards_acknowledged = 0
        self._open: Optional[_OpenShard] = None

    # ---- model thread side --------------------------------------------------------------------

    def submit(self, outcome: StepOutcome) -> None:
        """Queues one batch's outcome, blocking while the queue is full (backpressure)."""
        while True:
            self.raise_if_failed()
            try:
                self.queue.put(outcome, timeout=0.5)
                return
            except queue.Full:
                if not self.is_alive():
                    self.raise_if_failed()
                    raise RuntimeError("the prediction writer thread stopped unexpectedly")

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Waits until every queued batch is written and committed, then raises the writer's error if any."""
        if self.is_alive():
            while True:
                try:
                    self.queue.put(_STOP, timeout=0.5)
                    break
                except queue.Full:
                    if not self.is_alive():
                        break
            self.join()
        self.raise_if_failed()

    def abort(self) -> None:
        """Stops without waiting for queued batches; the open shard's temporary file is removed."""
        self._aborting = True
        try:
            while True:
                self.queue.get_nowait()
        except queue.Empty:
            pass
        try:
            self.queue.put_nowait(_STOP)
        except queue.Full:
            pass
        self.join(timeout=30)

    # ---- writer thread side -------------------------------------------------------------------

    _aborting = False

    def run(self) -> None:
        ledger = None
        try:
            ledger = self.ledger_factory()
            while True:
                item = self.queue.get()
                if item is _STOP or self._aborting:
                    break
                self._handle(ledger, item)
        except OSError as exc:
            self.error = shard_files.OutputNotWritableError(exc.errno, shard_files.describe_os_error(exc, self.output_dir))
            self.error.__cause__ = exc
        except BaseException as exc:
            self.error = exc
        finally:
            if self._open is not None and self._open.file is not None:
                self._open.file.abort()
            self._open = None
            if ledger is not None:
                ledger.close()

    def _handle(self, ledger: Ledger, outcome: StepOutcome) -> None:
        ticket = outcome.ticket
        if ticket.idle:
            return
        shard = self._open
        if shard is None or shard.ticket.shard_id != ticket.shard_id:
            if shard is not None and shard.file is not None:
                shard.file.abort()  # cannot happen with in-order batches; never publish a partial shard
            shard = self._open = _OpenShard(ticket)
        for positions, prediction in outcome.chunks:
            table = self._table(outcome, positions, prediction)
            if shard.file is None:
                final = self.output_dir / shard_files.shard_file_name(ticket.start_row, ticket.end_row, self.fmt)
                shard.file = shard_files.ShardFileWriter(final, self.fmt, self.owner)
            shard.file.write(table)
        shard.failures.extend(failure_record(f, ticket, self.owner, self.index_column) for f in outcome.failures)
        self.clock.touch()
        if ticket.last:
            self._finish(ledger, shard)
            self._open = None

    def _table(self, outcome: StepOutcome, positions: Sequence[int], prediction) -> pa.Table:
        columns = {self.index_column: numpy_to_arrow(np.asarray(take(index_array(outcome.indices), positions),
                                                                 dtype=np.int64))}
        if self.id_column is not None and outcome.ids is not None:
            ids = take(outcome.ids, positions)
            columns[self.id_column] = numpy_to_arrow(ids) if isinstance(ids, np.ndarray) else pa.array(ids)
        for name, array in prediction_columns(prediction, len(positions)).items():
            if name in columns:
                raise ValueError(
                    f"predict_step returned a column named {name!r}, which is reserved for the row id; rename it or "
                    "set index_column/id_column to another name"
                )
            columns[name] = array
        return pa.table(columns)

    def _finish(self, ledger: Ledger, shard: _OpenShard) -> None:
        ticket = shard.ticket
        if shard.failures:
            shard_files.write_errors_file(
                self.output_dir / shard_files.errors_file_name(ticket.start_row, ticket.end_row), shard.failures, self.owner
            )
        file_name: Optional[str] = None
        rows = 0
        if shard.file is not None:
            published = shard_files.publish_shard(shard.file)
            file_name = published.path.name
            rows = shard.file.rows if published.created else shard_files.count_rows(published.path, self.fmt)
        # an unreachable ledger raises here: the file stays published but uncommitted, and the next
        # lease of this shard acknowledges it (acknowledge_existing) instead of recomputing it
        result = ledger.commit(ticket.shard_id, self.owner, rows, len(shard.failures), file_name)
        self.in_flight.discard(ticket.shard_id)
        if result is CommitResult.SUPERSEDED:
            # split or poisoned meanwhile: this range is no longer a shard, its file must never be read
            if file_name is not None:
                (self.output_dir / file_name).unlink(missing_ok=True)
            return
        if result is CommitResult.COMMITTED:
            self.shards_committed += 1
            self.rows_written += rows
            self.rows_failed += len(shard.failures)
        else:
            self.shards_acknowledged += 1
        if shard.failures and self.max_failed_rows is not None:
            failed = ledger.failed_rows()
            if failed > self.max_failed_rows:
                raise ErrorBudgetExceededError(
                    error_budget_message(failed, self.max_failed_rows, shard.failures, self.output_dir, self.index_column)
                )
