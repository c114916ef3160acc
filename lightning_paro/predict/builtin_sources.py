"""Built-in sharded sources: Parquet files (a unit per row group), JSONL and text files, lists of paths or URLs.

Every row they yield is a dict that carries a stable input id under ``id_column`` (default
``input_id``): ``<file>:<row position in the file>``, or the value of a ``key`` column the user
names, so predictions join back to their inputs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

from lightning_paro.predict.sources import ShardedSource, SourceUnit, UnitReadError, file_fingerprint

log = logging.getLogger(__name__)

PathsLike = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]

DEFAULT_ID_COLUMN = "input_id"

# Row groups up to this many uncompressed bytes are read whole and cached (the batches of one row group then read it
# once); a larger one is streamed a slice at a time, so a DataLoader worker never holds a large file's row group.
WHOLE_ROW_GROUP_BYTES = 8 << 20
_STREAM_BATCH_ROWS = 16_384

# Rows between two remembered byte offsets of a line file: reading a range seeks to the offset before
# it and skips at most this many lines, so a shard deep in a large file does not rescan it from the top.
_LINE_INDEX_STRIDE = 1024


def _expand(paths: PathsLike, suffixes: tuple[str, ...]) -> list[tuple[str, str]]:
    """``(path, name)`` of every input file, in a fixed order: a file, a directory (searched recursively for
    ``suffixes``; names starting with ``_`` or ``.`` are skipped, as data readers do) or a list of either.
    ``name`` is the path relative to the directory given, or the path as given."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not items:
        raise ValueError("no input paths given")
    out: list[tuple[str, str]] = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            found = sorted(
                p for p in path.rglob("*")
                if p.is_file() and p.name.endswith(suffixes)
                and not any(part.startswith(("_", ".")) for part in p.relative_to(path).parts)
            )
            if not found:
                raise FileNotFoundError(f"no {'/'.join(suffixes)} files under {path}; check the path or the suffix")
            out.extend((str(p), p.relative_to(path).as_posix()) for p in found)
        elif path.is_file():
            out.append((str(path), str(item)))
        else:
            raise FileNotFoundError(f"input {item} does not exist")
    return out


def _digest(data: Any) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _row_group_digest(meta: Any, group: int) -> str:
    """A hash of a row group's footer entry: row count, byte sizes, and each column chunk's offsets, sizes,
    encodings and statistics (min, max, null count), which a rewrite of the same size changes."""
    return _digest(json.dumps(meta.row_group(group).to_dict(), sort_keys=True, default=str).encode())


def _joined_files(files: list, stored: Sequence[SourceUnit], name_of: Callable[[str], str],
                  unit_for: Callable[[str, str, list], list]) -> list[SourceUnit]:
    """Units of the listed files for a joining worker: ``unit_for(path, name, stored units of the file)`` for each
    file, in listing order (a file the job did not store gets no stored units, and so shows as added)."""
    by_name: dict = {}
    for unit in stored:
        by_name.setdefault(name_of(unit.id), []).append(unit)
    return [u for path, name in files for u in unit_for(path, name, by_name.get(name, []))]


_FALLBACKS_LOGGED: set = set()
_FALLBACKS_LOCK = threading.Lock()


def _log_fallback_once(kind: tuple, message: str) -> None:
    """Logs a fallback to the per-row path once per kind (a column and its type) in this process."""
    with _FALLBACKS_LOCK:
        if kind in _FALLBACKS_LOGGED:
            return
        _FALLBACKS_LOGGED.add(kind)
    log.info(message)


def _with_id(row: Any, id_column: str, row_id: Any, transform: Optional[Callable]) -> Any:
    if transform is not None:
        row = transform(row)
    if not isinstance(row, Mapping):
        raise TypeError(
            f"a row of this source must be a dict (to carry its id {id_column!r}), got {type(row).__name__}; "
            "return a dict from transform/read_fn"
        )
    if id_column not in row:
        row = dict(row)
        row[id_column] = row_id
    return row


class ParquetSource(ShardedSource):
    """Parquet input: a file, a directory of ``*.parquet`` files, or a list of files; one unit per row group.

    Args:
        paths: a file, a directory, or a list of files and directories.
        columns: the columns to read (default: all).
        key: a column whose value is the row's stable id (default: ``<file>:<row position in the file>``).
        id_column: the key under which the id is put in each row and written to the output
            (default: ``key`` when given, else ``"input_id"``).
        transform: called on each row's dict (column name to Python value) in the DataLoader worker; it
            returns the sample (a dict; the id is added if missing). A row it raises on is isolated.

    Without ``transform``, and when the DataLoader has no ``collate_fn`` of its own, batches are read column by
    column (``read_batch``): the same dict of tensors and lists ``default_collate`` makes of the rows, built
    from Arrow arrays via NumPy with no Python object per row, except for string columns and ids.
    """

    def __init__(
        self,
        paths: PathsLike,
        columns: Optional[Sequence[str]] = None,
        key: Optional[str] = None,
        id_column: Optional[str] = None,
        transform: Optional[Callable[[dict], Any]] = None,
    ) -> None:
        self.files = _expand(paths, (".parquet", ".parq"))
        self.columns = None if columns is None else list(columns)
        self.key = key
        self.id_column = id_column or key or DEFAULT_ID_COLUMN
        self.transform = transform
        self._cache: Optional[OrderedDict] = None
        self._lock: Optional[threading.Lock] = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_cache"], state["_lock"] = None, None  # per process: a lock does not pickle, a cache need not travel
        return state

    def units(self) -> list[SourceUnit]:
        import pyarrow.parquet as pq

        units = []
        for path, name in self.files:
            try:
                meta = pq.ParquetFile(path).metadata
            except Exception as exc:  # a corrupt or truncated footer, a vanished file: name it
                raise UnitReadError(name, f"{type(exc).__name__}: {exc}") from exc
            first = 0
            for group in range(meta.num_row_groups):
                rows = meta.row_group(group).num_rows
                fingerprint = file_fingerprint(path, rg=_row_group_digest(meta, group))
                units.append(SourceUnit(f"{name}#{group}", rows, fingerprint, (path, name, group, first)))
                first += rows
        return units

    def units_at_join(self, stored: Sequence[SourceUnit]) -> list[SourceUnit]:
        """The stored row groups of each listed file, with the file's ``stat`` fields; no file is opened."""

        def file_units(path: str, name: str, groups: list) -> list[SourceUnit]:
            fingerprint = file_fingerprint(path)
            if not groups:
                return [SourceUnit(f"{name}#0", 0, fingerprint)]
            units, first = [], 0
            for unit in groups:
                group = int(unit.id.rsplit("#", 1)[1])
                units.append(SourceUnit(unit.id, unit.rows, fingerprint, (path, name, group, first)))
                first += unit.rows
            return units

        return _joined_files(self.files, stored, lambda uid: uid.rsplit("#", 1)[0], file_units)

    def row_id(self, unit: SourceUnit, position: int) -> str:
        _, name, _, first = unit.ref
        return f"{name}:{first + position}"

    def _columns(self) -> Optional[list]:
        columns = self.columns
        if columns is not None and self.key is not None and self.key not in columns:
            columns = columns + [self.key]
        return columns

    def _table(self, unit: SourceUnit, start: int, stop: int):
        """Rows ``[start, stop)`` of the unit's row group as an Arrow table. A row group of up to
        ``WHOLE_ROW_GROUP_BYTES`` is read whole and the last two stay cached in this process, so the batches of one
        row group (and the fetch threads of a batch) read it once; a larger one is streamed from a cursor that
        moves forward through it (``iter_batches``), holding a slice at a time. A failure to open or decode the
        file is the unit's (``UnitReadError``)."""
        import pyarrow.parquet as pq

        if self._lock is None:
            self._lock = threading.Lock()
            self._cache = OrderedDict()
        with self._lock:
            cached = self._cache.get(unit.id)
            if cached is not None:
                self._cache.move_to_end(unit.id)
        path, _, group, _ = unit.ref
        try:
            if cached is None:
                parquet = pq.ParquetFile(path)
                if parquet.metadata.row_group(group).total_byte_size <= WHOLE_ROW_GROUP_BYTES:
                    cached = parquet.read_row_group(group, columns=self._columns())
                else:
                    cached = _RowGroupCursor(parquet, group, self._columns())
            if isinstance(cached, _RowGroupCursor):
                with cached.lock:
                    table = cached.take(start, stop)
            else:
                table = cached.slice(start, stop - start)
        except Exception as exc:
            raise UnitReadError(unit.id, f"{type(exc).__name__}: {exc}") from exc
        with self._lock:
            self._cache[unit.id] = cached
            while len(self._cache) > 2:
                self._cache.popitem(last=False)
        return table

    def read_batch(self, unit: SourceUnit, start: int, stop: int) -> Optional[dict]:
        """Rows ``[start, stop)`` of the row group as the batch ``default_collate`` makes of their dicts: numbers as
        1-D tensors (floats as float64, integers as int64, booleans as bool), strings and bytes as lists, the id
        column last when it is not a column. None (read row by row) with a ``transform``, nulls or other types."""
        import torch

        if self.transform is not None:
            return None
        table = self._table(unit, start, stop)
        batch: dict = {}
        for name, column in zip(table.column_names, table.columns):
            value = _collated_column(column)
            if value is None:
                reason = "nulls" if column.null_count else "a type not read as columns"
                _log_fallback_once((type(self).__name__, name, str(column.type), reason),
                                   f"{type(self).__name__}: column {name!r} ({column.type}) holds {reason}: batches "
                                   "with it are read row by row")
                return None
            batch[name] = value
        if self.id_column not in batch:
            if self.key is not None:
                key = batch[self.key]  # each row carries its key twice, as two collated columns
                batch[self.id_column] = key.clone() if isinstance(key, torch.Tensor) else list(key)
            else:
                _, name, _, first = unit.ref
                batch[self.id_column] = [f"{name}:{first + position}" for position in range(start, stop)]
        return batch

    def read(self, unit: SourceUnit, start: int, stop: int) -> Iterator[dict]:
        rows = self._table(unit, start, stop).to_pylist()
        for offset, row in enumerate(rows):
            row_id = row[self.key] if self.key is not None else self.row_id(unit, start + offset)
            yield _with_id(row, self.id_column, row_id, self.transform)


class _RowGroupCursor:
    """A forward stream through one large row group: rows are decoded a slice at a time, and a read that starts
    at or after the cursor goes on from it (the batches of a shard come in order); one before it starts again."""

    def __init__(self, parquet: Any, group: int, columns: Optional[list]) -> None:
        self.parquet, self.group, self.columns = parquet, group, columns
        self.lock = threading.Lock()
        self._restart()

    def _restart(self) -> None:
        self.batches = self.parquet.iter_batches(batch_size=_STREAM_BATCH_ROWS, row_groups=[self.group],
                                                 columns=self.columns)
        self.position = 0  # the row of the row group where ``buffer`` starts
        self.buffer = None

    def take(self, start: int, stop: int) -> Any:
        import pyarrow as pa

        if start < self.position:
            self._restart()
        parts = []
        while True:
            if self.buffer is None:
                batch = next(self.batches, None)
                if batch is None:
                    break
                self.buffer = pa.Table.from_batches([batch])
            end = self.position + self.buffer.num_rows
            if end > start:
                lo = max(start - self.position, 0)
                parts.append(self.buffer.slice(lo, min(stop, end) - self.position - lo))
            if end > stop:
                break
            self.position, self.buffer = end, None
            if end == stop:
                break
        if not parts:
            return self.parquet.schema_arrow.empty_table().select(self.columns or self.parquet.schema_arrow.names)
        return pa.concat_tables(parts)


def _collated_column(column: Any) -> Any:
    """An Arrow column as ``default_collate`` collates its Python values, or None for a type it is not done for."""
    import pyarrow as pa
    import torch

    if column.null_count:
        return None  # a None in a row: default_collate's own outcome is what the per-row path gives
    kind = column.type
    if pa.types.is_floating(kind) and not pa.types.is_float16(kind):
        return torch.from_numpy(_numbers(column, "float64"))
    if pa.types.is_integer(kind) and not pa.types.is_uint64(kind):
        return torch.from_numpy(_numbers(column, "int64"))
    if pa.types.is_boolean(kind):
        return torch.from_numpy(_numbers(column, "bool"))
    if (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
            or pa.types.is_large_binary(kind)):
        return column.to_pylist()
    return None


def _numbers(column: Any, dtype: str) -> Any:
    """A null-free numeric or boolean Arrow column as a new writable NumPy array of ``dtype``, read from the
    arrays' data buffers (``to_numpy`` would import pandas into every DataLoader worker)."""
    import numpy as np
    import pyarrow as pa

    out = np.empty(len(column), dtype=dtype)
    position = 0
    for chunk in column.chunks:
        n, data = len(chunk), chunk.buffers()[1]
        if pa.types.is_boolean(chunk.type):
            bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=chunk.offset + n, bitorder="little")
            values = bits[chunk.offset:]
        else:
            letter = "f" if pa.types.is_floating(chunk.type) else "i" if pa.types.is_signed_integer(chunk.type) else "u"
            item = np.dtype(f"={letter}{chunk.type.bit_width // 8}")
            values = np.frombuffer(data, dtype=item, count=n, offset=chunk.offset * item.itemsize)
        out[position:position + n] = values
        position += n
    return out


class _LineSource(ShardedSource):
    """Files of one row per non-blank line; one unit per file, read from a remembered offset near the range."""

    suffixes: tuple[str, ...] = ()

    def __init__(
        self,
        paths: PathsLike,
        key: Optional[str] = None,
        id_column: Optional[str] = None,
        transform: Optional[Callable[[Any], Any]] = None,
        encoding: str = "utf-8",
    ) -> None:
        self.files = _expand(paths, self.suffixes)
        self.key = key
        self.id_column = id_column or key or DEFAULT_ID_COLUMN
        self.transform = transform
        self.encoding = encoding

    def parse(self, line: str) -> dict:
        raise NotImplementedError

    def units(self) -> list[SourceUnit]:
        units = []
        for path, name in self.files:
            rows, offsets, digest = _scan_lines(path)
            units.append(SourceUnit(name, rows, file_fingerprint(path, blake2b=digest), (path, offsets)))
        return units

    def units_at_join(self, stored: Sequence[SourceUnit]) -> list[SourceUnit]:
        """The stored row count of each listed file, with its ``stat`` fields; no file is opened (a DataLoader
        worker indexes the offsets of a file when it first reads it)."""

        def file_unit(path: str, name: str, units: list) -> list[SourceUnit]:
            rows = units[0].rows if units else 0
            return [SourceUnit(name, rows, file_fingerprint(path), (path, None))]

        return _joined_files(self.files, stored, lambda uid: uid, file_unit)

    def _offsets(self, path: str) -> list:
        """The remembered line offsets of a file, indexed once per process (units of a joining worker carry none)."""
        with _OFFSETS_LOCK:
            offsets = _OFFSETS.get(path)
        if offsets is None:
            _, offsets, _ = _scan_lines(path)
            with _OFFSETS_LOCK:
                _OFFSETS[path] = offsets
        return offsets

    def read(self, unit: SourceUnit, start: int, stop: int) -> Iterator[dict]:
        path, offsets = unit.ref
        if offsets is None:
            offsets = self._offsets(path)
        if start >= stop:
            return
        if start // _LINE_INDEX_STRIDE >= len(offsets):
            raise UnitReadError(unit.id, f"it holds fewer than {start + 1} rows: truncated or changed during the job")
        with open(path, "rb") as f:
            f.seek(offsets[start // _LINE_INDEX_STRIDE])
            position = start - start % _LINE_INDEX_STRIDE
            for raw in f:
                if not raw.strip():
                    continue
                if position >= stop:
                    return
                if position >= start:
                    row = self.parse(raw.decode(self.encoding).rstrip("\r\n"))
                    row_id = row[self.key] if self.key is not None else self.row_id(unit, position)
                    yield _with_id(row, self.id_column, row_id, self.transform)
                position += 1


_OFFSETS: dict = {}
_OFFSETS_LOCK = threading.Lock()


def _scan_lines(path: str) -> tuple[int, list, str]:
    """A line file's rows (non-blank lines), the byte offset of every ``_LINE_INDEX_STRIDE``-th row, and a hash of
    its bytes, in one pass."""
    offsets, rows, offset = [], 0, 0
    digest = hashlib.blake2b(digest_size=8)
    with open(path, "rb") as f:
        for line in f:
            digest.update(line)
            if line.strip():
                if rows % _LINE_INDEX_STRIDE == 0:
                    offsets.append(offset)
                rows += 1
            offset += len(line)
    return rows, offsets, digest.hexdigest()


class JsonlSource(_LineSource):
    """JSON Lines input (a file, a directory of ``*.jsonl``/``*.json`` files, or a list): one row per non-blank line.

    Args:
        paths: a file, a directory, or a list of files and directories.
        key: a field whose value is the row's stable id (default: ``<file>:<row position in the file>``).
        id_column: the key under which the id is put in each row (default: ``key`` or ``"input_id"``).
        transform: called on each parsed object; returns the sample (a dict). A row it raises on is isolated.
        encoding: the files' text encoding.
    """

    suffixes = (".jsonl", ".json", ".ndjson")

    def parse(self, line: str) -> dict:
        return json.loads(line)


class TextSource(_LineSource):
    """Text input: one row ``{"text": line}`` per non-blank line of each file (``*.txt`` in a directory).

    Arguments as for ``JsonlSource``; ``key`` is not available (a line has no fields).
    """

    suffixes = (".txt",)

    def parse(self, line: str) -> dict:
        return {"text": line}


class PathSource(ShardedSource):
    """A list of paths or URLs, one row each, read by a function you give (an image, a document, an object).

    Each path is a unit of one row, so a shard is a run of paths and with ``fetch_threads > 1`` the
    paths of a batch are read concurrently.

    Args:
        paths: the paths or URLs, in a fixed order.
        read_fn: a picklable function ``read_fn(path) -> dict`` (called in DataLoader workers); a path it
            raises on is isolated as a failed row.
        id_column: the key under which the path is put in each row as its id (default ``"input_id"``).
        fingerprint: ``fingerprint(path) -> str`` identifying each input's content (an ETag, a hash), checked
            when the job is resumed (default: the size and modification time of local files, nothing for URLs).
    """

    def __init__(
        self,
        paths: Iterable[Union[str, os.PathLike]],
        read_fn: Callable[[str], Any],
        id_column: str = DEFAULT_ID_COLUMN,
        fingerprint: Optional[Callable[[str], str]] = None,
    ) -> None:
        self.paths = [str(p) for p in paths]
        self.read_fn = read_fn
        self.id_column = id_column
        self.fingerprint = fingerprint

    def units(self) -> list[SourceUnit]:
        def identity(path: str) -> str:
            if self.fingerprint is not None:
                return str(self.fingerprint(path))
            return file_fingerprint(path) if os.path.isfile(path) else ""

        return [SourceUnit(path, 1, identity(path)) for path in self.paths]

    def units_at_join(self, stored: Sequence[SourceUnit]) -> list[SourceUnit]:
        """Local files with their ``stat`` fields, other paths with no fingerprint (a ``fingerprint`` function,
        which may fetch each object, is called when the job is created or resumed, not at join)."""
        def identity(path: str) -> str:
            return file_fingerprint(path) if self.fingerprint is None and os.path.isfile(path) else ""

        return [SourceUnit(path, 1, identity(path)) for path in self.paths]

    def row_id(self, unit: SourceUnit, position: int) -> str:
        return unit.id

    def read(self, unit: SourceUnit, start: int, stop: int) -> Iterator[dict]:
        if start < stop:
            yield _with_id(self.read_fn(unit.id), self.id_column, unit.id, None)
