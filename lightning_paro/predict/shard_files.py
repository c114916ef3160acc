"""Exactly-once shard files: write to a temporary name, fsync, publish without replacing, then commit.

A shard's final file name is a function of its row range only, so every attempt at the same shard
(a redo after a crash, a speculative duplicate) targets the same name. Publishing uses a hard link,
which fails if the name exists: the first complete file wins and later attempts only acknowledge it.
A file under its final name is always complete, because it is fsynced before it gets that name.
"""

from __future__ import annotations

import errno
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

from lightning_paro.durable import fsync_dir

FORMATS = ("parquet", "jsonl")
TEMP_PREFIX = ".tmp-"
ERRORS_DIR = "_errors"
"""Where rows isolated as poison are written. Every name in an output directory that is not a data file starts with
``_`` or ``.``, which Arrow, Spark, pandas and DuckDB skip when they read the directory as a dataset."""


class OutputNotWritableError(OSError):
    """The output location cannot be written (permissions, missing mount, disk full)."""


def shard_file_name(start_row: int, end_row: int, fmt: str) -> str:
    """The final, attempt-independent name of a shard's data file."""
    return f"part-{start_row:012d}-{end_row:012d}.{fmt}"


def errors_file_name(start_row: int, end_row: int) -> str:
    """The final name of a shard's errors file, relative to the output directory."""
    return f"{ERRORS_DIR}/part-{start_row:012d}-{end_row:012d}.jsonl"


def existing_errors_file(output_dir: Path, start_row: int, end_row: int) -> Optional[Path]:
    """A shard's published errors file; None if there is none."""
    path = output_dir / errors_file_name(start_row, end_row)
    return path if path.exists() else None


def describe_os_error(exc: OSError, path: Path) -> str:
    """A one-line explanation of a write failure with the fix."""
    if exc.errno == errno.ENOSPC:
        hint = "the disk is full: free space or choose another output_dir"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = "it is not writable: fix its permissions or choose another output_dir"
    else:
        hint = "check that the location exists and is writable"
    return (
        f"Cannot write prediction output under {path} ({type(exc).__name__}: {exc.strerror or exc}); {hint}. "
        "Shards already committed stay valid and rerunning the same job resumes from them."
    )


def check_output_dir(output_dir: Path) -> None:
    """Creates ``output_dir`` and proves it writable with a durable probe file, or raises a clear error."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / ERRORS_DIR).mkdir(exist_ok=True)
        probe = output_dir / f"{TEMP_PREFIX}probe-{uuid.uuid4().hex}"
        with open(probe, "wb") as f:
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
        # a peer finalising the job sweeps every temporary file, this probe included: the write succeeded
        probe.unlink(missing_ok=True)
    except OSError as exc:
        raise OutputNotWritableError(exc.errno, describe_os_error(exc, output_dir)) from exc


@dataclass(frozen=True)
class PublishResult:
    """The outcome of publishing a finished temporary file."""

    created: bool
    """False when a complete file already had the final name (a redo or a speculative duplicate)."""
    path: Path
    """The final path."""


def publish(temp: Path, final: Path) -> PublishResult:
    """Gives a fully written, fsynced ``temp`` the name ``final`` unless that name exists already."""
    try:
        os.link(temp, final)
        created = True
    except FileExistsError:
        created = False
    except FileNotFoundError:
        # our temporary file was cleaned up by a finalising peer: only fine if the shard is there
        if not final.exists():
            raise
        created = False
    try:
        temp.unlink()
    except FileNotFoundError:
        pass
    fsync_dir(final.parent)
    return PublishResult(created=created, path=final)


def temp_path_for(final: Path, owner: str) -> Path:
    return final.with_name(f"{TEMP_PREFIX}{final.name}.{owner}.{uuid.uuid4().hex[:8]}")


class ShardFileWriter:
    """Streams one shard's rows, batch by batch, into a temporary file; ``finish`` publishes it.

    Parquet batches are gathered into row groups of about ``row_group_rows`` rows: one row group per
    small batch would make files slow to write and to read, while memory stays bounded by one group.
    """

    def __init__(self, final: Path, fmt: str, owner: str, row_group_rows: int = 8192) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
        self.final = final
        self.fmt = fmt
        self.temp = temp_path_for(final, owner)
        self.rows = 0
        # Parquet writes through its own sink; JSONL through a plain binary file
        self._file = open(self.temp, "wb") if fmt == "jsonl" else None
        self._parquet: Optional[pq.ParquetWriter] = None
        self._schema: Optional[pa.Schema] = None
        self._row_group_rows = row_group_rows
        self._pending: list[pa.Table] = []
        self._pending_rows = 0

    def write(self, table: pa.Table) -> None:
        if self._schema is None:
            self._schema = table.schema
        elif table.schema != self._schema:
            table = table.cast(self._schema)
        if self.fmt == "parquet":
            self._pending.append(table)
            self._pending_rows += table.num_rows
            if self._pending_rows >= self._row_group_rows:
                self._flush_row_group()
        else:
            lines = "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in table.to_pylist())
            self._file.write(lines.encode())
        self.rows += table.num_rows

    def _flush_row_group(self) -> None:
        if not self._pending:
            return
        if self._parquet is None:
            self._parquet = pq.ParquetWriter(str(self.temp), self._schema)
        self._parquet.write_table(pa.concat_tables(self._pending), row_group_size=max(self._pending_rows, 1))
        self._pending, self._pending_rows = [], 0

    def finish(self) -> PublishResult:
        if self.fmt == "parquet":
            self._flush_row_group()
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
        else:
            if self._parquet is None:  # no rows at all: an empty file would have no schema
                raise ValueError("a Parquet shard file needs at least one written batch")
            self._parquet.close()
            try:
                fd = os.open(self.temp, os.O_RDONLY)
            except FileNotFoundError:
                # a peer that saw the job complete swept our temporary file: fine if the shard is there
                if self.final.exists():
                    return PublishResult(created=False, path=self.final)
                raise
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return publish(self.temp, self.final)

    def abort(self) -> None:
        try:
            if self._parquet is not None:
                self._parquet.close()
        except Exception:
            pass
        try:
            if self._file is not None:
                self._file.close()
        except Exception:
            pass
        try:
            self.temp.unlink()
        except FileNotFoundError:
            pass


def write_errors_file(final: Path, records: list[dict], owner: str, tries: int = 3) -> PublishResult:
    """Writes a shard's poison-row records (one JSON object a line) with the same publish protocol."""
    for attempt in range(tries):
        temp = temp_path_for(final, owner)
        with open(temp, "wb") as f:
            for record in records:
                f.write((json.dumps(record, default=str) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())
        try:
            return publish(temp, final)
        except FileNotFoundError:
            # swept by a peer finalising the job at this moment: write it again
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def count_rows(path: Path, fmt: str) -> int:
    """Rows in a published shard file, read from Parquet metadata or by counting lines."""
    if fmt == "parquet":
        return pq.ParquetFile(path).metadata.num_rows
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def publish_shard(writer: ShardFileWriter) -> PublishResult:
    """Finishes and publishes a shard's data file (a seam where tests inject crashes after the rename)."""
    return writer.finish()
