"""Completing a job: the manifest, the errors of poisoned shards, clean-up and the success marker."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Optional

from lightning_paro.predict import shard_files
from lightning_paro.predict.ledger import COMMITTED, LEASED, POISONED, SPLIT, TODO, Ledger

MANIFEST_NAME = "_manifest.json"
"""The job's manifest. Its leading ``_`` keeps it out of what dataset readers (Arrow, pandas, DuckDB, Spark) take for
data when they read the output directory."""
SUCCESS_NAME = "_SUCCESS"


class JobIncompleteError(RuntimeError):
    """The job still has shards to do, so it has no manifest yet."""


# Temporary names of finalisers' own files: not swept by peers (which would race a concurrent finaliser);
# one left by a finaliser that crashed is removed by a later finalise once it is clearly stale.
_FINAL_TEMP_PREFIX = ".final-tmp-"
_STALE_FINAL_TEMP_S = 300.0


def _write_atomically(path: Path, text: str) -> None:
    temp = path.with_name(f"{_FINAL_TEMP_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}")
    with open(temp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)


def finalize_job(
    output_dir: Path, ledger: Ledger, fmt: str, index_column: str, id_column: Optional[str], max_failed_rows: int
) -> dict:
    """Writes ``_manifest.json`` (and ``_SUCCESS`` when within the error budget) for a job whose shards are all done.

    Idempotent and safe to run from several workers at once: every step is an atomic replace of
    identical content or the removal of files no committed shard refers to.
    """
    shards = [s for s in ledger.shards() if s.state != SPLIT]
    pending = [s for s in shards if s.state in (TODO, LEASED)]
    if pending:
        raise JobIncompleteError(f"{len(pending)} shards of job {ledger.job!r} are not done yet")
    committed = [s for s in shards if s.state == COMMITTED]
    poisoned = [s for s in shards if s.state == POISONED]
    for shard in poisoned:
        errors = output_dir / shard_files.errors_file_name(shard.start_row, shard.end_row)
        if shard_files.existing_errors_file(output_dir, shard.start_row, shard.end_row) is None:
            records = [
                {index_column: row, "row": row, "stage": "worker", "error": shard.error, "traceback": "",
                 "shard_start": shard.start_row, "shard_end": shard.end_row, "attempt": shard.attempts, "worker": None}
                for row in range(shard.start_row, shard.end_row)
            ]
            temp = errors.with_name(f"{_FINAL_TEMP_PREFIX}{errors.name}.{uuid.uuid4().hex[:8]}")
            with open(temp, "w") as f:
                f.write("".join(json.dumps(r) + "\n" for r in records))
                f.flush()
                os.fsync(f.fileno())
            shard_files.publish(temp, errors)
    referenced = {s.file for s in committed if s.file}
    _remove_unreferenced(output_dir, fmt, referenced)
    failed = sum(s.rows_failed or 0 for s in committed) + sum(s.num_rows for s in poisoned)
    files = [
        {"file": s.file, "start_row": s.start_row, "end_row": s.end_row, "rows": s.rows_written}
        for s in committed
        if s.file
    ]
    num_rows, _ = ledger.job_shape()
    manifest = {
        "job": ledger.job,
        "format": fmt,
        "index_column": index_column,
        "id_column": id_column,
        "num_rows": num_rows,
        "rows_written": sum(f["rows"] for f in files),
        "rows_failed": failed,
        "max_failed_rows": max_failed_rows,
        "files": files,
        "errors_files": sorted(
            str(p.relative_to(output_dir)) for p in (output_dir / shard_files.ERRORS_DIR).glob("part-*.jsonl")
        ),
        "completed_at": time.time(),
    }
    _write_atomically(output_dir / MANIFEST_NAME, json.dumps(manifest, indent=1))
    if failed <= max_failed_rows:
        _write_atomically(output_dir / SUCCESS_NAME, "")
    return manifest


def _remove_unreferenced(output_dir: Path, fmt: str, referenced: set) -> None:
    """Deletes leftover temporary files and published files of superseded shards."""
    directories = [output_dir, output_dir / shard_files.ERRORS_DIR]
    for directory in directories:
        for path in directory.glob(f"{shard_files.TEMP_PREFIX}*"):
            path.unlink(missing_ok=True)
    for path in output_dir.glob(f"part-*.{fmt}"):
        if path.name not in referenced:
            path.unlink(missing_ok=True)
    now = time.time()
    for path in [p for directory in directories for p in directory.glob(f"{_FINAL_TEMP_PREFIX}*")]:
        try:
            if now - path.stat().st_mtime > _STALE_FINAL_TEMP_S:
                path.unlink(missing_ok=True)
        except FileNotFoundError:
            pass


def read_manifest(output_dir: Path) -> Optional[dict]:
    """The manifest of a completed job; None while the job runs."""
    path = Path(output_dir) / MANIFEST_NAME
    return json.loads(path.read_text()) if path.exists() else None
