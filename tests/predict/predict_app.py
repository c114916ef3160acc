"""A tiny prediction job used by the tests: run in-process, in forked worker processes or under torchrun.

Row ``i`` has feature ``x = i`` and the model predicts ``y = 3 x + 1``, so every output value can be
checked. Faults (poison rows, hangs, crashes after publishing) are switched on through the spec.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_paro.predict import (
    ElasticPredict,
    JsonlSource,
    ParquetSource,
    PathSource,
    ShardedSource,
    SourceUnit,
    TextSource,
    shard_files,
)


@dataclass
class JobSpec:
    output_dir: str
    ledger: Optional[str] = None
    job_name: Optional[str] = None
    rows: int = 400
    batch_size: int = 10
    shard_size: int = 40
    num_workers: int = 0
    format: str = "parquet"
    step_sleep_s: float = 0.0
    poison_dataset_rows: tuple = ()
    poison_model_rows: tuple = ()
    hang_rows: tuple = ()
    crash_after_publishes: Optional[int] = None
    crash_marker: Optional[str] = None
    start_barrier: Optional[tuple] = None
    lease_ttl_s: float = 2.0
    stall_timeout_s: float = 600.0
    speculate_after_s: Optional[float] = None
    max_attempts: int = 3
    max_failed_rows: int = 0
    worker_name: Optional[str] = None
    id_column: Optional[str] = None
    rows_log: Optional[str] = None
    source: Optional[tuple] = None  # (kind, path or units) to read a sharded source instead of RowsDataset
    extra: dict = field(default_factory=dict)


class RowsDataset(Dataset):
    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec

    def __len__(self) -> int:
        return self.spec.rows

    def __getitem__(self, index: int):
        if index in self.spec.poison_dataset_rows:
            raise ValueError(f"corrupt record {index}")
        return {"x": torch.tensor([float(index)]), "key": f"id-{index}"}


class ListSource(ShardedSource):
    """A sharded source over units given as row counts; row ``i`` of the concatenation has ``x = i``.

    Rows in ``poison`` raise inside the row stream (as a corrupt record would while decoding), so the
    stream dies midway through its unit and reading has to go on after the bad row.
    """

    id_column = "input_id"

    def __init__(self, unit_rows: tuple, poison: tuple = ()) -> None:
        self.unit_rows = unit_rows
        self.poison = poison

    def units(self):
        return [SourceUnit(f"u{i}", n, f"n={n}") for i, n in enumerate(self.unit_rows)]

    def read(self, unit, start, stop):
        first = sum(self.unit_rows[: int(unit.id[1:])])
        for position in range(start, stop):
            x = first + position
            if x in self.poison:
                raise ValueError(f"corrupt record {x}")
            yield {"x": float(x), "input_id": f"{unit.id}:{position}"}


def make_dataset(spec: JobSpec):
    if spec.source is None:
        return RowsDataset(spec)
    kind, where = spec.source
    if kind == "parquet":
        return ParquetSource(where, columns=["x"])
    if kind == "jsonl":
        return JsonlSource(where)
    if kind == "list":
        return ListSource(where, spec.poison_dataset_rows)
    if kind == "iterable":
        return IterableListSource(where, spec.poison_dataset_rows)
    if kind == "text":
        return TextSource(where, transform=lambda row: {"x": float(row["text"])})
    if kind == "paths":
        return PathSource(where, read_text_file)
    if kind == "parquet-key":
        return ParquetSource(where, columns=["x"], key="note")
    raise ValueError(f"unknown source kind {kind!r}")


class Affine(L.LightningModule):
    def __init__(self, spec: JobSpec) -> None:
        super().__init__()
        self.spec = spec
        self.layer = torch.nn.Linear(1, 1)
        with torch.no_grad():
            self.layer.weight.fill_(3.0)
            self.layer.bias.fill_(1.0)

    def predict_step(self, batch, batch_idx):
        x = batch["x"]
        if x.ndim == 1:  # sharded sources yield one scalar per row
            x = x.float()[:, None]
        rows = [int(v) for v in x[:, 0].tolist()]
        if any(r in self.spec.hang_rows for r in rows):
            time.sleep(3600)
        if any(r in self.spec.poison_model_rows for r in rows):
            raise RuntimeError(f"model cannot score rows {sorted(set(rows) & set(self.spec.poison_model_rows))}")
        if self.spec.step_sleep_s:
            time.sleep(self.spec.step_sleep_s)
        if self.spec.rows_log:
            # one line per predicted row: lets tests prove committed shards are never recomputed
            with open(self.spec.rows_log, "a") as f:
                f.write("".join(f"{r}\n" for r in rows))
        return {"y": self.layer(x)[:, 0]}


def make_callback(spec: JobSpec) -> ElasticPredict:
    return ElasticPredict(
        spec.output_dir,
        ledger=spec.ledger,
        job_name=spec.job_name,
        shard_size=spec.shard_size,
        format=spec.format,
        lease_ttl_s=spec.lease_ttl_s,
        heartbeat_interval_s=min(0.25, spec.lease_ttl_s / 4),
        stall_timeout_s=spec.stall_timeout_s,
        speculate_after_s=spec.speculate_after_s,
        max_attempts=spec.max_attempts,
        max_failed_rows=spec.max_failed_rows,
        poll_interval_s=0.1,
        worker_name=spec.worker_name,
        id_column=spec.id_column,
        **spec.extra,
    )


def install_crash_after_publishes(count: int, marker: Optional[str] = None) -> None:
    """SIGKILLs this process right after its ``count``-th shard file is published, before the ledger commit.

    ``marker``, when given, is created just before dying, so a test can tell the crash happened.
    """
    original = shard_files.publish_shard
    seen = {"n": 0}

    def publish_then_die(writer):
        result = original(writer)
        seen["n"] += 1
        if seen["n"] >= count:
            if marker:
                open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    shard_files.publish_shard = publish_then_die


def wait_for_files(mine: str, others: tuple, timeout_s: float = 120.0) -> None:
    """A test-only start barrier: creates ``mine`` and waits until every path in ``others`` exists, so a
    crash scenario cannot be skipped by one worker finishing the whole job before the other starts."""
    open(mine, "w").close()
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(p) for p in others):
        if time.monotonic() > deadline:
            raise TimeoutError(f"start barrier: {others} not all present after {timeout_s} s")
        time.sleep(0.02)


def run_job(spec: JobSpec) -> ElasticPredict:
    """Runs one worker to the end of the job in this process; returns its callback (manifest, run stats)."""
    if spec.crash_after_publishes is not None:
        install_crash_after_publishes(spec.crash_after_publishes, spec.crash_marker)
    if spec.start_barrier is not None:
        wait_for_files(*spec.start_barrier)
    callback = make_callback(spec)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    loader = DataLoader(make_dataset(spec), batch_size=spec.batch_size, num_workers=spec.num_workers)
    trainer.predict(Affine(spec), dataloaders=loader)
    return callback


def worker_main(spec: JobSpec) -> None:
    """Entry point of a forked worker process: exit code 0 on success, 1 with a traceback otherwise."""
    logging.basicConfig(level=logging.WARNING)
    try:
        torch.set_num_threads(1)
        run_job(spec)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    # torchrun entry: python predict_app.py OUTPUT_DIR ROWS [CRASH_RANK]
    # CRASH_RANK, when given, SIGKILLs itself after its second published shard in torchrun's first attempt only.
    spec = JobSpec(output_dir=sys.argv[1], rows=int(sys.argv[2]), step_sleep_s=0.01, lease_ttl_s=1.0,
                   worker_name=f"rank{os.environ.get('RANK')}-try{os.environ.get('TORCHELASTIC_RESTART_COUNT')}")
    if len(sys.argv) > 3 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        # first attempt: rank CRASH_RANK commits one shard and dies after publishing its second; the other ranks
        # wait for that death, as one of them could otherwise finish the whole job first and skip the crash
        died = f"{sys.argv[1]}.rank{sys.argv[3]}.died"
        if os.environ.get("RANK") == sys.argv[3]:
            spec.crash_after_publishes, spec.crash_marker = 2, died
        else:
            spec.start_barrier = (f"{sys.argv[1]}.rank{os.environ['RANK']}.ready", (died,))
    callback = run_job(spec)
    print(f"worker {spec.worker_name} committed={callback.run.writer.shards_committed}", flush=True)


class IterableListSource(IterableDataset):
    """The same rows as ``ListSource`` from an ``IterableDataset`` that also exposes its units."""

    id_column = "input_id"

    def __init__(self, unit_rows: tuple, poison: tuple = ()) -> None:
        self.inner = ListSource(unit_rows, poison)

    def units(self):
        return self.inner.units()

    def read(self, unit, start, stop):
        return self.inner.read(unit, start, stop)

    def __iter__(self):
        for unit in self.units():
            yield from self.read(unit, 0, unit.rows)


def read_text_file(path: str) -> dict:
    """A ``PathSource`` read function: a file holding one number; the word ``poison`` raises."""
    text = open(path).read().strip()
    if text == "poison":
        raise ValueError(f"cannot decode {os.path.basename(path)}")
    return {"x": float(text)}
