"""Sources as shards: inputs stored as units (files, row groups, objects) mapped onto the ledger's row ranges.

A source lists its units up front with their row counts; the job's row index space is the
concatenation of the units, so the ledger, the writer, the manifest and resume work unchanged on
half-open ranges of it. Reading a range asks the source for the rows of one unit's sub-range at a
time, so a unit is never loaded whole unless the source itself chooses to.

A source that stores columns (Parquet) may also read a sub-range as one batch, already collated
(``read_batch``): the batch of a ticket is then built from columns, without a Python object per row,
and the per-row path remains for ranges the batched read cannot give (a row that raises included).
"""

from __future__ import annotations

import bisect
import itertools
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import torch
from torch.utils.data import Dataset

from lightning_paro.predict.batch import BatchTicket, RowFailure
from lightning_paro.predict.dataset import FetchPool, LoadedRows, compact_indices


@dataclass(frozen=True)
class SourceUnit:
    """One unit of a source: a file, a Parquet row group, an object; the smallest thing read on its own."""

    id: str
    """Stable name of the unit (a path, ``path#row-group``); it names rows in ids and errors and detects changes."""
    rows: int
    """Number of rows in the unit."""
    fingerprint: str = ""
    """What identifies the unit's content (a file size, an ETag); a change makes resuming the job an error."""
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
        """The units, in a fixed order, with their row counts. Called once per worker when it joins the job."""
        raise NotImplementedError

    def read(self, unit: SourceUnit, start: int, stop: int) -> Iterable[Any]:
        """Yields rows ``start`` to ``stop`` (exclusive) of ``unit``, one sample each, streaming."""
        raise NotImplementedError

    def read_batch(self, unit: SourceUnit, start: int, stop: int) -> Optional[dict]:
        """Optional: rows ``start`` to ``stop`` (exclusive) of ``unit`` as one batch, or None to read them row by row.

        The batch must be what ``torch.utils.data.default_collate`` makes of the rows ``read`` yields for the
        range (the same keys in the same order, dtypes and shapes: a dict of tensors whose first dimension is
        ``stop - start``, or of per-row lists such as strings), so ``predict_step`` cannot tell the two apart.
        It is used only when the DataLoader has no ``collate_fn`` of its own; if it raises, the range is read
        again row by row so that a failing row is isolated.
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


def _row_name(source: Any, unit: SourceUnit, position: int) -> str:
    namer = getattr(source, "row_id", None)
    return namer(unit, position) if callable(namer) else f"{unit.id}:{position}"


def read_piece(source: Any, unit: SourceUnit, start: int, stop: int, first_index: int, retries: int) -> tuple[list, list]:
    """Rows ``[start, stop)`` of one unit as ``(samples, failures)``, isolating rows that raise.

    When the source's row stream raises after ``k`` rows, row ``start + k`` is the one that failed:
    reading restarts there (``retries`` times), then that row is reported and reading goes on after it.
    ``first_index`` is the global index of row ``start``.
    """
    samples: list = []
    failures: list = []
    pos, failed_reads = start, 0
    while pos < stop:
        try:
            for sample in itertools.islice(source.read(unit, pos, stop), stop - pos):
                samples.append((first_index + pos - start, sample))
                pos += 1
                failed_reads = 0
        except Exception as exc:  # a poison row must not take the worker down: it is reported instead
            if failed_reads < retries:
                failed_reads += 1
                continue
            index = first_index + pos - start
            failures.append(RowFailure(index, _row_name(source, unit, pos), "dataset", f"{type(exc).__name__}: {exc}",
                                       traceback.format_exc(limit=8)))
            pos, failed_reads = pos + 1, 0
            continue
        if pos < stop:
            # the unit holds fewer rows than listed: it changed after the job started, or units() is wrong
            message = (f"source unit {unit.id!r} yielded {pos} rows but units() listed {unit.rows}; the input "
                       "changed during the job or units() miscounts it")
            for missing in range(pos, stop):
                failures.append(RowFailure(first_index + missing - start, _row_name(source, unit, missing), "dataset",
                                           message, ""))
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
    source does not read batched, or a batched read that raises or returns a wrong row count, sends the whole
    ticket down the per-row path, which isolates the failing rows.
    """

    def __init__(self, source: Any, layout: SourceLayout, row_retries: int = 1, fetch_threads: Optional[int] = 1,
                 batched: bool = False) -> None:
        self.source = source
        self.layout = layout
        self.row_retries = row_retries
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
            return read_piece(self.source, self.layout.units[unit_index], lo, hi, first, self.row_retries)

        results, threads = self._map(one, pieces)
        samples = [s for r in results for s in r[0]]
        failures = [f for r in results for f in r[1]]
        return samples, failures, threads

    def _read_batched(self, start: int, stop: int) -> tuple[Optional[dict], int]:
        """Rows ``[start, stop)`` as one collated batch, or None when the per-row path must read them; and the
        threads that read it."""
        pieces = self.layout.pieces(start, stop)

        def one(piece: tuple[int, int, int]) -> Optional[dict]:
            unit_index, lo, hi = piece
            batch = self.source.read_batch(self.layout.units[unit_index], lo, hi)
            return batch if batch is not None and _rows_in(batch) == hi - lo else None

        try:
            parts, threads = self._map(one, pieces)
        except Exception:  # a poison row, a failed read: the per-row path reads the range again and isolates it
            return None, 0
        if not parts or any(p is None for p in parts):
            return None, threads
        return concat_batches(parts), threads

    def __getitems__(self, ticket: BatchTicket) -> LoadedRows:
        if not ticket.indices:
            return LoadedRows(ticket, [], [], [])
        # a ticket is a contiguous range of one shard (see sampler.tickets_for_lease)
        start, stop = ticket.indices[0], ticket.indices[-1] + 1
        if self.batched:
            batch, threads = self._read_batched(start, stop)
            if batch is not None:
                return LoadedRows(ticket, [], range(start, stop), [], batch=batch, fetch_threads=threads)
        samples, failures, threads = self._read(start, stop)
        indices = compact_indices([i for i, _ in samples], ticket)
        return LoadedRows(ticket, [s for _, s in samples], indices, failures, fetch_threads=threads)
