"""Sources as shards: inputs stored as units (files, row groups, objects) mapped onto the ledger's row ranges.

A source lists its units up front with their row counts; the job's row index space is the
concatenation of the units, so the ledger, the writer, the manifest and resume work unchanged on
half-open ranges of it. Reading a range asks the source for the rows of one unit's sub-range at a
time, so a unit is never loaded whole unless the source itself chooses to.

A source that stores columns (Parquet) may also read a sub-range as one batch, already collated
(``read_batch``): the batch of a ticket is then built from columns, without a Python object per row,
and the per-row path remains for ranges the batched read does not give (types it does not read as columns).

A unit that cannot be opened or read (missing, no permission, truncated, a corrupt footer) fails as a unit:
it is retried with backoff, then its rows fail together with one message naming the unit and the cause,
and the unit is not opened again by this process. Rows that raise inside a readable unit stay isolated
one by one. Units are identified by a fingerprint of fields (``size=... mtime_ns=... rg=...``); a worker
joining a running job compares the fields ``stat`` gives, a worker creating or resuming it all of them.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import torch
from torch.utils.data import Dataset

from lightning_paro.predict.batch import BatchTicket, RowFailure
from lightning_paro.predict.dataset import FetchPool, LoadedRows, compact_indices

log = logging.getLogger(__name__)

class UnitReadError(Exception):
    """A unit could not be opened or read as a whole (missing, no permission, truncated, a corrupt footer).

    A source raises it (or any ``OSError``) for a failure of the unit rather than of one row; the unit is then
    retried with backoff and, failing again, its rows fail together with this message.
    """

    def __init__(self, unit_id: str, cause: str) -> None:
        super().__init__(f"source unit {unit_id!r} could not be read: {cause}")
        self.unit_id = unit_id
        self.cause = cause


def file_fingerprint(path: str, **content: Any) -> str:
    """A file's fingerprint: its size and modification time from ``stat`` (no open), then ``content`` fields
    (a hash, a footer's statistics) in the order given."""
    info = os.stat(path)
    fields = {"size": info.st_size, "mtime_ns": info.st_mtime_ns, **content}
    return " ".join(f"{k}={v}" for k, v in fields.items())


def fingerprint_fields(fingerprint: str) -> dict:
    """``{field: value}`` of a fingerprint of ``k=v`` words; one that is not (an ETag, a hash) is the field ``""``."""
    words = str(fingerprint).split()
    if words and all("=" in w for w in words):
        return dict(w.split("=", 1) for w in words)
    return {"": str(fingerprint)} if fingerprint else {}


def same_content(fingerprint: str, stored: str) -> bool:
    """Whether two fingerprints agree on the fields both have: a joining worker's ``stat`` fields against the
    stored ones; a job stored with fewer fields (a source's own, or an older version's ``size=``) on those."""
    mine, theirs = fingerprint_fields(fingerprint), fingerprint_fields(stored)
    if not mine or not theirs:
        return True  # a side without a fingerprint (a URL at join): nothing to compare
    common = mine.keys() & theirs.keys()
    return bool(common) and all(mine[k] == theirs[k] for k in common)


def inputs_to_check(stored: Optional[list], units: Sequence["SourceUnit"]) -> list:
    """The units as ``[[id, rows, fingerprint], ...]`` for the ledger's check against the job's stored inputs: a
    unit whose id and rows match a stored one and whose fingerprint agrees with it on their common fields carries
    the stored fingerprint, so the ledger (which compares whole fingerprints) sees it unchanged, and reports every
    other difference."""
    known = {u[0]: (int(u[1]), str(u[2])) for u in stored or []}
    out = []
    for unit in units:
        fingerprint = str(unit.fingerprint)
        rows_fp = known.get(unit.id)
        if rows_fp is not None and rows_fp[0] == int(unit.rows) and same_content(fingerprint, rows_fp[1]):
            fingerprint = rows_fp[1]
        out.append([unit.id, int(unit.rows), fingerprint])
    return out


@dataclass(frozen=True)
class SourceUnit:
    """One unit of a source: a file, a Parquet row group, an object; the smallest thing read on its own."""

    id: str
    """Stable name of the unit (a path, ``path#row-group``); it names rows in ids and errors and detects changes."""
    rows: int
    """Number of rows in the unit."""
    fingerprint: str = ""
    """What identifies the unit's content, as ``k=v`` fields (``size=... mtime_ns=...`` and a hash or a footer entry)
    or one opaque value (an ETag); a change makes resuming the job an error."""
    ref: Any = field(default=None, compare=False)
    """Whatever the source needs to read the unit again (a path and row-group number, byte offsets)."""


class ShardedSource(Dataset):
    """Base class of an input that shards itself: subclass it and implement ``units`` and ``read``.

    Pass it to a ``DataLoader(source, batch_size=..., num_workers=...)`` as the dataset. Any object with
    these two methods works too (an ``IterableDataset`` included); the base class only adds ``len``
    and indexing so the source can also be used as a plain map-style dataset.
    """

    id_column: Optional[str] = None
    """Key of the stable input id in each row the source yields; ``ElasticPredict`` copies it to the output."""

    def units(self) -> Sequence[SourceUnit]:
        """The units, in a fixed order, with their row counts and fingerprints. Called by a worker that creates or
        resumes the job (and by one that joins it, when ``units_at_join`` returns None)."""
        raise NotImplementedError

    def units_at_join(self, stored: Sequence[SourceUnit]) -> Optional[Sequence[SourceUnit]]:
        """Optional: the units of a job this worker joins while other workers run it, rebuilt from the job's stored
        units (ids, row counts, fingerprints) without opening any input, each with a fingerprint of the fields
        that are cheap to check (a file's ``size`` and ``mtime_ns`` from ``stat``); a unit of the source that is
        not stored is given too (with any row count), so it is reported as added. None: ``units()`` is called."""
        return None

    def read(self, unit: SourceUnit, start: int, stop: int) -> Iterable[Any]:
        """Yields rows ``start`` to ``stop`` (exclusive) of ``unit``, one sample each, streaming."""
        raise NotImplementedError

    def read_batch(self, unit: SourceUnit, start: int, stop: int) -> Optional[dict]:
        """Optional: rows ``start`` to ``stop`` (exclusive) of ``unit`` as one batch, or None to read them row by row.

        The batch must be what ``torch.utils.data.default_collate`` makes of the rows ``read`` yields for the
        range (the same keys in the same order, dtypes and shapes: a dict of tensors whose first dimension is
        ``stop - start``, or of per-row lists such as strings), so ``predict_step`` cannot tell the two apart.
        It is used only when the DataLoader has no ``collate_fn`` of its own. Return None for rows it does not read
        as columns (types it does not collate); an exception is a failure of the unit, retried as a unit and then
        reported for the unit's rows with its cause (never read again row by row).
        """
        return None

    def row_id(self, unit: SourceUnit, position: int) -> str:
        """A stable name of row ``position`` of ``unit``, used for rows that fail before they are read."""
        return f"{unit.id}:{position}"

    def __len__(self) -> int:
        return source_layout(self).num_rows

    def __getitem__(self, index: int) -> Any:
        layout = source_layout(self)
        (unit_index, start, stop), = layout.pieces(index, index + 1)
        return next(iter(self.read(layout.units[unit_index], start, stop)))


def is_sharded_source(dataset: Any) -> bool:
    """True for a dataset that exposes its own units (``units()`` and ``read(unit, start, stop)``)."""
    return callable(getattr(dataset, "units", None)) and callable(getattr(dataset, "read", None))


class SourceLayout:
    """Where each unit's rows lie in the job's row index space."""

    def __init__(self, units: Sequence[SourceUnit]) -> None:
        for unit in units:
            if unit.rows < 0:
                raise ValueError(f"source unit {unit.id!r} has a negative row count ({unit.rows})")
        ids = [u.id for u in units]
        if len(set(ids)) != len(ids):
            duplicate = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"source unit id {duplicate!r} appears twice; unit ids must be unique")
        self.units = list(units)
        self.starts = list(itertools.accumulate((u.rows for u in self.units), initial=0))
        self.num_rows = self.starts[-1]

    def pieces(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """``(unit index, start, stop)`` within units covering the global rows ``[start, stop)``."""
        out = []
        unit_index = bisect.bisect_right(self.starts, start) - 1
        row = start
        while row < stop:
            while self.starts[unit_index + 1] <= row:  # skip empty units
                unit_index += 1
            offset = self.starts[unit_index]
            end = min(stop, self.starts[unit_index + 1])
            out.append((unit_index, row - offset, end - offset))
            row = end
        return out

    def plan_shards(self, shard_size: int) -> list[tuple[int, int]]:
        """Shard ranges of at most ``shard_size`` rows: whole consecutive units packed together, and a unit
        larger than a shard cut inside it, so a shard reads few units and most units are read by one shard."""
        ranges: list[tuple[int, int]] = []
        start = pos = 0
        for unit in self.units:
            if unit.rows == 0:
                continue
            if pos > start and pos - start + unit.rows > shard_size:
                ranges.append((start, pos))
                start = pos
            pos += unit.rows
            while pos - start > shard_size:
                ranges.append((start, start + shard_size))
                start += shard_size
        if pos > start:
            ranges.append((start, pos))
        return ranges

    def describe(self) -> list[list]:
        """The inputs as stored in the ledger, to refuse resuming over changed inputs."""
        return [[u.id, int(u.rows), str(u.fingerprint)] for u in self.units]


def source_layout(source: Any) -> SourceLayout:
    """The source's layout, computed once per source object (``units()`` may list a bucket or read footers)."""
    layout = getattr(source, "_paro_layout", None)
    if layout is None:
        layout = SourceLayout(list(source.units()))
        try:
            source._paro_layout = layout
        except AttributeError:  # a source with __slots__: recompute when asked again
            pass
    return layout


def joined_layout(source: Any, stored: Optional[list]) -> Optional[SourceLayout]:
    """The layout of a source for a worker joining a running job, from the job's stored units and the source's
    ``units_at_join`` (no input opened); None when there are no stored units or the source cannot. The layout is
    kept on the source, so neither this process nor its DataLoader workers list the units again."""
    join = getattr(source, "units_at_join", None)
    if stored is None or not callable(join):
        return None
    units = join([SourceUnit(str(u[0]), int(u[1]), str(u[2])) for u in stored])
    if units is None:
        return None
    layout = SourceLayout(list(units))
    try:
        source._paro_layout = layout
    except AttributeError:
        pass
    return layout


def _row_name(source: Any, unit: SourceUnit, position: int) -> str:
    namer = getattr(source, "row_id", None)
    return namer(unit, position) if callable(namer) else f"{unit.id}:{position}"


class UnitRetry:
    """How a unit that fails as a unit is retried (``retries`` times, after ``backoff_s``, doubling), and the units
    this process gave up on, so the other pieces of such a unit fail at once instead of opening it again.

    One per dataset in each DataLoader worker process: pickling it (to a worker) starts with nothing given up.
    """

    def __init__(self, retries: int = 2, backoff_s: float = 0.5) -> None:
        if retries < 0 or backoff_s < 0:
            raise ValueError(f"unit retries and backoff must be >= 0, got {retries} and {backoff_s}")
        self.retries = retries
        self.backoff_s = backoff_s
        self._given_up: dict[str, str] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"retries": self.retries, "backoff_s": self.backoff_s}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["retries"], state["backoff_s"])

    def given_up(self, unit_id: str) -> Optional[str]:
        """The failure message of a unit this process gave up on, else None."""
        with self._lock:
            return self._given_up.get(unit_id)

    def attempt(self, unit: "SourceUnit", read: Any) -> Any:
        """``read()``, retried with backoff while it raises; after the last retry the unit is given up and
        ``UnitReadError`` names it and the cause. A unit already given up raises at once."""
        attempts = 0
        while True:
            message = self.given_up(unit.id)
            if message is not None:
                raise UnitReadError(unit.id, message)
            try:
                return read()
            except Exception as exc:
                attempts += 1
                self.retry_after(unit.id, exc, attempts)

    def retry_after(self, unit_id: str, exc: BaseException, attempts: int) -> bool:
        """After a unit's ``attempts``-th failure in a row: waits the backoff and returns True to try again, or gives
        the unit up and returns False."""
        if attempts <= self.retries:
            time.sleep(self.backoff_s * 2 ** (attempts - 1))
            return True
        self.give_up(unit_id, f"{_cause(exc)} (after {attempts} attempts)")
        return False

    def give_up(self, unit_id: str, cause: str) -> None:
        with self._lock:
            self._given_up.setdefault(unit_id, cause)
        log.warning("source unit %r failed as a unit: %s", unit_id, cause)


def _cause(exc: BaseException) -> str:
    return exc.cause if isinstance(exc, UnitReadError) else f"{type(exc).__name__}: {exc}"


def is_unit_failure(exc: BaseException) -> bool:
    """Whether an exception from a source's read is a failure of the whole unit (it could not be opened or read)
    rather than of one row: ``UnitReadError`` and ``OSError`` (a missing file, no permission, a failed fetch)."""
    return isinstance(exc, (UnitReadError, OSError))


def _unit_failures(source: Any, unit: "SourceUnit", start: int, stop: int, first_index: int, cause: str,
                   tb: str) -> list:
    """Rows ``[start, stop)`` of a unit that failed as a unit, each with the message naming the unit and the cause
    (the traceback on the first only)."""
    message = f"source unit {unit.id!r} could not be read: {cause}"
    return [RowFailure(first_index + pos - start, _row_name(source, unit, pos), "unit", message, tb if pos == start else "")
            for pos in range(start, stop)]


def read_piece(source: Any, unit: SourceUnit, start: int, stop: int, first_index: int, retries: int,
               unit_retry: Optional[UnitRetry] = None) -> tuple[list, list]:
    """Rows ``[start, stop)`` of one unit as ``(samples, failures)``, isolating rows that raise.

    When the source's row stream raises after ``k`` rows, row ``start + k`` is the one that failed:
    reading restarts there (``retries`` times), then that row is reported and reading goes on after it.
    A failure of the unit itself (``is_unit_failure``) is retried as a unit with backoff (``unit_retry``), then
    the piece's remaining rows fail together with one message naming the unit and the cause; so does a unit
    that yields fewer rows than listed (truncated). ``first_index`` is the global index of row ``start``.
    """
    unit_retry = unit_retry or UnitRetry()
    samples: list = []
    failures: list = []
    pos, failed_reads, unit_attempts = start, 0, 0
    while pos < stop:
        given_up = unit_retry.given_up(unit.id)
        if given_up is not None:
            failures += _unit_failures(source, unit, pos, stop, first_index + pos - start, given_up, "")
            break
        try:
            for sample in itertools.islice(source.read(unit, pos, stop), stop - pos):
                samples.append((first_index + pos - start, sample))
                pos += 1
                failed_reads = unit_attempts = 0
        except Exception as exc:  # a poison row must not take the worker down: it is reported instead
            if is_unit_failure(exc):
                unit_attempts += 1
                if unit_retry.retry_after(unit.id, exc, unit_attempts):
                    continue
                failures += _unit_failures(source, unit, pos, stop, first_index + pos - start,
                                           unit_retry.given_up(unit.id) or _cause(exc), traceback.format_exc(limit=8))
                break
            if failed_reads < retries:
                failed_reads += 1
                continue
            index = first_index + pos - start
            failures.append(RowFailure(index, _row_name(source, unit, pos), "dataset", f"{type(exc).__name__}: {exc}",
                                       traceback.format_exc(limit=8)))
            pos, failed_reads = pos + 1, 0
            continue
        if pos < stop:
            # the unit holds fewer rows than listed: truncated, changed during the job, or units() miscounts it
            unit_retry.give_up(unit.id, f"it yielded {pos} rows but units() listed {unit.rows}: the input is truncated "
                               "or changed during the job, or units() miscounts it")
            failures += _unit_failures(source, unit, pos, stop, first_index + pos - start,
                                       unit_retry.given_up(unit.id) or "", "")
            break
    return samples, failures


def _rows_in(batch: Any) -> Optional[int]:
    """The row count of a batch from ``read_batch`` (a dict of tensors and lists that agree), else None."""
    if not isinstance(batch, dict) or not batch:
        return None
    sizes = set()
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            sizes.add(int(value.shape[0]))
        elif isinstance(value, list):
            sizes.add(len(value))
        else:
            return None
    return sizes.pop() if len(sizes) == 1 else None


def concat_batches(parts: list) -> Optional[dict]:
    """The batches of consecutive pieces as one (tensors concatenated, lists joined), or None when they do not
    line up (other keys, dtypes or row shapes: the rows' collation would then differ, so the per-row path decides)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    keys = list(first)
    out = {}
    for key in keys:
        values = []
        for part in parts:
            if list(part) != keys:
                return None
            value = part[key]
            if isinstance(first[key], torch.Tensor):
                if (not isinstance(value, torch.Tensor) or value.dtype != first[key].dtype
                        or value.shape[1:] != first[key].shape[1:]):
                    return None
            elif type(value) is not type(first[key]):
                return None
            values.append(value)
        out[key] = torch.cat(values) if isinstance(first[key], torch.Tensor) else [v for part in values for v in part]
    return out


class SourceDataset(FetchPool, Dataset):
    """Reads tickets of a sharded source in DataLoader workers: the units a batch spans, concurrently
    with ``fetch_threads > 1`` (one thread per unit piece; ``None`` chooses them as it reads), each streamed with
    per-row isolation.

    With ``batched`` (the DataLoader collates with ``default_collate``) and a source that has ``read_batch``,
    a ticket is read as batches of its unit pieces, concatenated, and handed on already collated; a piece the
    source does not read batched (None) sends the whole ticket down the per-row path. A batched read that raises
    or returns another row count than asked for is a failure of its unit (``UnitRetry``).
    """

    def __init__(self, source: Any, layout: SourceLayout, row_retries: int = 1, fetch_threads: Optional[int] = 1,
                 batched: bool = False, unit_retry: Optional[UnitRetry] = None) -> None:
        self.source = source
        self.layout = layout
        self.row_retries = row_retries
        self.unit_retry = unit_retry or UnitRetry()
        self.fetch_threads = fetch_threads
        # a source that keeps the base class's read_batch (which returns None) is read row by row at once
        self.batched = (batched and callable(getattr(source, "read_batch", None))
                        and getattr(type(source), "read_batch", None) is not ShardedSource.read_batch)
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pool_pid = -1

    def __len__(self) -> int:
        return self.layout.num_rows

    def __getitem__(self, index: int) -> Any:
        samples, failures, _ = self._read(index, index + 1)
        if failures:
            raise RuntimeError(failures[0].error)
        return samples[0][1]

    def _read(self, start: int, stop: int) -> tuple[list, list, int]:
        pieces = self.layout.pieces(start, stop)

        def one(piece: tuple[int, int, int]) -> tuple[list, list]:
            unit_index, lo, hi = piece
            first = self.layout.starts[unit_index] + lo
            return read_piece(self.source, self.layout.units[unit_index], lo, hi, first, self.row_retries,
                              self.unit_retry)

        results, threads = self._map(one, pieces)
        samples = [s for r in results for s in r[0]]
        failures = [f for r in results for f in r[1]]
        return samples, failures, threads

    def _read_batched(self, start: int, stop: int) -> tuple[Optional[dict], list, list, int]:
        """Rows ``[start, stop)`` as one collated batch, the indices of its rows and the failures of pieces whose
        unit failed, or a None batch when the per-row path must read them (a piece the source does not read as
        columns); and the threads that read it. A columnar read that raises is a failure of its unit: it has no
        row of its own to isolate, so it is retried as a unit, then the unit's rows fail with the cause."""
        pieces = self.layout.pieces(start, stop)

        def one(piece: tuple[int, int, int]) -> Any:
            unit_index, lo, hi = piece
            unit = self.layout.units[unit_index]

            def read() -> Optional[dict]:
                batch = self.source.read_batch(unit, lo, hi)
                if batch is not None and _rows_in(batch) != hi - lo:  # truncated, or a source that miscounts
                    raise UnitReadError(unit.id, f"read_batch gave {_rows_in(batch)} rows for its rows [{lo}, {hi}) "
                                                 "(a dict of tensors and lists of that many rows, or None, is due)")
                return batch

            try:
                return self.unit_retry.attempt(unit, read)
            except UnitReadError as exc:
                first = self.layout.starts[unit_index] + lo
                return _unit_failures(self.source, unit, lo, hi, first, exc.cause, traceback.format_exc(limit=8))

        parts, threads = self._map(one, pieces)
        if any(p is None for p in parts):
            return None, [], [], threads
        failures = [f for p in parts if isinstance(p, list) for f in p]
        batches, indices = [], []
        for (unit_index, lo, hi), part in zip(pieces, parts):
            if isinstance(part, dict):
                batches.append(part)
                first = self.layout.starts[unit_index] + lo
                indices.extend(range(first, first + hi - lo))
        if not batches:
            return None, [], failures, threads
        batch = concat_batches(batches)
        if batch is None:
            return None, [], [], threads
        return batch, (range(start, stop) if not failures else indices), failures, threads

    def __getitems__(self, ticket: BatchTicket) -> LoadedRows:
        if not ticket.indices:
            return LoadedRows(ticket, [], [], [])
        # a ticket is a contiguous range of one shard (see sampler.tickets_for_lease)
        start, stop = ticket.indices[0], ticket.indices[-1] + 1
        if self.batched:
            batch, indices, failures, threads = self._read_batched(start, stop)
            if batch is not None:
                return LoadedRows(ticket, [], indices, failures, batch=batch, fetch_threads=threads)
            if failures:  # every piece's unit failed
                return LoadedRows(ticket, [], [], failures, fetch_threads=threads)
        samples, failures, threads = self._read(start, stop)
        indices = compact_indices([i for i, _ in samples], ticket)
        return LoadedRows(ticket, [s for _, s in samples], indices, failures, fetch_threads=threads)
