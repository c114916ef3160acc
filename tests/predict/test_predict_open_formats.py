"""A finished prediction directory is a plain Parquet dataset: pyarrow, pandas and DuckDB read it as it is, as do the
package's own readers and its status command."""

from __future__ import annotations

import json
import os

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from lightning_paro.predict import read_errors, read_predictions
from lightning_paro.predict.__main__ import status_report
from predict_app import JobSpec, run_job

POISON = (7, 42)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One completed job with two poison rows, so the errors directory holds files too."""
    out = tmp_path_factory.mktemp("open") / "out"
    run_job(JobSpec(output_dir=str(out), rows=120, shard_size=40, poison_model_rows=POISON, max_failed_rows=2))
    return out


def _expected_rows() -> list[int]:
    return [i for i in range(120) if i not in POISON]


def test_every_bookkeeping_name_is_hidden_from_dataset_readers(finished):
    visible = sorted(p.name for p in finished.iterdir() if not p.name.startswith(("_", ".")))
    assert visible and all(name.startswith("part-") and name.endswith(".parquet") for name in visible), visible
    assert (finished / "_manifest.json").is_file() and (finished / "_SUCCESS").is_file()
    assert len(list((finished / "_errors").glob("part-*.jsonl"))) == 2


def test_pyarrow_dataset_and_read_table_read_the_directory(finished):
    table = pq.read_table(finished)
    assert sorted(table.column("row_id").to_pylist()) == _expected_rows()
    dataset = ds.dataset(finished, format="parquet")
    assert dataset.count_rows() == len(_expected_rows())
    assert dataset.to_table().sort_by("row_id").column("y").to_pylist() == [3.0 * i + 1.0 for i in _expected_rows()]


def test_pandas_reads_the_directory(finished):
    import pandas as pd

    frame = pd.read_parquet(finished).sort_values("row_id")
    assert frame["row_id"].tolist() == _expected_rows()
    assert frame["y"].tolist() == [3.0 * i + 1.0 for i in _expected_rows()]


def test_duckdb_reads_the_shard_files(finished):
    import duckdb

    rows = duckdb.sql(f"SELECT row_id, y FROM read_parquet('{finished}/*.parquet') ORDER BY row_id").fetchall()
    assert rows == [(i, 3.0 * i + 1.0) for i in _expected_rows()]


def test_the_packages_readers_and_status_read_the_directory(finished):
    manifest = json.loads((finished / "_manifest.json").read_text())
    assert read_predictions(finished).column("row_id").to_pylist() == _expected_rows()
    assert sorted(e["row_id"] for e in read_errors(finished)) == list(POISON)
    report = status_report(finished, None, os.path.abspath(finished))
    assert report["manifest"] and report["success"] and manifest["rows_failed"] == 2
