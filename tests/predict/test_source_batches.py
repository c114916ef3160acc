"""Parquet read column by column: the batches equal the per-row path's after default collation, predictions are
the same, a batched read that raises fails its unit (never silently read row by row), and a user's collate_fn keeps
getting rows."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from lightning_paro.predict import ErrorBudgetExceededError, JsonlSource, ParquetSource, read_errors, read_predictions
from lightning_paro.predict.batch import BatchTicket
from lightning_paro.predict.dataset import ElasticCollate
from lightning_paro.predict.sources import SourceDataset, source_layout
from predict_app import JobSpec, make_callback

# rows per row group: small groups packed into one shard, so batches of 10 span several of them
LAYOUT = {"a.parquet": [7, 23, 55], "b/c.parquet": [1, 2, 3, 90], "d.parquet": [13, 40]}
SCHEMA = pa.schema([("x", pa.float32()), ("w", pa.float64()), ("n", pa.int32()), ("k", pa.int64()),
                    ("flag", pa.bool_()), ("note", pa.string())])


def write_inputs(root: Path) -> dict:
    """Writes the files; returns ``{input id: x}``, with a distinct integral ``x`` per row."""
    expected, x = {}, 0
    for name, groups in LAYOUT.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with pq.ParquetWriter(path, SCHEMA) as writer:
            position = 0
            for rows in groups:
                xs = [float(x + i) for i in range(rows)]
                writer.write_table(pa.table({
                    "x": xs, "w": [v / 7 for v in xs], "n": [int(v) % 5 - 2 for v in xs],
                    "k": [10_000_000_000 + int(v) for v in xs], "flag": [int(v) % 3 == 0 for v in xs],
                    "note": [f"n{int(v)}" for v in xs]}, schema=SCHEMA))
                for v in xs:
                    expected[f"{name}:{position}"] = v
                    position += 1
                x += rows
    return expected


CALLS: dict = {"read": 0, "read_batch": 0, "batched_rows": 0}


class CountingParquet(ParquetSource):
    """Counts the calls of each read path (the job runs in this process: ``num_workers=0``)."""

    def read(self, unit, start, stop):
        CALLS["read"] += 1
        yield from super().read(unit, start, stop)

    def read_batch(self, unit, start, stop):
        CALLS["read_batch"] += 1
        batch = self.batch_of(unit, start, stop)
        if batch is not None:
            CALLS["batched_rows"] += stop - start
        return batch

    def batch_of(self, unit, start, stop):
        return ParquetSource.read_batch(self, unit, start, stop)


POISON_X = 50.0  # inside the 55-row group of a.parquet, mid-range of a batched read


class PoisonParquet(CountingParquet):
    """Row x == 50 cannot be decoded: the batched read of any range holding it raises."""

    def read(self, unit, start, stop):
        for row in super().read(unit, start, stop):
            if row["x"] == POISON_X:
                raise ValueError("corrupt record x=50")
            yield row

    def batch_of(self, unit, start, stop):
        batch = super().batch_of(unit, start, stop)
        if batch is not None and bool((batch["x"] == POISON_X).any()):
            raise ValueError("corrupt page")
        return batch


class Scorer(L.LightningModule):
    """Predictions that depend on every column type the batch carries."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1, dtype=torch.float64)
        with torch.no_grad():
            self.layer.weight.fill_(3.0)
            self.layer.bias.fill_(1.0)

    def predict_step(self, batch, batch_idx):
        return {"y": self.layer(batch["x"][:, None])[:, 0], "w": batch["w"], "n": batch["n"] * 2,
                "flag": batch["flag"], "note_len": torch.tensor([len(s) for s in batch["note"]]),
                "dtypes": [f"{batch['x'].dtype},{batch['n'].dtype},{batch['flag'].dtype}"] * len(batch["note"])}


def rows_collate(rows: list):
    """A user's own collate_fn (here the default one, wrapped): the per-row path must keep feeding it rows."""
    return default_collate(rows)


def run(out: Path, source, collate_fn=None, max_failed_rows: int = 2, **extra) -> None:
    spec = JobSpec(output_dir=str(out), batch_size=10, shard_size=40, max_failed_rows=max_failed_rows, extra=extra)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[make_callback(spec)],
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    loader = DataLoader(source, batch_size=spec.batch_size, num_workers=0, collate_fn=collate_fn)
    trainer.predict(Scorer(), dataloaders=loader)


def reset_calls() -> None:
    CALLS.update(read=0, read_batch=0, batched_rows=0)


def assert_same_batch(fast, rows) -> None:
    assert list(fast) == list(rows)
    for key in rows:
        if isinstance(rows[key], torch.Tensor):
            assert isinstance(fast[key], torch.Tensor), key
            assert fast[key].dtype == rows[key].dtype and fast[key].shape == rows[key].shape, key
            assert torch.equal(fast[key], rows[key]), key
        else:
            assert type(fast[key]) is type(rows[key]) and fast[key] == rows[key], key


@pytest.mark.parametrize("options", [dict(), dict(columns=["x", "note"], key="k"),
                                     dict(key="note", id_column="row_key"), dict(columns=["n", "flag", "w"])])
def test_a_batched_read_collates_exactly_like_the_rows_across_units(tmp_path, options):
    write_inputs(tmp_path)
    source = ParquetSource(str(tmp_path), **options)
    layout = source_layout(source)
    fast = SourceDataset(source, layout, batched=True, fetch_threads=2)
    rows = SourceDataset(source, layout)
    collate = ElasticCollate(None, source.id_column)
    # every batch of 10 (they cross row groups and files), odd ranges, a single row, the whole input
    ranges = [(s, min(s + 10, layout.num_rows)) for s in range(0, layout.num_rows, 10)]
    ranges += [(5, 39), (84, 86), (233, 234), (0, layout.num_rows)]
    for start, stop in ranges:
        ticket = BatchTicket(0, start, stop, tuple(range(start, stop)), False, 1)
        loaded = fast.__getitems__(ticket)
        assert loaded.batch is not None and loaded.samples == []
        got, want = collate(loaded), collate(rows.__getitems__(ticket))
        assert list(got.indices) == list(want.indices) == list(range(start, stop))
        assert list(got.ids) == list(want.ids) and got.failures == want.failures == []
        assert_same_batch(got.data, want.data)
    assert list(got.ids[:3]) == ([10_000_000_000, 10_000_000_001, 10_000_000_002] if "key" in options and options["key"] == "k"
                           else ["n0", "n1", "n2"] if "key" in options else ["a.parquet:0", "a.parquet:1", "a.parquet:2"])


def test_the_fast_path_predicts_what_the_per_row_path_predicts_and_is_taken(tmp_path):
    expected = write_inputs(tmp_path / "in")
    reset_calls()
    run(tmp_path / "fast", CountingParquet(str(tmp_path / "in")), fetch_threads=2)
    # every row was read column by column, none as a row dict
    assert CALLS["read"] == 0 and CALLS["read_batch"] > 0 and CALLS["batched_rows"] == len(expected)
    reset_calls()
    run(tmp_path / "rows", CountingParquet(str(tmp_path / "in")), collate_fn=rows_collate, fetch_threads=2)
    assert CALLS["read_batch"] == 0 and CALLS["read"] > 0

    fast, rows = read_predictions(tmp_path / "fast"), read_predictions(tmp_path / "rows")
    assert fast.equals(rows)
    assert fast.column("row_id").to_pylist() == list(range(len(expected)))
    assert dict(zip(fast.column("input_id").to_pylist(), fast.column("y").to_pylist())) == {
        k: 3.0 * v + 1.0 for k, v in expected.items()}
    assert set(fast.column("dtypes").to_pylist()) == {"torch.float64,torch.int64,torch.bool"}
    assert read_errors(tmp_path / "fast") == read_errors(tmp_path / "rows") == []


def test_a_transform_keeps_the_per_row_path(tmp_path):
    write_inputs(tmp_path)
    source = ParquetSource(str(tmp_path), columns=["x"], transform=lambda row: {"x": row["x"] * 2})
    layout = source_layout(source)
    ticket = BatchTicket(0, 0, 10, tuple(range(10)), False, 1)
    loaded = SourceDataset(source, layout, batched=True).__getitems__(ticket)
    assert loaded.batch is None and [s["x"] for s in loaded.samples] == [2.0 * i for i in range(10)]


def test_sources_without_a_batched_read_are_read_row_by_row(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(f'{{"x": {i}}}\n' for i in range(12)))
    source = JsonlSource(str(tmp_path))
    dataset = SourceDataset(source, source_layout(source), batched=True)
    assert not dataset.batched  # JsonlSource keeps ShardedSource.read_batch, which reads nothing
    loaded = dataset.__getitems__(BatchTicket(0, 0, 12, tuple(range(12)), False, 1))
    assert loaded.batch is None and [s["x"] for s in loaded.samples] == list(range(12))


def test_a_batched_read_that_raises_fails_its_unit_with_the_cause_never_row_by_row(tmp_path):
    expected = write_inputs(tmp_path / "in")
    reset_calls()
    # a columnar read has no row of its own to isolate: its failure is the unit's, retried, then reported
    run(tmp_path / "out", PoisonParquet(str(tmp_path / "in")), max_failed_rows=55, unit_retry_backoff_s=0.01)
    table = read_predictions(tmp_path / "out")
    errors = read_errors(tmp_path / "out")
    failed = {e["row"] for e in errors}
    unit_rows = {f"a.parquet:{p}" for p in range(30, 85)}  # the 55-row group a.parquet#2 that holds x == 50
    assert "a.parquet:50" in failed and failed <= unit_rows
    assert {e["stage"] for e in errors} == {"unit"}
    assert all("source unit 'a.parquet#2' could not be read: ValueError: corrupt page (after 3 attempts)" in e["error"]
               for e in errors)
    assert dict(zip(table.column("input_id").to_pylist(), table.column("y").to_pylist())) == {
        k: 3.0 * v + 1.0 for k, v in expected.items() if k not in failed}
    assert CALLS["read"] == 0  # no silent fallback to the per-row path
    # within the default budget the job fails, naming the unit and the cause
    with pytest.raises(ErrorBudgetExceededError, match=r"a\.parquet#2.*corrupt page"):
        run(tmp_path / "out2", PoisonParquet(str(tmp_path / "in")), unit_retry_backoff_s=0.01)


def test_a_custom_collate_fn_gets_row_dicts(tmp_path):
    write_inputs(tmp_path / "in")
    seen: list = []

    def collate(rows):
        seen.append(type(rows[0]).__name__)
        assert isinstance(rows, list) and isinstance(rows[0], dict) and set(rows[0]) >= {"x", "note", "input_id"}
        return default_collate(rows)

    reset_calls()
    run(tmp_path / "out", CountingParquet(str(tmp_path / "in")), collate_fn=collate)
    assert CALLS["read_batch"] == 0 and set(seen) == {"dict"}
    assert read_predictions(tmp_path / "out").num_rows == sum(sum(g) for g in LAYOUT.values())


def _column_batch(tmp_path, rows: int):
    """The first ``rows`` rows of the test's Parquet inputs as the column batch a DataLoader worker builds."""
    write_inputs(tmp_path)
    source = ParquetSource(str(tmp_path), key="k")
    ticket = BatchTicket(0, 0, rows, range(rows), False, 1)
    loaded = SourceDataset(source, source_layout(source), batched=True).__getitems__(ticket)
    return ElasticCollate(None, source.id_column)(loaded)


def test_the_ids_of_a_column_batch_are_its_own_whatever_becomes_of_its_tensors(tmp_path):
    # a DataLoader worker sends the batch by moving its tensors' storage to shared memory, which frees the memory
    # the tensors had: ids read from that memory afterwards would be whatever was written there next
    batch = _column_batch(tmp_path, 20)
    expected = batch.data["k"].tolist()
    batch.data["k"].fill_(-1)
    batch.data["k"].share_memory_()
    assert list(batch.ids) == expected and -1 not in expected


class Double(L.LightningModule):
    def predict_step(self, batch, batch_idx):
        return {"y": batch["x"] * 2}


@pytest.mark.timeout(300)
def test_ids_written_through_dataloader_workers_are_each_rows_own(tmp_path):
    import numpy as np

    from lightning_paro.predict import ElasticPredict

    keys = np.random.default_rng(0).permutation(40_000).astype(np.int64) + 10_000_000_000
    xs = np.arange(40_000, dtype=np.float32)
    (tmp_path / "in").mkdir()
    for f in range(4):
        part = slice(f * 10_000, (f + 1) * 10_000)
        pq.write_table(pa.table({"k": keys[part], "x": xs[part]}), tmp_path / "in" / f"p{f}.parquet",
                       row_group_size=3_000)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[ElasticPredict(str(tmp_path / "out"))])
    loader = DataLoader(ParquetSource(str(tmp_path / "in"), key="k"), batch_size=512, num_workers=2)
    trainer.predict(Double(), dataloaders=loader)
    table = read_predictions(tmp_path / "out")
    assert table.column("k").to_pylist() == keys.tolist()
    assert table.column("y").to_pylist() == (2 * xs).tolist()


def test_a_column_batch_crosses_processes_by_value_and_arrives_as_the_same_tensors(tmp_path):
    import pickle

    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers how tensors are sent between processes)

    batch = _column_batch(tmp_path, 60)
    sent = bytes(ForkingPickler.dumps(batch))  # what a DataLoader worker sends
    # no tensor went through shared memory: the bytes hold the values (60 rows of 8-byte columns and more)
    assert b"rebuild_storage" not in sent and len(sent) > 60 * 8 * 4
    got = pickle.loads(sent)
    assert list(got.data) == list(batch.data) and list(got.indices) == list(range(60))
    for key, value in batch.data.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got.data[key], value) and got.data[key].dtype == value.dtype, key
        else:
            assert got.data[key] == value, key


# Every Arrow type a Parquet column may hold, with values at its edges: the columnar read either collates the column
# exactly as default_collate collates the row dicts, or declines it (None) and the rows are read one by one.
TYPE_CATALOGUE = {
    "i8": (pa.int8(), [-128, 0, 127]), "i16": (pa.int16(), [-32768, 1, 32767]),
    "i32": (pa.int32(), [-(2**31), 2, 2**31 - 1]), "i64": (pa.int64(), [-(2**63), 3, 2**63 - 1]),
    "u8": (pa.uint8(), [0, 1, 255]), "u16": (pa.uint16(), [0, 2, 65535]), "u32": (pa.uint32(), [0, 3, 2**32 - 1]),
    "u64": (pa.uint64(), [0, 4, 2**64 - 1]),
    "f16": (pa.float16(), [-1.5, 0.0, 65504.0]), "f32": (pa.float32(), [-3.4e38, 1.1754944e-38, 0.1]),
    "f64": (pa.float64(), [-1.7976931348623157e308, 5e-324, float("inf")]),
    "bool": (pa.bool_(), [True, False, True]),
    "str": (pa.string(), ["", "é€", "x" * 40]), "lstr": (pa.large_string(), ["a", "", "ü"]),
    "bin": (pa.binary(), [b"", b"\x00\xff", b"z"]), "lbin": (pa.large_binary(), [b"q", b"", b"\x01"]),
    "fbin": (pa.binary(2), [b"ab", b"\x00\x01", b"zz"]),
    "date": (pa.date32(), [0, 19000, 1]), "ts": (pa.timestamp("us"), [0, 1, 1_700_000_000_000_000]),
    "dec": (pa.decimal128(10, 2), [None, None, None]),
    "list": (pa.list_(pa.int32()), [[1], [], [2, 3]]),
    "struct": (pa.struct([("a", pa.int32())]), [{"a": 1}, {"a": 2}, {"a": 3}]),
    "null_int": (pa.int64(), [1, None, 3]), "null_str": (pa.string(), ["a", None, "c"]),
}
SUPPORTED = {"i8", "i16", "i32", "i64", "u8", "u16", "u32", "f32", "f64", "bool", "str", "lstr", "bin", "lbin"}


def _catalogue_file(path: Path, rows: int) -> None:
    import decimal

    columns = {}
    for name, (kind, edges) in TYPE_CATALOGUE.items():
        if name == "dec":
            edges = [decimal.Decimal("-99999999.99"), decimal.Decimal("0.01"), decimal.Decimal("12.50")]
        columns[name] = pa.array([edges[i % len(edges)] for i in range(rows)], type=kind)
    pq.write_table(pa.table(columns), path, row_group_size=rows)


@pytest.mark.parametrize("streamed", [False, True])
def test_every_column_type_is_collated_as_the_rows_are_or_read_row_by_row(tmp_path, monkeypatch, streamed):
    from lightning_paro.predict import builtin_sources

    if streamed:  # a row group read a slice at a time: columns of several chunks, booleans at odd bit offsets
        monkeypatch.setattr(builtin_sources, "WHOLE_ROW_GROUP_BYTES", 0)
        monkeypatch.setattr(builtin_sources, "_STREAM_BATCH_ROWS", 5)
    _catalogue_file(tmp_path / "types.parquet", 40)
    taken = set()
    for name in TYPE_CATALOGUE:
        source = ParquetSource(str(tmp_path), columns=[name])
        [unit] = source_layout(source).units
        for start, stop in [(0, 40), (3, 17), (11, 12), (21, 40)]:
            fast = source.read_batch(unit, start, stop)
            rows = list(source.read(unit, start, stop))
            if any(row[name] is None for row in rows):
                assert fast is None, name  # a null: default_collate's own outcome is the per-row path's
            if fast is None:
                continue
            taken.add(name)
            want = default_collate(rows)
            assert_same_batch(fast, want)
    # what is read as columns (a nullable column where a slice holds no null), and every other type keeps the per-row path
    assert taken == SUPPORTED | {"null_int", "null_str"}
