"""Small pure functions: batch slicing, bisection, prediction columns, shard file publishing."""

from __future__ import annotations

import pytest
import torch

from lightning_paro.predict.batch import BatchTicket, ElasticBatch, slice_batch
from lightning_paro.predict.columns import PredictionFormatError, prediction_columns
from lightning_paro.predict.isolation import predict_isolated
from lightning_paro.predict import shard_files
from lightning_paro.predict.manifest import finalize_job
from lightning_paro.predict.shard_files import check_output_dir, publish


def test_slice_batch_cuts_every_per_row_leaf():
    batch = {"x": torch.arange(6).view(6, 1), "names": list("abcdef"), "scale": torch.tensor(2.0), "pair": (torch.ones(6), 3)}
    part = slice_batch(batch, [1, 4], 6)
    assert part["x"].view(-1).tolist() == [1, 4]
    assert part["names"] == ["b", "e"]
    assert part["scale"].item() == 2.0
    assert part["pair"][0].shape == (2,) and part["pair"][1] == 3


def test_bisection_isolates_exactly_the_failing_rows_and_keeps_order():
    calls = []

    def step(x):
        calls.append(len(x))
        if any(v in (2, 5) for v in x.tolist()):
            raise ValueError("bad")
        return x * 10

    ticket = BatchTicket(0, 0, 8, tuple(range(8)), True, 1)
    outcome = predict_isolated(step, ElasticBatch(data=torch.arange(8), ticket=ticket, indices=list(range(8))), retries=0)
    assert sorted(f.index for f in outcome.failures) == [2, 5]
    positions = [p for chunk, _ in outcome.chunks for p in chunk]
    assert positions == [0, 1, 3, 4, 6, 7]
    values = [v for _, pred in outcome.chunks for v in pred.tolist()]
    assert values == [0, 10, 30, 40, 60, 70]
    assert len(calls) < 16  # bisection, not one call per row after each failure


def test_wrong_output_length_is_a_programming_error_not_poison():
    ticket = BatchTicket(0, 0, 4, tuple(range(4)), True, 1)
    with pytest.raises(PredictionFormatError, match="returned 3 rows for a batch of 4"):
        predict_isolated(lambda x: x[:3], ElasticBatch(data=torch.arange(4), ticket=ticket, indices=list(range(4))), 0)


def test_prediction_columns_shapes():
    cols = prediction_columns({"emb": torch.ones(3, 2), "label": ["a", "b", "c"]}, 3)
    assert cols["emb"].type.list_size == 2 and cols["label"].to_pylist() == ["a", "b", "c"]
    assert list(prediction_columns(torch.zeros(3), 3)) == ["prediction"]
    with pytest.raises(PredictionFormatError, match="one value per input row"):
        prediction_columns({"s": torch.tensor(1.0)}, 3)


def test_publish_never_replaces_an_existing_file(tmp_path):
    first, second, final = tmp_path / "a", tmp_path / "b", tmp_path / "part"
    first.write_text("first")
    second.write_text("second")
    assert publish(first, final).created is True
    assert publish(second, final).created is False
    assert final.read_text() == "first"
    assert not first.exists() and not second.exists()


def test_output_dir_probe_survives_a_peer_finalising_the_job(tmp_path, monkeypatch):
    """A worker joining a finished job writes its probe file while a peer's finalize sweeps every temporary file."""
    out = tmp_path / "out"
    out.mkdir()
    real_fsync = shard_files.os.fsync

    class FinishedLedger:  # all a finalize of an empty, complete job reads
        job = "j"

        def shards(self):
            return []

        def job_shape(self):
            return (0, 1)

    def fsync_then_peer_finalises(fd):
        real_fsync(fd)
        monkeypatch.undo()  # the peer's own writes fsync normally
        assert [p for p in out.iterdir() if p.name.startswith(shard_files.TEMP_PREFIX + "probe-")]
        finalize_job(out, FinishedLedger(), "parquet", "row", None, 0)

    monkeypatch.setattr(shard_files.os, "fsync", fsync_then_peer_finalises)
    check_output_dir(out)
    assert (out / "_manifest.json").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(shard_files.TEMP_PREFIX)]
