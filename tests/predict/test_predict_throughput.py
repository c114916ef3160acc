"""What keeps the model's thread busy: automatic fetch threads, the background loader, the compact batch."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from lightning.fabric.utilities import move_data_to_device
from torch.utils.data import DataLoader, Dataset

from lightning_paro.predict.batch import BatchTicket, ElasticBatch, index_array, take
from lightning_paro.predict.config import ElasticPredictConfig
from lightning_paro.predict.dataset import ElasticDataset, FetchTuner
from lightning_paro.predict.loader import BackgroundLoader


def feed(tuner: FetchTuner, batches: int, rows: int, rate_of, busy_share: float | None = None,
         waited_share: float = 0.0) -> list[int]:
    """Feeds ``tuner`` batches whose read rate (rows/s) is ``rate_of(threads)``, on one thread busy ``busy_share``
    of the read's time, the worker waiting ``waited_share`` of it for each next batch; returns the threads of each."""
    used = []
    for _ in range(batches):
        threads = tuner.choose(rows)
        wall = rows / rate_of(threads)
        busy = busy_share * wall if (busy_share is not None and threads == 1) else None
        tuner.record(threads, rows, wall, busy, waited_s=waited_share * wall)
        used.append(threads)
    return used


def test_latency_bound_reads_double_the_threads_until_it_stops_paying():
    # each thread adds a row in flight until 16 are in flight (then the storage, or the CPU, is the limit)
    used = feed(FetchTuner(), 60, rows=32, rate_of=lambda t: 30.0 * min(t, 16))
    # a doubling reads 2x as fast: kept after its second batch confirms it
    assert used[:11] == [1, 2, 2, 4, 4, 8, 8, 16, 16, 32, 32]
    assert used[11] == 16  # 32 read no faster than 16, twice: undone
    assert used[-1] == 16 and used.count(16) > 40


def test_reads_bound_by_cpu_keep_one_thread():
    # a busy reading thread (running or waiting for a CPU 95% of the read's time): no doubling is ever tried
    assert set(feed(FetchTuner(), 100, rows=32, rate_of=lambda t: 500.0, busy_share=0.95)) == {1}
    # a thread idle 70% of the time for something more threads do not help with (a lock): tries are made, never
    # kept, and made less and less often
    used = feed(FetchTuner(), 300, rows=32, rate_of=lambda t: 500.0, busy_share=0.3)
    assert used[-1] == 1 and max(used) == 4  # 1 / 0.3 threads, rounded up to a power of two
    assert len([t for t in used if t > 1]) <= 12


def test_no_threads_are_added_while_the_batches_are_consumed_slower_than_they_are_read():
    # latency-bound reads, but the worker waits for its next batch as long as it reads one: the model is the limit
    assert set(feed(FetchTuner(), 50, rows=32, rate_of=lambda t: 30.0 * t, busy_share=0.02, waited_share=1.0)) == {1}


def test_an_idle_reading_thread_jumps_to_the_threads_that_would_keep_it_busy():
    # one row in flight leaves the thread idle 98% of the time: 50 threads would keep it busy, 32 is the batch
    used = feed(FetchTuner(), 20, rows=32, rate_of=lambda t: 30.0 * t, busy_share=0.02)
    assert used == [1] + [32] * 19
    # a try that does not pay is undone: the storage serves 4 rows at a time and the CPU is busy with something else
    used = feed(FetchTuner(gain=8.0), 20, rows=32, rate_of=lambda t: 30.0 * min(t, 4), busy_share=0.02)
    assert used[:4] == [1, 32, 32, 1]


def test_threads_never_exceed_the_rows_or_the_cap():
    used = feed(FetchTuner(max_threads=8), 30, rows=32, rate_of=lambda t: 10.0 * t)
    assert max(used) == 8
    used = feed(FetchTuner(), 30, rows=4, rate_of=lambda t: 10.0 * t)
    assert max(used) == 4


class SlowRows(Dataset):
    """Rows that wait on "storage" (a sleep) and cost no CPU."""

    def __init__(self, n: int, wait_s: float) -> None:
        self.n, self.wait_s = n, wait_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        time.sleep(self.wait_s)
        return {"x": torch.tensor([float(index)])}


def test_automatic_fetch_threads_speed_up_a_latency_bound_dataset():
    dataset = ElasticDataset(SlowRows(16 * 16, 0.01), row_retries=0, fetch_threads=None)
    seconds, threads = [], []
    for b in range(16):
        ticket = BatchTicket(0, 0, 16 * 16, range(16 * b, 16 * (b + 1)), False, 1)
        start = time.perf_counter()
        loaded = dataset.__getitems__(ticket)
        seconds.append(time.perf_counter() - start)
        threads.append(loaded.fetch_threads)
        assert [int(s["x"]) for s in loaded.samples] == list(ticket.indices)  # rows stay in order
    # the second row, read alone, waited 10 ms and took no CPU: the other 14 rows of the first batch read at once
    assert threads == [14] + [16] * 15
    # one thread would take 160 ms a batch, 2.56 s in all; the whole run, not its slowest batch, so that one batch
    # slowed by a loaded machine does not fail it
    assert sum(seconds) < 16 * 16 * 0.01 / 2


def test_fetch_threads_setting_is_checked():
    assert ElasticPredictConfig(output_dir="x").fetch_threads is None
    for bad in (0, -2, True):
        with pytest.raises(ValueError, match="fetch_threads must be None"):
            ElasticPredictConfig(output_dir="x", fetch_threads=bad)


def test_an_elastic_batch_moves_only_its_data_and_keeps_compact_bookkeeping():
    ticket = BatchTicket(3, 0, 1024, range(1024), False, 1)
    data = {"x": torch.ones(1024, 4), "names": [f"r{i}" for i in range(1024)]}
    batch = ElasticBatch(data=data, ticket=ticket, indices=range(1024), ids=index_array(range(5, 1029)))
    # Lightning's transfer treats it as one object with .to (it would fail on the range if it walked the fields)
    moved = move_data_to_device(batch, torch.device("cpu"))
    assert isinstance(moved, ElasticBatch) and moved.indices is batch.indices and moved.ids is batch.ids
    assert moved.ticket is ticket and torch.equal(moved.data["x"], data["x"])
    assert list(take(moved.ids, [0, 1023])) == [5, 1028]
    assert list(take(index_array(moved.indices), range(2, 4))) == [2, 3]


class Numbers(Dataset):
    def __init__(self, n: int, fail_at: int = -1) -> None:
        self.n, self.fail_at = n, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index == self.fail_at:
            raise KeyError(f"row {index} is missing")
        return index


def test_the_background_loader_yields_every_batch_in_order_from_another_thread():
    threads = set()

    def collate(rows):
        threads.add(threading.current_thread().name)
        return torch.tensor(rows)

    loader = BackgroundLoader(DataLoader(Numbers(100), batch_size=8, collate_fn=collate), depth=2)
    assert torch.cat(list(loader)).tolist() == list(range(100))
    assert threads == {"lightning-paro-loader"}  # with num_workers=0 the DataLoader ran on the loader's thread
    assert torch.cat(list(loader)).tolist() == list(range(100))  # iterable again


def test_the_background_loader_raises_the_loaders_error_on_the_models_thread_and_stops():
    loader = BackgroundLoader(DataLoader(Numbers(100, fail_at=37), batch_size=8))
    got = []
    with pytest.raises(KeyError, match="row 37 is missing"):
        for batch in loader:
            got.extend(batch.tolist())
    assert got == list(range(32))
    assert not any(t.name == "lightning-paro-loader" for t in threading.enumerate())


def test_closing_the_background_loader_mid_iteration_stops_its_thread():
    loader = BackgroundLoader(DataLoader(Numbers(10_000), batch_size=8), depth=2)
    iterator = iter(loader)
    assert next(iterator).tolist() == list(range(8))
    loader.close()
    assert not any(t.name == "lightning-paro-loader" for t in threading.enumerate())


@pytest.mark.timeout(120)
def test_leases_run_off_the_models_thread_and_lightning_keeps_no_index_per_batch(tmp_path, monkeypatch):
    import lightning as L

    from lightning_paro.predict import ElasticPredict, read_predictions
    from lightning_paro.predict.ledger import Ledger
    from predict_app import Affine, JobSpec, RowsDataset

    spec = JobSpec(output_dir=str(tmp_path / "out"), rows=200, batch_size=10, shard_size=20)
    lease_threads = []
    lease = Ledger.lease

    def recording_lease(self, *args, **kwargs):
        lease_threads.append(threading.current_thread().name)
        return lease(self, *args, **kwargs)

    monkeypatch.setattr(Ledger, "lease", recording_lease)
    step_threads = set()
    seen = []

    class Watch(L.Callback):
        def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            step_threads.add(threading.current_thread().name)
            seen.append(trainer.predict_dataloaders)

    elastic = ElasticPredict(spec.output_dir, shard_size=spec.shard_size)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_model_summary=False,
                        enable_progress_bar=False, callbacks=[elastic, Watch()])
    trainer.predict(Affine(spec), DataLoader(RowsDataset(spec), batch_size=spec.batch_size, num_workers=2))
    assert read_predictions(spec.output_dir).column("row_id").to_pylist() == list(range(200))
    # 10 shards: the first leases happen when the DataLoader starts (on the caller's thread), every later one on
    # the loader's thread while the model computes
    assert step_threads == {"MainThread"}
    assert lease_threads.count("lightning-paro-loader") >= 8
    # Lightning got an iterable, not a DataLoader it would rebuild around a wrapper that lists every batch's indices
    assert all(type(d).__name__ == "BackgroundLoader" for d in seen)
    assert not any(t.name == "lightning-paro-loader" for t in threading.enumerate())


@pytest.mark.timeout(120)
def test_a_pipeline_with_one_replica_per_stage_forced_does_not_profile(tmp_path):
    from lightning_paro.predict import read_predictions
    from lightning_paro.predict.pipeline import PipelineStage, run_pipeline
    from predict_app import JobSpec, RowsDataset
    from test_predict_pipeline import build_embed, build_head

    spec = JobSpec(output_dir=str(tmp_path / "out"), rows=60, batch_size=8, shard_size=16)
    stages = [PipelineStage("embed", build_embed), PipelineStage("head", build_head)]
    report = run_pipeline(stages, DataLoader(RowsDataset(spec), batch_size=8), spec.output_dir, shard_size=16,
                          max_replicas=2)
    assert report.replicas == {"embed": 1, "head": 1} and report.profile_s_per_row == {}
    # 4 shards of 16, 16, 16 and 12 rows in batches of 8, each counted once
    assert sum(report.fetch_threads.values()) == 8
    assert read_predictions(spec.output_dir).column("row_id").to_pylist() == list(range(60))
