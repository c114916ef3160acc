"""Sharded sources: Parquet and JSONL files predicted by killed and restarted workers, poison rows inside a unit,
resume refused over changed inputs, and the shard plan along units."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow as pa
import torch
import pyarrow.parquet as pq
import pytest

from lightning_paro.predict import read_errors, read_predictions
from lightning_paro.predict.config import LEDGER_FILE_NAME
from lightning_paro.predict.ledger import COMMITTED, LEASED, JobMismatchError, Ledger
from lightning_paro.predict.sources import SourceLayout, SourceUnit
from predict_app import JobSpec, run_job
from predict_procs import Workers

# files of uneven row groups (rows per group): tiny groups packed into one shard, large ones cut inside
PARQUET_LAYOUT = {
    "a.parquet": [7, 23, 55],
    "b/c.parquet": [100],
    "b/d.parquet": [1, 2, 3, 90],
    "e.parquet": [40, 40, 41],
    "f.parquet": [13],
    "g.parquet": [200, 5],
}
JSONL_LAYOUT = {"a.jsonl": 130, "b.jsonl": 7, "c/d.jsonl": 260, "e.jsonl": 1, "f.jsonl": 222}


@pytest.fixture
def workers():
    pool = Workers()
    yield pool
    pool.cleanup()


def write_parquet_inputs(root: Path, layout: dict = PARQUET_LAYOUT) -> dict:
    """Writes the files; returns ``{input id: x}`` with a distinct ``x`` per input row."""
    expected, x = {}, 0
    for name, groups in layout.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with pq.ParquetWriter(path, pa.schema([("x", pa.float64()), ("note", pa.string())])) as writer:
            position = 0
            for rows in groups:
                values = [float(x + i) for i in range(rows)]
                writer.write_table(pa.table({"x": values, "note": [f"n{v}" for v in values]}))
                for v in values:
                    expected[f"{name}:{position}"] = v
                    position += 1
                x += rows
    (root / "_metadata_not_data.parquet").write_bytes(b"skipped: names starting with _ are not inputs")
    return expected


def write_jsonl_inputs(root: Path, layout: dict = JSONL_LAYOUT) -> dict:
    expected, x = {}, 1000
    for name, rows in layout.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for position in range(rows):
                f.write(json.dumps({"x": float(x), "text": "t" * (position % 5)}) + "\n")
                if position % 50 == 3:
                    f.write("\n")  # blank lines are not rows
                expected[f"{name}:{position}"] = float(x)
                x += 1
    return expected


def assert_joined_exactly(out: Path, expected: dict, skip: set = frozenset()) -> None:
    """Every input row appears exactly once, joined back to its input by id, with the right prediction."""
    table = read_predictions(out)
    ids = table.column("input_id").to_pylist()
    assert len(ids) == len(set(ids)), "an input row was written twice"
    assert sorted(table.column("row_id").to_pylist()) == sorted(set(table.column("row_id").to_pylist()))
    got = dict(zip(ids, table.column("y").to_pylist()))
    want = {k: v for k, v in expected.items() if k not in skip}
    assert set(got) == set(want)
    assert all(got[k] == pytest.approx(3.0 * want[k] + 1.0) for k in want)
    assert [p.name for p in out.rglob(".tmp-*")] == []
    assert (out / "_SUCCESS").exists()


def kill_midway_then_restart(workers: Workers, spec: JobSpec, out: Path) -> None:
    """3 workers; one is SIGKILLed while it holds a lease after shards were committed; a replacement joins."""
    for i in range(3):
        spec.worker_name = f"w{i}"
        workers.start(spec)
    ledger = Ledger(str(out / LEDGER_FILE_NAME), str(out.resolve()))
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, "no worker committed a shard and held another in time"
        shards = ledger.shards() if (out / LEDGER_FILE_NAME).exists() else []
        held = [s.owner for s in shards if s.state == LEASED]
        if any(s.state == COMMITTED for s in shards) and held:
            break
        time.sleep(0.05)
    victim = next(p for p, name in zip(workers.procs, ("w0", "w1", "w2")) if name == held[0])
    workers.kill(victim)
    assert victim.exitcode == -9
    spec.worker_name = "restarted"
    workers.start(spec)
    codes = workers.wait_all(timeout_s=60)
    assert sorted(codes) == [-9, 0, 0, 0], codes
    assert any(s.attempts >= 2 for s in ledger.shards()), "the killed worker's shard was never redone"
    ledger.close()


@pytest.mark.timeout(120)
def test_parquet_directory_with_kill9_and_restart_is_exact_and_joins_back(tmp_path, workers):
    inputs = tmp_path / "in"
    expected = write_parquet_inputs(inputs)
    out = tmp_path / "out"
    spec = JobSpec(output_dir=str(out), source=("parquet", str(inputs)), batch_size=10, shard_size=40,
                   step_sleep_s=0.08, lease_ttl_s=0.8, num_workers=1)
    kill_midway_then_restart(workers, spec, out)
    assert_joined_exactly(out, expected)
    shards = Ledger(str(out / LEDGER_FILE_NAME), str(out.resolve())).shards()
    # the 7-, 23- and 1-, 2-, 3-row groups share shards; the 100- and 200-row groups are cut inside
    assert max(s.num_rows for s in shards) <= 40 and len(shards) < 30


@pytest.mark.timeout(120)
def test_jsonl_files_with_kill9_and_restart_are_exact_and_join_back(tmp_path, workers):
    inputs = tmp_path / "in"
    expected = write_jsonl_inputs(inputs)
    out = tmp_path / "out"
    # two DataLoader processes per worker and two fetch threads each: units are read concurrently
    spec = JobSpec(output_dir=str(out), source=("jsonl", str(inputs)), batch_size=10, shard_size=50,
                   step_sleep_s=0.05, lease_ttl_s=0.8, num_workers=2, extra={"fetch_threads": 2})
    kill_midway_then_restart(workers, spec, out)
    assert_joined_exactly(out, expected)


def test_poison_rows_inside_a_unit_are_isolated_and_the_rest_of_the_unit_is_read(tmp_path):
    out = tmp_path / "out"
    # unit u1 holds rows 5..54: its stream raises at rows 12 and 13, so reading must restart after each
    spec = JobSpec(output_dir=str(out), source=("list", (5, 50, 0, 45)), poison_dataset_rows=(12, 13, 99),
                   poison_model_rows=(30,), max_failed_rows=4, shard_size=20, extra={"fetch_threads": 3})
    callback = run_job(spec)
    table = read_predictions(out)
    assert table.column("row_id").to_pylist() == [i for i in range(100) if i not in (12, 13, 30, 99)]
    assert table.column("y").to_pylist() == [3.0 * i + 1.0 for i in table.column("row_id").to_pylist()]
    assert table.column("input_id").to_pylist()[:6] == ["u0:0", "u0:1", "u0:2", "u0:3", "u0:4", "u1:0"]
    errors = {e["row_id"]: e for e in read_errors(out)}
    assert sorted(errors) == [12, 13, 30, 99]
    assert errors[12]["row"] == "u1:7" and "corrupt record 12" in errors[12]["error"]
    assert errors[99]["row"] == "u3:44" and errors[99]["stage"] == "dataset"
    assert errors[30]["stage"] == "predict_step"
    assert callback.manifest["rows_failed"] == 4


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_resume_over_changed_inputs_is_refused_naming_the_change(tmp_path, backend, request, job_name):
    inputs = tmp_path / "in"
    layout = {"a.parquet": [10, 5], "b.parquet": [20]}
    expected = write_parquet_inputs(inputs, layout)
    out = tmp_path / "out"
    ledger = request.getfixturevalue("postgres_url") if backend == "postgres" else None
    spec = JobSpec(output_dir=str(out), ledger=ledger, job_name=job_name, source=("parquet", str(inputs)),
                   shard_size=20)
    run_job(spec)
    run_job(spec)  # the same inputs: a resume, nothing to do
    assert_joined_exactly(out, expected)
    # the same rows, other content: the fingerprint (size, mtime, the row group's footer entry) tells
    pq.write_table(pa.table({"x": [float(i) for i in range(20)], "note": ["changed" * 9] * 20}), inputs / "b.parquet")
    with pytest.raises(JobMismatchError, match=r"inputs of job .* changed since it started \(b\.parquet#0: "
                                               r"size=\d+ mtime_ns=\d+ rg=\w+ -> size=\d+ mtime_ns=\d+ rg=\w+\)"):
        run_job(spec)
    pq.write_table(pa.table({"x": [1.0, 2.0], "note": ["a", "b"]}), inputs / "b.parquet")
    with pytest.raises(JobMismatchError, match=r"inputs of job .* changed .*b\.parquet#0: rows 20 -> 2.*new output_dir"):
        run_job(spec)
    pq.write_table(pa.table({"x": [1.0], "note": ["a"]}), inputs / "c.parquet")
    (inputs / "b.parquet").unlink()
    with pytest.raises(JobMismatchError, match=r"b\.parquet#0 removed; c\.parquet#0 added"):
        run_job(spec)
    with pytest.raises(JobMismatchError, match="started over a sharded source, but this run reads a dataset's index"):
        run_job(JobSpec(output_dir=str(out), ledger=ledger, job_name=job_name, rows=35, shard_size=20))


def test_shard_plan_packs_small_units_and_cuts_large_ones():
    layout = SourceLayout([SourceUnit(f"u{i}", n) for i, n in enumerate([3, 4, 0, 10, 25, 2])])
    assert layout.plan_shards(8) == [(0, 7), (7, 15), (15, 17), (17, 25), (25, 33), (33, 41), (41, 44)]
    assert layout.pieces(5, 20) == [(1, 2, 4), (3, 0, 10), (4, 0, 3)]
    assert layout.num_rows == 44
    with pytest.raises(ValueError, match="appears twice"):
        SourceLayout([SourceUnit("a", 1), SourceUnit("a", 2)])


def test_an_iterable_dataset_exposing_units_is_sharded_with_its_poison_rows_isolated(tmp_path):
    out = tmp_path / "out"
    spec = JobSpec(output_dir=str(out), source=("iterable", (30, 1, 29)), poison_dataset_rows=(0, 30, 45),
                   max_failed_rows=3, shard_size=16, batch_size=4)
    run_job(spec)
    table = read_predictions(out)
    assert table.column("row_id").to_pylist() == [i for i in range(60) if i not in (0, 30, 45)]
    assert table.column("y").to_pylist() == [3.0 * i + 1.0 for i in table.column("row_id").to_pylist()]
    assert {e["row"] for e in read_errors(out)} == {"u0:0", "u1:0", "u2:14"}


def test_text_paths_and_parquet_key_readers_join_back(tmp_path):
    text_dir = tmp_path / "text"
    (text_dir / "sub").mkdir(parents=True)
    (text_dir / "a.txt").write_text("".join(f"{i}\n" for i in range(25)))
    (text_dir / "sub" / "b.txt").write_text("\n100\n\n101\n102")  # blank lines skipped, no final newline
    run_job(JobSpec(output_dir=str(tmp_path / "out-text"), source=("text", str(text_dir)), shard_size=8))
    text = read_predictions(tmp_path / "out-text")
    got = dict(zip(text.column("input_id").to_pylist(), text.column("y").to_pylist()))
    assert got == {**{f"a.txt:{i}": 3.0 * i + 1 for i in range(25)},
                   **{f"sub/b.txt:{i}": 3.0 * (100 + i) + 1 for i in range(3)}}

    files = []
    for i in range(12):
        files.append(tmp_path / f"obj{i}")
        files[-1].write_text("poison" if i == 5 else str(i))
    run_job(JobSpec(output_dir=str(tmp_path / "out-paths"), source=("paths", [str(f) for f in files]), shard_size=5,
                    batch_size=4, max_failed_rows=1, extra={"fetch_threads": 4}))
    paths = read_predictions(tmp_path / "out-paths")
    assert paths.column("input_id").to_pylist() == [str(f) for i, f in enumerate(files) if i != 5]
    assert paths.column("y").to_pylist() == [3.0 * i + 1 for i in range(12) if i != 5]
    (error,) = read_errors(tmp_path / "out-paths")
    assert error["row"] == str(files[5]) and "cannot decode obj5" in error["error"]

    parquet = tmp_path / "in.parquet"
    with pq.ParquetWriter(parquet, pa.schema([("x", pa.float64()), ("note", pa.string()), ("big", pa.string())])) as w:
        for start in (0, 6):
            w.write_table(pa.table({"x": [float(start + i) for i in range(6)],
                                    "note": [f"k{start + i}" for i in range(6)], "big": ["-" * 10] * 6}))
    run_job(JobSpec(output_dir=str(tmp_path / "out-key"), source=("parquet-key", str(parquet)), shard_size=4))
    keyed = read_predictions(tmp_path / "out-key")
    assert "big" not in keyed.column_names and "input_id" not in keyed.column_names
    assert dict(zip(keyed.column("note").to_pylist(), keyed.column("y").to_pylist())) == {
        f"k{i}": 3.0 * i + 1 for i in range(12)}


def test_an_iterable_dataset_without_units_is_refused_pointing_at_sources():
    from torch.utils.data import DataLoader, IterableDataset

    from lightning_paro.predict.loader import UnsupportedDataLoaderError, single_dataloader

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(UnsupportedDataLoaderError, match="not an IterableDataset.*ParquetSource"):
        single_dataloader(DataLoader(Stream(), batch_size=2))


def test_line_files_are_read_from_a_remembered_offset_deep_in_the_file(tmp_path):
    from lightning_paro.predict import JsonlSource

    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for i in range(2600):
            f.write(json.dumps({"v": i}) + ("\n\n" if i % 7 == 0 else "\n"))
    source = JsonlSource(path)
    (unit,) = source.units()
    assert unit.rows == 2600 and len(unit.ref[1]) == 3  # an offset every 1024 rows
    rows = list(source.read(unit, 2040, 2050))
    assert [r["v"] for r in rows] == list(range(2040, 2050))
    assert rows[0]["input_id"] == f"{path}:2040"
    assert [r["v"] for r in source.read(unit, 2599, 2600)] == [2599]


class _Triple(torch.nn.Module):
    def forward(self, batch):
        return {"h": batch["x"] * 3.0}


class _PlusOne(torch.nn.Module):
    def forward(self, batch):
        return {"y": batch["h"] + 1.0}


def build_triple():
    return _Triple()


def build_plus_one():
    return _PlusOne()


@pytest.mark.timeout(60)
def test_a_pipeline_reads_a_sharded_source_after_profiling_it(tmp_path):
    from torch.utils.data import DataLoader

    from lightning_paro.predict import PipelineStage, run_pipeline
    from predict_app import ListSource

    out = tmp_path / "out"
    stages = [PipelineStage("triple", build_triple), PipelineStage("plus_one", build_plus_one)]
    report = run_pipeline(stages, DataLoader(ListSource((7, 40, 13)), batch_size=8), str(out), shard_size=16,
                          max_replicas=3)
    assert set(report.profile_s_per_row) == {"triple", "plus_one"}
    table = read_predictions(out)
    assert table.column("row_id").to_pylist() == list(range(60))
    assert table.column("y").to_pylist() == [3.0 * i + 1.0 for i in range(60)]
    assert table.column("input_id").to_pylist()[7] == "u1:0"
