"""Inputs of elastic prediction: several ranks refused at set-up, units that fail as units, fingerprints of content,
and joining a job without reading its inputs."""

from __future__ import annotations

import builtins
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

import lightning as L
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from torch.utils.data import DataLoader

from lightning_paro.predict import (
    ElasticPredict,
    ErrorBudgetExceededError,
    JsonlSource,
    JobMismatchError,
    ParquetSource,
    TextSource,
    read_errors,
    read_predictions,
)
from lightning_paro.predict import builtin_sources
from lightning_paro.predict.batch import BatchTicket
from lightning_paro.predict.callback import SeveralRanksError
from lightning_paro.predict.config import ElasticPredictConfig
from lightning_paro.predict.run import WorkerRun
from lightning_paro.predict.sources import SourceDataset, source_layout
from predict_app import Affine, JobSpec, make_callback

APPS = Path(__file__).parent


def test_a_trainer_of_two_ranks_is_refused_at_setup_before_the_job_is_touched(tmp_path):
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_progress_bar=False)
    callback = ElasticPredict(str(tmp_path / "out"))
    with pytest.raises(SeveralRanksError, match=r"has 2 ranks \(strategy DDPStrategy\).*Run 2 independent workers "
                                                r"instead, each with Trainer\(devices=1\).*torchrun --nproc-per-node=2"):
        callback.setup(trainer, Affine(JobSpec(output_dir=str(tmp_path / "out"))), "predict")
    assert callback.run is None and not (tmp_path / "out").exists()


@pytest.mark.timeout(400)
def test_two_ddp_ranks_both_stop_with_the_refusal(tmp_path):
    """Trainer(devices=2) launched for real: each rank raises the refusal in setup, and no rank is left waiting."""
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(APPS), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(APPS / "ranks_app.py"), str(out), "ddp"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=360)
    finally:  # the launched rank runs in the same session: leave no process behind
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode != 0
    assert output.count("SeveralRanksError: ElasticPredict runs one worker per process") >= 1, output[-3000:]
    assert not out.exists() or not list(out.glob("part-*"))


# ---- units fail as units -------------------------------------------------------------------------------------------

ROWS_PER_FILE = 30


def write_jsonl(root: Path, names=("a.jsonl", "b.jsonl", "c.jsonl")) -> dict:
    """Files of ``ROWS_PER_FILE`` rows; returns ``{input id: x}``."""
    root.mkdir(parents=True, exist_ok=True)
    expected, x = {}, 0
    for name in names:
        with open(root / name, "w") as f:
            for position in range(ROWS_PER_FILE):
                f.write(json.dumps({"x": float(x)}) + "\n")
                expected[f"{name}:{position}"] = float(x)
                x += 1
    return expected


def write_parquet(root: Path, names=("a.parquet", "b.parquet", "c.parquet"), rows: int = ROWS_PER_FILE) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    expected, x = {}, 0
    for name in names:
        xs = [float(x + i) for i in range(rows)]
        pq.write_table(pa.table({"x": xs}), root / name, compression="NONE", use_dictionary=False)
        expected.update({f"{name}:{i}": v for i, v in enumerate(xs)})
        x += rows
    return expected


def predict(out: Path, source, **settings):
    """One worker over ``source`` in this process, to the end of the job."""
    spec = JobSpec(output_dir=str(out), batch_size=4, shard_size=20, extra={"unit_retry_backoff_s": 0.01})
    spec.max_failed_rows = settings.pop("max_failed_rows", 0)
    spec.extra.update(settings)
    callback = make_callback(spec)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[callback], enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    trainer.predict(Affine(spec), dataloaders=DataLoader(source, batch_size=spec.batch_size, num_workers=0))
    return callback


class OpenCounter:
    """Counts ``open`` calls on the files under ``root`` (the built-in line readers open files with it)."""

    def __init__(self, monkeypatch, root: Path, fail: Optional[dict] = None) -> None:
        self.root, self.fail, self.paths = str(root), fail or {}, []
        real = builtins.open

        def counting_open(file, *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and str(file).startswith(self.root):
                self.paths.append(os.path.basename(str(file)))
                error = self.fail.get(os.path.basename(str(file)))
                if error is not None:
                    raise error
            return real(file, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", counting_open)

    def count(self, name: str) -> int:
        return self.paths.count(name)


@pytest.mark.parametrize("fault", ["vanished", "permission"])
def test_a_unit_that_cannot_be_opened_is_retried_as_a_unit_then_its_rows_fail_together(tmp_path, monkeypatch, fault):
    expected = write_jsonl(tmp_path / "in")
    source = JsonlSource(str(tmp_path / "in"))
    source_layout(source)  # the units are listed (the job is planned) while b.jsonl is still readable
    counter = OpenCounter(monkeypatch, tmp_path / "in")
    if fault == "vanished":
        (tmp_path / "in" / "b.jsonl").unlink()
        cause = "FileNotFoundError"
    else:
        counter.fail["b.jsonl"] = PermissionError(13, "Permission denied", str(tmp_path / "in" / "b.jsonl"))
        cause = "PermissionError"
    predict(tmp_path / "out", source, max_failed_rows=ROWS_PER_FILE, unit_retries=2)
    # opened once and retried twice, as a unit: not once or twice per row of the unit
    assert counter.count("b.jsonl") == 3
    errors = read_errors(tmp_path / "out")
    assert sorted(e["row"] for e in errors) == sorted(f"b.jsonl:{p}" for p in range(ROWS_PER_FILE))
    assert {e["stage"] for e in errors} == {"unit"}
    assert all(f"source unit 'b.jsonl' could not be read: {cause}" in e["error"] and "after 3 attempts" in e["error"]
               for e in errors)
    table = read_predictions(tmp_path / "out")
    assert dict(zip(table.column("input_id").to_pylist(), table.column("y").to_pylist())) == {
        k: 3.0 * v + 1.0 for k, v in expected.items() if not k.startswith("b.jsonl")}


def test_a_unit_that_cannot_be_read_fails_the_job_naming_the_unit_and_the_cause(tmp_path):
    write_parquet(tmp_path / "in")
    source = ParquetSource(str(tmp_path / "in"), columns=["x"])
    source_layout(source)
    (tmp_path / "in" / "b.parquet").write_bytes(b"PAR1 not a footer")  # a corrupt footer after the job was planned
    with pytest.raises(ErrorBudgetExceededError, match=r"source unit 'b\.parquet#0' could not be read: \w+: .*after 2 "
                                                       r"attempts"):
        predict(tmp_path / "out", source, unit_retries=1)


def test_a_truncated_unit_fails_as_a_unit_and_readable_rows_still_fail_one_by_one(tmp_path, monkeypatch):
    expected = write_jsonl(tmp_path / "in")
    source = JsonlSource(str(tmp_path / "in"), transform=lambda row: _poison_at(row, 7.0))
    source_layout(source)
    lines = (tmp_path / "in" / "c.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "in" / "c.jsonl").write_text("".join(lines[:10]))  # 10 of its 30 rows are left
    predict(tmp_path / "out", source, max_failed_rows=21)
    errors = {e["row"]: e for e in read_errors(tmp_path / "out")}
    assert sorted(errors) == sorted(["a.jsonl:7"] + [f"c.jsonl:{p}" for p in range(10, 30)])
    assert errors["a.jsonl:7"]["stage"] == "dataset" and "poison x=7" in errors["a.jsonl:7"]["error"]
    assert all(errors[f"c.jsonl:{p}"]["stage"] == "unit" and "source unit 'c.jsonl' could not be read: it yielded 10 "
               "rows but units() listed 30" in errors[f"c.jsonl:{p}"]["error"] for p in range(10, 30))
    assert read_predictions(tmp_path / "out").num_rows == len(expected) - 21


def _poison_at(row: dict, x: float) -> dict:
    if row["x"] == x:
        raise ValueError(f"poison x={x:g}")
    return row


def test_an_unsupported_column_type_is_read_row_by_row_and_logged_once(tmp_path, caplog):
    (tmp_path / "in").mkdir()
    for name in ("a.parquet", "b.parquet"):
        pq.write_table(pa.table({"x": [1.0, 2.0, 3.0], "tags": [["p"], ["q", "r"], []]}), tmp_path / "in" / name,
                       row_group_size=2)
    builtin_sources._FALLBACKS_LOGGED.clear()
    source = ParquetSource(str(tmp_path / "in"))
    dataset = SourceDataset(source, source_layout(source), batched=True)
    with caplog.at_level(logging.INFO, logger="lightning_paro.predict.builtin_sources"):
        for start in range(0, 6, 2):
            loaded = dataset.__getitems__(BatchTicket(0, 0, 6, range(start, start + 2), False, 1))
            assert loaded.batch is None and len(loaded.samples) == 2 and not loaded.failures
    logged = [r.getMessage() for r in caplog.records if "read row by row" in r.getMessage()]
    assert logged == ["ParquetSource: column 'tags' (list<element: string>) holds a type not read as columns: batches "
                      "with it are read row by row"]


# ---- inputs identified by content ----------------------------------------------------------------------------------


def rewrite_same_size(path: Path, content: bytes) -> None:
    """Replaces a file's bytes with others of the same length and puts its modification time back."""
    before = path.stat()
    assert len(content) == before.st_size
    path.write_bytes(content)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_a_same_size_rewrite_keeping_the_mtime_is_refused_at_resume_naming_the_unit(tmp_path, kind):
    if kind == "parquet":
        write_parquet(tmp_path / "in")
        make = lambda: ParquetSource(str(tmp_path / "in"), columns=["x"])  # noqa: E731
        changed, unit = tmp_path / "in" / "b.parquet", "b.parquet#0"
        buffer = pa.BufferOutputStream()  # other values, the same encoding: the same size, another footer
        pq.write_table(pa.table({"x": [float(1000 + i) for i in range(ROWS_PER_FILE)]}), buffer, compression="NONE",
                       use_dictionary=False)
        content = buffer.getvalue().to_pybytes()
    else:
        write_jsonl(tmp_path / "in")
        make = lambda: JsonlSource(str(tmp_path / "in"))  # noqa: E731
        changed, unit = tmp_path / "in" / "b.jsonl", "b.jsonl"
        content = changed.read_bytes().replace(b"31.0", b"71.0")
    predict(tmp_path / "out", make())
    rewrite_same_size(changed, content)
    with pytest.raises(JobMismatchError, match=rf"inputs of job .* changed since it started \({unit}: size=\d+ "
                                               r"mtime_ns=\d+ (rg|blake2b)=\w+ -> size=\d+ mtime_ns=\d+ (rg|blake2b)=\w+\)"):
        predict(tmp_path / "out", make())


# ---- joining costs what the ledger already knows -------------------------------------------------------------------


def test_a_worker_joining_a_job_over_10000_line_files_opens_none_before_its_first_lease(tmp_path, monkeypatch):
    root = tmp_path / "in"
    root.mkdir()
    for i in range(10_000):
        (root / f"f{i:05d}.txt").write_text(f"{i}\n")
    make = lambda: TextSource(str(root), transform=lambda row: {"x": float(row["text"])})  # noqa: E731
    config = ElasticPredictConfig(str(tmp_path / "out"), shard_size=8, lease_ttl_s=60.0)
    first = WorkerRun(config, DataLoader(make(), batch_size=4))  # creates the job: lists and reads every file
    try:
        assert next(iter(first.sampler)).indices == range(0, 4)  # a live lease: the job is running
        counter = OpenCounter(monkeypatch, root)
        joiner = WorkerRun(config, DataLoader(make(), batch_size=4))
        try:
            assert counter.paths == []  # the units and row counts came from the ledger, checked by stat
            ticket = next(iter(joiner.sampler))
            assert counter.paths == [] and ticket.indices == range(8, 12)
            loaded = joiner.dataloader.loader.dataset.__getitems__(ticket)
            assert [s["x"] for s in loaded.samples] == [8.0, 9.0, 10.0, 11.0] and not loaded.failures
            assert sorted(set(counter.paths)) == [f"f{i:05d}.txt" for i in range(8, 12)]
        finally:
            joiner.abort()
            joiner.close()
        # a file changed since the job started is refused at join, by its stat fields, still opening nothing
        (root / "f00017.txt").write_text("1717\n")
        with pytest.raises(JobMismatchError, match=r"f00017\.txt: size=3 mtime_ns=\d+ blake2b=\w+ -> size=5 "
                                                   r"mtime_ns=\d+\)"):
            WorkerRun(config, DataLoader(make(), batch_size=4))
        assert counter.paths == [f"f{i:05d}.txt" for i in range(8, 12) for _ in range(2)]
    finally:
        first.abort()
        first.close()


def test_a_large_single_row_group_is_streamed_a_slice_at_a_time(tmp_path, monkeypatch):
    rows = 50_000
    pq.write_table(pa.table({"x": [float(i) for i in range(rows)]}), tmp_path / "one.parquet", row_group_size=rows)
    source = ParquetSource(str(tmp_path / "one.parquet"))
    (unit,) = source_layout(source).units
    monkeypatch.setattr(builtin_sources, "WHOLE_ROW_GROUP_BYTES", 100_000)  # this row group holds 400 kB of x

    def no_whole_read(*args, **kwargs):
        raise AssertionError("the row group was read whole")

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", no_whole_read)
    for start in (0, 100, 20_000, 49_990, 5):  # forward, then back to the start
        batch = source.read_batch(unit, start, min(start + 10, rows))
        assert batch["x"].tolist() == [float(i) for i in range(start, min(start + 10, rows))]
    assert [r["x"] for r in source.read(unit, 30_000, 30_003)] == [30_000.0, 30_001.0, 30_002.0]
