"""One benchmark configuration per function; each runs in its own process and returns its measurements."""

from __future__ import annotations

import functools
import os
import resource
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader

from workload import HttpRecords, Scorer, ThreadedHttpRecords, TinyEncoder

BATCH = 32
LOADER_WORKERS = 2
ENCODER = dict(width=256, layers=2)
SCORER = dict(width=256, layers=6)


def build_encoder() -> torch.nn.Module:
    return TinyEncoder(**ENCODER).eval()


def build_scorer(layers: int | None = None) -> torch.nn.Module:
    return Scorer(**{**SCORER, "layers": layers or SCORER["layers"]}).eval()


def _embedding_column(x: torch.Tensor) -> pa.Array:
    arr = x.detach().cpu().numpy()
    return pa.FixedSizeListArray.from_arrays(pa.array(arr.reshape(-1)), arr.shape[1])


def _peak_rss_mib() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return round((own + children) / 1024, 1)


def _loader(url, rows, getitems_threads: int | None = None, loader_workers: int = LOADER_WORKERS):
    """The benchmark's DataLoader; a plain anchor may fetch each batch with ``getitems_threads`` threads in the
    dataset's ``__getitems__``, or run more DataLoader workers."""
    dataset = HttpRecords(url, rows) if not getitems_threads else ThreadedHttpRecords(url, rows, getitems_threads)
    return DataLoader(dataset, batch_size=BATCH, num_workers=loader_workers)


def _lightning_module(multi: bool, elastic: bool, scorer_layers: int | None = None):
    import lightning as L

    class Predictor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = build_encoder()
            self.scorer = build_scorer(scorer_layers) if multi else None

        def predict_step(self, batch, batch_idx):
            embedding = self.encoder(batch["tokens"])
            if elastic:
                out = {"embedding": embedding}
                if multi:
                    out["scores"] = self.scorer(embedding)
                return out
            return (batch["id"], embedding, self.scorer(embedding) if multi else None)

    return Predictor()


class _BatchClock:
    """When each batch's predictions were done (handed to the writer), to tell the steady rate from the start-up."""

    def __init__(self) -> None:
        self.stamps: list[tuple[float, int]] = []

    def stamp(self, rows: int) -> None:
        if rows:
            self.stamps.append((time.perf_counter(), rows))

    def steady(self) -> dict:
        """Rows per second from the first batch's end to the last's, and the seconds before the first batch."""
        if len(self.stamps) < 2:
            return {}
        rows = sum(n for _, n in self.stamps[1:])
        return {"steady_rows_per_s": rows / (self.stamps[-1][0] - self.stamps[0][0]), "first_batch_at": self.stamps[0][0]}


def _stamping_callback(clock: _BatchClock):
    from lightning.pytorch.callbacks import Callback

    class Stamp(Callback):
        def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            if isinstance(outputs, tuple):  # the baseline's (ids, embedding, scores)
                clock.stamp(len(outputs[0]))

    return Stamp()


def _stamp_worker_batches(clock: _BatchClock) -> None:
    """Stamps every batch ElasticPredict and run_pipeline hand to their writer (the same point for both)."""
    from lightning_paro.predict import run as worker_run

    handed = worker_run.WorkerRun.on_batch_end

    def on_batch_end(self, outputs):
        handed(self, outputs)
        clock.stamp(len(getattr(outputs, "indices", ())))

    worker_run.WorkerRun.on_batch_end = on_batch_end


def _timing(elapsed: float, start: float, clock: _BatchClock) -> dict:
    out = {"seconds": elapsed}
    steady = clock.steady()
    if steady:
        out["steady_rows_per_s"] = steady["steady_rows_per_s"]
        out["first_batch_s"] = steady["first_batch_at"] - start
        out["after_last_batch_s"] = start + elapsed - clock.stamps[-1][0]
    return out


def _trainer(callbacks):
    import lightning as L

    return L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=callbacks, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False)


def baseline(url, rows, out: Path, multi: bool, scorer_layers: int | None = None, getitems_threads: int | None = None,
             loader_workers: int = LOADER_WORKERS) -> dict:
    """Plain Trainer.predict with a BasePredictionWriter writing one Parquet file per batch; ``getitems_threads`` and
    ``loader_workers`` give its reading I/O concurrency (see ``_loader``)."""
    from lightning.pytorch.callbacks import BasePredictionWriter

    class ParquetWriter(BasePredictionWriter):
        def __init__(self) -> None:
            super().__init__(write_interval="batch")

        def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
            ids, embedding, scores = prediction
            columns = {"row_id": pa.array(ids.numpy()), "embedding": _embedding_column(embedding)}
            if scores is not None:
                columns["scores"] = _embedding_column(scores)
            pq.write_table(pa.table(columns), out / f"batch-{batch_idx:06d}.parquet")

    out.mkdir(parents=True, exist_ok=True)
    clock = _BatchClock()
    trainer = _trainer([ParquetWriter(), _stamping_callback(clock)])
    start = time.perf_counter()
    module = _lightning_module(multi, elastic=False, scorer_layers=scorer_layers)
    trainer.predict(module, dataloaders=_loader(url, rows, getitems_threads, loader_workers), return_predictions=False)
    elapsed = time.perf_counter() - start
    written = sum(pq.ParquetFile(p).metadata.num_rows for p in out.glob("*.parquet"))
    return {**_timing(elapsed, start, clock), "rows": written}


def elastic(url, rows, out: Path, multi: bool, fetch_threads=None) -> dict:
    """The same Trainer.predict with ElasticPredict; ``fetch_threads`` None is the default (chosen as it reads)."""
    from lightning_paro.predict import ElasticPredict, read_predictions

    clock = _BatchClock()
    _stamp_worker_batches(clock)
    callback = ElasticPredict(str(out), shard_size=256, fetch_threads=fetch_threads)
    trainer = _trainer([callback])
    start = time.perf_counter()
    trainer.predict(_lightning_module(multi, elastic=True), dataloaders=_loader(url, rows))
    elapsed = time.perf_counter() - start
    table = read_predictions(out, columns=["row_id"])
    return {**_timing(elapsed, start, clock), "rows": table.num_rows, "unique_rows": len(set(table.column("row_id").to_pylist())),
            "fetch_threads_used": _threads_used(callback.run.fetch_threads_used)}


def _threads_used(counts: dict) -> dict:
    """Batches read with each number of fetch threads per DataLoader worker, as a JSON object."""
    return {str(k): v for k, v in sorted(counts.items())}


class _EncodeStage(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = build_encoder()

    def forward(self, batch):
        return {"embedding": self.encoder(batch["tokens"])}


class _ScoreStage(torch.nn.Module):
    def __init__(self, layers: int | None = None) -> None:
        super().__init__()
        self.scorer = build_scorer(layers)

    def forward(self, batch):
        return {"embedding": batch["embedding"], "scores": self.scorer(batch["embedding"])}


def build_encode_stage():
    return _EncodeStage().eval()


def build_score_stage(layers: int | None = None):
    return _ScoreStage(layers).eval()


def pipeline(url, rows, out: Path, max_replicas: int, fetch_threads=None, scorer_layers: int | None = None) -> dict:
    """Two models as pipeline stages in their own processes (with ``max_replicas`` 2, one process each)."""
    from lightning_paro.predict import PipelineStage, read_predictions, run_pipeline

    clock = _BatchClock()
    _stamp_worker_batches(clock)
    stages = [PipelineStage("encode", build_encode_stage),
              PipelineStage("score", functools.partial(build_score_stage, scorer_layers))]
    start = time.perf_counter()
    report = run_pipeline(stages, _loader(url, rows), str(out), max_replicas=max_replicas, shard_size=256,
                          fetch_threads=fetch_threads)
    elapsed = time.perf_counter() - start
    table = read_predictions(out, columns=["row_id"])
    return {**_timing(elapsed, start, clock), "rows": table.num_rows, "unique_rows": len(set(table.column("row_id").to_pylist())),
            "replicas": report.replicas, "fetch_threads_used": _threads_used(report.fetch_threads)}


def model_limit(multi: bool, measure_rows: int = 640, scorer_layers: int | None = None) -> dict:
    """Each model alone on a token batch held in memory (the benchmark's batch size, one thread, after one warm-up
    call): the model stage's own throughput."""
    tokens = torch.randint(0, 4096, (BATCH, 64))
    encoder = build_encoder()
    result = {}
    with torch.inference_mode():
        encoder(tokens)
        start = time.perf_counter()
        for _ in range(measure_rows // BATCH):
            embedding = encoder(tokens)
        result["encoder_rows_per_s"] = measure_rows / (time.perf_counter() - start)
        if multi:
            scorer = build_scorer(scorer_layers)
            scorer(embedding)
            start = time.perf_counter()
            for _ in range(measure_rows // BATCH):
                scorer(embedding)
            result["scorer_rows_per_s"] = measure_rows / (time.perf_counter() - start)
    return result


def read_limit(url, rows: int, concurrency: int) -> dict:
    """The read path alone (fetch + preprocess) with many requests in flight."""
    from concurrent.futures import ThreadPoolExecutor

    dataset = HttpRecords(url, rows)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(dataset.__getitem__, range(rows)))
    return {"read_rows_per_s": rows / (time.perf_counter() - start)}


def run(name: str, url, rows: int, out: Path, **kwargs) -> dict:
    torch.set_num_threads(1)
    fn = {"baseline": baseline, "elastic": elastic, "pipeline": pipeline, "model_limit": model_limit,
          "read_limit": read_limit}[name]
    if name == "model_limit":
        result = fn(**kwargs)
        result["rows_per_s"] = min(v for k, v in result.items() if k.endswith("_rows_per_s"))
    else:
        result = fn(url, rows, out, **kwargs) if name != "read_limit" else fn(url, rows, **kwargs)
    if "seconds" in result:
        result["rows_per_s"] = result["rows"] / result["seconds"]
    result["peak_rss_mib"] = _peak_rss_mib()
    result["pid"] = os.getpid()
    return result
