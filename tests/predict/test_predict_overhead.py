"""What ElasticPredict costs beside the model on a job it did not write: the writer's Arrow conversion imports nothing
heavy, reads that mostly compute keep one fetch thread, and the job's end is seen as soon as the last shard commits."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pyarrow as pa
import pytest
import torch

from lightning_paro.predict import sampler as sampler_module
from lightning_paro.predict.columns import numpy_to_arrow, prediction_columns
from lightning_paro.predict.config import ElasticPredictConfig
from lightning_paro.predict.dataset import FetchTuner
from lightning_paro.predict.ledger import Ledger
from lightning_paro.predict.sampler import InFlightShards, ShardBatchSampler
from test_predict_throughput import feed


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64", "uint8", "uint32", "uint64", "float16",
                                   "float32", "float64"])
def test_numbers_become_the_same_arrow_array_as_pa_array_makes(dtype):
    values = (np.arange(10) * 3 - 7).astype(dtype)
    got = numpy_to_arrow(values)
    assert got.type == pa.array(values).type and got.to_pylist() == pa.array(values).to_pylist()
    strided = values[::3]  # not contiguous: copied, in order
    assert numpy_to_arrow(strided).to_pylist() == strided.tolist()


def test_other_arrays_still_go_through_pa_array():
    assert numpy_to_arrow(np.array([True, False, True])).to_pylist() == [True, False, True]
    assert numpy_to_arrow(np.array(["a", "bc"])).to_pylist() == ["a", "bc"]
    swapped = np.arange(4, dtype=">i4")  # not in this machine's byte order
    assert numpy_to_arrow(swapped).to_pylist() == [0, 1, 2, 3]


def test_the_writers_columns_do_not_import_pandas():
    # pa.array imports pandas on its first call: about 0.2 s of CPU beside the model, in every worker
    code = (
        "import sys, numpy as np, torch\n"
        "from lightning_paro.predict.columns import prediction_columns, numpy_to_arrow\n"
        "from lightning_paro.predict.writer import ShardWriter\n"
        "cols = prediction_columns({'e': torch.randn(4, 3), 'y': np.arange(4), 'p': torch.rand(4)}, 4)\n"
        "numpy_to_arrow(np.arange(4))\n"
        "assert cols['e'].type.list_size == 3 and cols['y'].to_pylist() == [0, 1, 2, 3]\n"
        "print('pandas' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_prediction_columns_keep_their_values():
    embedding = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    cols = prediction_columns({"embedding": embedding, "label": torch.tensor([1, 0, 1, 1])}, 4)
    assert cols["embedding"].to_pylist() == embedding.tolist()
    assert cols["label"].to_pylist() == [1, 0, 1, 1]


def test_reads_that_mostly_compute_keep_one_fetch_thread():
    # a row from a store on the same machine: the thread waits for it 40% of the read (the store computing) and
    # computes the rest; two threads would read it twice as fast only by taking the CPU the model needs
    assert set(feed(FetchTuner(), 100, rows=32, rate_of=lambda t: 400.0 * min(t, 2), busy_share=0.6)) == {1}
    # idle more than half the time: worth trying more
    assert max(feed(FetchTuner(), 20, rows=32, rate_of=lambda t: 100.0 * t, busy_share=0.4)) > 1


def test_a_commit_from_another_thread_ends_the_wait_at_once():
    shards = InFlightShards()
    shards.add(7)
    mark = shards.discards()
    threading.Timer(0.05, shards.discard, args=(7,)).start()
    start = time.monotonic()
    assert shards.wait_for_discard(mark, timeout_s=30.0)
    assert time.monotonic() - start < 10.0
    assert not shards.wait_for_discard(shards.discards(), timeout_s=0.01)  # nothing left the set since


@pytest.mark.timeout(60)
def test_the_sampler_sees_the_job_done_when_its_last_shard_commits(tmp_path, monkeypatch):
    # an idle pause far longer than the test: the sampler must be woken by the commit, not by the pause ending
    monkeypatch.setattr(sampler_module, "_IDLE_TICKET_PAUSE_S", 120.0)
    location, job = str(tmp_path / "ledger.sqlite"), "job"
    Ledger(location, job).ensure_job(8, 8)
    in_flight = InFlightShards()
    config = ElasticPredictConfig(output_dir=str(tmp_path / "out"), poll_interval_s=120.0)
    sampler = ShardBatchSampler(lambda: Ledger(location, job), "w", 4, config, in_flight,
                                lambda ledger, lease: False, threading.Event())
    tickets = iter(sampler)
    first, second = next(tickets), next(tickets)
    assert [list(first.indices), list(second.indices)] == [[0, 1, 2, 3], [4, 5, 6, 7]] and second.last

    def commit() -> None:
        ledger = Ledger(location, job)
        ledger.commit(second.shard_id, "w", 8, 0, "part.parquet")
        ledger.close()
        in_flight.discard(second.shard_id)

    threading.Timer(0.2, commit).start()
    start = time.monotonic()
    assert list(tickets) == []  # no idle ticket: the commit ended the wait and the ledger said done
    assert time.monotonic() - start < 30.0 and sampler.saw_done
    sampler.close()
