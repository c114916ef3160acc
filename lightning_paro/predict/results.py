"""Reading a job's output back: the whole result in input order, or batch by batch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from lightning_paro.predict import shard_files
from lightning_paro.predict.manifest import MANIFEST_NAME, JobIncompleteError, read_manifest


def _shard_paths(output_dir: Path, allow_incomplete: bool) -> tuple[list[Path], str]:
    manifest = read_manifest(output_dir)
    if manifest is not None:
        return [output_dir / f["file"] for f in sorted(manifest["files"], key=lambda f: f["start_row"])], manifest["format"]
    if not allow_incomplete:
        raise JobIncompleteError(
            f"{output_dir} has no {MANIFEST_NAME}: the prediction job has not completed. See its progress with "
            f"`python -m lightning_paro.predict status {output_dir}`, or pass allow_incomplete=True to read the "
            "shards published so far."
        )
    paths = sorted(p for p in output_dir.glob("part-*") if p.suffix.lstrip(".") in shard_files.FORMATS)
    fmt = paths[0].suffix.lstrip(".") if paths else "parquet"
    return paths, fmt


def _read_file(path: Path, fmt: str, columns: Optional[Sequence[str]]) -> pa.Table:
    if fmt == "parquet":
        return pq.read_table(path, columns=list(columns) if columns else None)
    table = pa_json.read_json(path)
    return table.select(list(columns)) if columns else table


def read_predictions(
    output_dir: Union[str, Path], columns: Optional[Sequence[str]] = None, allow_incomplete: bool = False
) -> pa.Table:
    """All predictions of a completed job as one Arrow table, rows in input (dataset index) order."""
    output_dir = Path(output_dir)
    paths, fmt = _shard_paths(output_dir, allow_incomplete)
    tables = [_read_file(p, fmt, columns) for p in paths]
    if not tables:
        return pa.table({})
    return pa.concat_tables(tables, promote_options="default")


def iter_predictions(
    output_dir: Union[str, Path],
    batch_size: int = 65_536,
    columns: Optional[Sequence[str]] = None,
    allow_incomplete: bool = False,
) -> Iterator[pa.RecordBatch]:
    """The predictions as record batches in input order, reading one shard file at a time (bounded memory)."""
    output_dir = Path(output_dir)
    paths, fmt = _shard_paths(output_dir, allow_incomplete)
    for path in paths:
        if fmt == "parquet":
            yield from pq.ParquetFile(path).iter_batches(batch_size=batch_size, columns=list(columns) if columns else None)
        else:
            yield from _read_file(path, fmt, columns).to_batches(max_chunksize=batch_size)


def read_errors(output_dir: Union[str, Path]) -> list[dict]:
    """Every row isolated as poison: its index, stage, exception and traceback, in input order."""
    paths = (Path(output_dir) / shard_files.ERRORS_DIR).glob("part-*.jsonl")
    records = []
    for path in sorted(paths, key=lambda p: p.name):
        with open(path) as f:
            records.extend(json.loads(line) for line in f if line.strip())
    return records
