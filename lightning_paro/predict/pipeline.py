"""Multi-model pipelines: each model a stage in its own process(es), stages joined by bounded queues.

The driver process leases shards and reads batches exactly like a single-model worker (same
sampler, DataLoader workers, writer and ledger); batches then flow through the stages, several
replicas per stage, and come back to the driver, which restores their order and hands them to the
writer. A shard is committed only after its last batch has left the last stage and been written.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import queue
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils.data import DataLoader

from lightning_paro.predict.batch import ElasticBatch, RowFailure, StepOutcome, batch_size_of, slice_batch, take
from lightning_paro.predict.config import ElasticPredictConfig
from lightning_paro.predict.isolation import predict_isolated
from lightning_paro.predict.loader import single_dataloader
from lightning_paro.predict.run import WorkerRun

log = logging.getLogger(__name__)


class PipelineStageError(RuntimeError):
    """A stage process failed outside of per-row isolation (it died, or its model could not be built)."""


@dataclass(frozen=True)
class PipelineStage:
    """One model of a multi-model pipeline."""

    name: str
    """Stage name, used in errors and reports."""
    build: Callable[[], torch.nn.Module]
    """Picklable factory called inside each replica process to build the model (LightningModule or nn.Module)."""
    batch_size: Optional[int] = None
    """Rows per call of this stage's model (incoming batches are cut to this); None: the incoming batch."""
    device: str = "cpu"
    """Device of this stage's replicas."""
    replicas: Optional[int] = None
    """Processes running this stage; None: chosen from the profiling pass."""
    threads: int = 1
    """Intra-op CPU threads of each replica."""


@dataclass
class PipelineReport:
    """What a pipeline run did."""

    replicas: dict = field(default_factory=dict)
    """Replica count of each stage."""
    profile_s_per_row: dict = field(default_factory=dict)
    """Seconds per row of each stage in the profiling pass (empty when there was nothing to choose: every replica
    count given, or ``max_replicas`` leaving one replica to each stage)."""
    manifest: Optional[dict] = None
    """The job's manifest, when this run completed the job."""
    batches: int = 0
    """Batches this driver pushed through the pipeline."""
    stage_restarts: int = 0
    """Times the stages were restarted after a replica died."""
    fetch_threads: dict = field(default_factory=dict)
    """Batches read with each number of fetch threads per DataLoader worker (chosen when ``fetch_threads`` is None)."""


def _call_model(model: torch.nn.Module, data: Any, batch_size: Optional[int], size: int) -> Any:
    """Runs ``model`` on ``data`` in micro-batches of ``batch_size`` rows and joins the outputs."""
    import lightning.pytorch as pl

    def call(part: Any) -> Any:
        return model.predict_step(part, 0) if isinstance(model, pl.LightningModule) else model(part)

    if batch_size is None or size <= batch_size:
        return call(data)
    outputs = []
    for start in range(0, size, batch_size):
        outputs.append(call(slice_batch(data, list(range(start, min(start + batch_size, size))), size)))
    return concat_outputs(outputs)


def concat_outputs(parts: list) -> Any:
    """Joins per-chunk outputs (tensors, lists, or dicts of them) along the row dimension."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(parts, dim=0)
    if isinstance(first, dict):
        return {k: concat_outputs([p[k] for p in parts]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(v for p in parts for v in p)
    raise TypeError(f"cannot join stage outputs of type {type(first).__name__}; return tensors, lists or dicts")


def next_stage_batch(batch: ElasticBatch, outcome: StepOutcome, stage: str) -> ElasticBatch:
    """The rows that passed a stage, with their outputs as the next stage's input."""
    if len(outcome.chunks) == 1:
        positions = outcome.chunks[0][0]  # one chunk: its positions, a range when every row passed
    else:
        positions = [p for chunk_positions, _ in outcome.chunks for p in chunk_positions]
    data = concat_outputs([prediction for _, prediction in outcome.chunks]) if outcome.chunks else None
    failures = [f if f.stage != "predict_step" else RowFailure(f.index, f.row_id, stage, f.error, f.traceback)
                for f in outcome.failures]
    return ElasticBatch(
        data=data,
        ticket=batch.ticket,
        indices=take(batch.indices, positions),
        ids=take(batch.ids, positions) if batch.ids is not None else None,
        failures=failures,
    )


def _pack(item: Any) -> bytes:
    """Plain pickling: tensors are copied into the message instead of shared through file descriptors,
    so a replica that dies mid-transfer cannot leave the receiver waiting on a vanished sender."""
    return pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)


def _unpack(message: bytes) -> Any:
    return pickle.loads(message)


def _stage_loop(stage: PipelineStage, is_last: bool, row_retries: int, inbox, outbox, results) -> None:
    """Body of one replica process: take (seq, batch), run the model with poison isolation, pass it on."""
    try:
        torch.set_num_threads(stage.threads)
        model = stage.build().to(stage.device).eval()
    except BaseException:
        results.put(_pack(("error", stage.name, traceback.format_exc())))
        return
    with torch.inference_mode():
        while True:
            message = inbox.get()
            if message is None:
                return
            seq, batch = _unpack(message)
            try:
                if batch.data is not None and stage.device != "cpu":
                    batch.data = _to_device(batch.data, stage.device)
                outcome = predict_isolated(
                    lambda data: _call_model(model, data, stage.batch_size, _rows(data, len(batch.indices))),
                    batch,
                    row_retries,
                )
                outcome.failures = [
                    f if f.stage != "predict_step" else RowFailure(f.index, f.row_id, stage.name, f.error, f.traceback)
                    for f in outcome.failures
                ]
            except BaseException:
                results.put(_pack(("error", stage.name, traceback.format_exc())))
                return
            if is_last:
                results.put(_pack(("done", seq, outcome)))
            else:
                outbox.put(_pack((seq, next_stage_batch(batch, outcome, stage.name))))


def _rows(data: Any, fallback: int) -> int:
    size = batch_size_of(data)
    return size if size is not None else fallback


def _to_device(data: Any, device: str) -> Any:
    if isinstance(data, torch.Tensor):
        return data.to(device)
    if isinstance(data, dict):
        return {k: _to_device(v, device) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_to_device(v, device) for v in data)
    return data


def profile_stages(stages: Sequence[PipelineStage], sample: Any, repeats: int = 2) -> dict:
    """Seconds per row of each stage, measured by running a sample batch through the chain in this process."""
    timings = {}
    data = sample
    with torch.inference_mode():
        for stage in stages:
            model = stage.build().to(stage.device).eval()
            size = _rows(data, 1)
            _call_model(model, data, stage.batch_size, size)  # warm-up
            start = time.perf_counter()
            for _ in range(repeats):
                output = _call_model(model, data, stage.batch_size, size)
            timings[stage.name] = (time.perf_counter() - start) / (repeats * max(size, 1))
            data = output
            del model
    return timings


def allocate_replicas(seconds_per_row: dict, total: int, fixed: dict) -> dict:
    """Replica counts so that no stage starves the next: each extra replica goes to the current bottleneck."""
    counts = {name: fixed.get(name) or 1 for name in seconds_per_row}
    free = [name for name in seconds_per_row if not fixed.get(name)]
    while free and sum(counts.values()) < total:
        bottleneck = max(free, key=lambda n: seconds_per_row[n] / counts[n])
        counts[bottleneck] += 1
    return counts


def run_pipeline(
    stages: Sequence[PipelineStage],
    dataloader: DataLoader,
    output_dir: str,
    max_replicas: Optional[int] = None,
    queue_size: int = 4,
    profile_batches: int = 2,
    start_method: str = "fork",
    max_stage_restarts: int = 2,
    **settings: Any,
) -> PipelineReport:
    """Runs a chain of models over ``dataloader``'s dataset as one worker of an elastic prediction job.

    ``settings`` are the fields of ``ElasticPredictConfig`` (ledger, shard_size, format, ...). Stage
    replica counts not given are chosen from a short profiling pass so that ``max_replicas``
    processes (default: the CPU count) are shared in proportion to each stage's cost. Several
    drivers (on one or many machines) may run the same pipeline against the same job. When a stage
    replica dies, all stages are restarted and the batches in flight are replayed (at most
    ``max_stage_restarts`` times); a batch's outcome is used once, so the output stays exact.
    """
    if not stages:
        raise ValueError("a pipeline needs at least one stage")
    config = ElasticPredictConfig(output_dir=str(output_dir), **settings)
    loader = single_dataloader(dataloader)
    report = PipelineReport()
    fixed = {s.name: s.replicas for s in stages if s.replicas}
    total = max(max_replicas or multiprocessing.cpu_count(), len(stages))
    if len(fixed) < len(stages) and total > sum(fixed.values()) + len(stages) - len(fixed):
        sample = next(iter(DataLoader(loader.dataset, batch_size=loader.batch_size, collate_fn=loader.collate_fn)))
        report.profile_s_per_row = profile_stages(stages, sample, repeats=profile_batches)
        report.replicas = allocate_replicas(report.profile_s_per_row, total, fixed)
    else:
        # every count is given, or the processes allowed leave one replica to each stage not given: no profiling
        report.replicas = {s.name: fixed.get(s.name) or 1 for s in stages}
    log.info("pipeline replicas: %s", report.replicas)

    # the stage processes are forked before the worker's threads (writer, heartbeat) exist
    graph = _StageGraph(stages, report.replicas, config.row_retries, queue_size, start_method)
    try:
        run = WorkerRun(config, loader)
    except BaseException:
        # a refused job or an unreachable ledger: the stages must not outlive this call
        graph.stop(wait=False)
        raise
    max_in_flight = queue_size * len(stages) + sum(report.replicas.values())
    pending: dict = {}  # seq -> packed input, for batches not yet back from the last stage (replayed on restart)
    done: dict = {}
    sent = flushed = 0
    failed = True

    def collect(block: bool) -> None:
        try:
            seq, outcome = graph.next_result(block)
        except StageDied as death:
            if report.stage_restarts >= max_stage_restarts:
                raise PipelineStageError(
                    f"{death} and the pipeline was already restarted {report.stage_restarts} times "
                    "(max_stage_restarts); committed shards are kept and rerunning resumes the job"
                ) from None
            report.stage_restarts += 1
            log.warning("%s: restarting the stages and replaying %d in-flight batches", death, len(pending))
            graph.restart()
            for key in sorted(pending):
                graph.submit(pending[key])
            return
        if seq is None or seq not in pending:
            return  # nothing yet, or a duplicate of a batch replayed after a restart
        del pending[seq]
        done[seq] = outcome

    def flush() -> None:
        nonlocal flushed
        while flushed in done:
            run.on_batch_end(done.pop(flushed))
            flushed += 1

    try:
        for batch in run.dataloader:
            run.note_batch(batch)
            if len(batch.indices) == 0:
                # nothing to predict (idle ticket, or every row failed to load): skip the stages
                done[sent] = StepOutcome(ticket=batch.ticket, indices=[], ids=batch.ids, failures=list(batch.failures))
            else:
                while len(pending) >= max_in_flight:
                    collect(block=True)
                    flush()
                pending[sent] = _pack((sent, batch))
                graph.submit(pending[sent])
            sent += 1
            collect(block=False)
            flush()
        while pending:
            collect(block=True)
            flush()
        flush()
        report.batches = sent
        report.fetch_threads = dict(run.fetch_threads_used)
        report.manifest = run.finish()
        failed = False
    except BaseException:
        run.abort()
        raise
    finally:
        graph.stop(wait=not failed)
        run.close()
    return report


class StageDied(RuntimeError):
    """A stage replica process is gone (killed, crashed)."""


class _StageGraph:
    """The stage processes and the queues between them; rebuilt whole after a replica dies, because a
    process killed while holding a queue's lock can leave that queue unusable for everyone."""

    def __init__(self, stages, replicas: dict, row_retries: int, queue_size: int, start_method: str) -> None:
        self.stages = list(stages)
        self.replicas = replicas
        self.row_retries = row_retries
        self.queue_size = queue_size
        self.ctx = multiprocessing.get_context(start_method)
        self.procs: list = []
        self._start()

    def _start(self) -> None:
        ctx = self.ctx
        self.queues = [ctx.Queue(maxsize=self.queue_size) for _ in self.stages]
        self.results = ctx.Queue()
        self.procs = []
        last = len(self.stages) - 1
        try:
            for i, stage in enumerate(self.stages):
                outbox = self.queues[i + 1] if i < last else None
                for r in range(self.replicas[stage.name]):
                    proc = ctx.Process(
                        target=_stage_loop,
                        args=(stage, i == last, self.row_retries, self.queues[i], outbox, self.results),
                        name=f"pipeline-{stage.name}-{r}",
                        daemon=True,
                    )
                    proc.start()
                    self.procs.append((stage.name, proc))
        except BaseException:
            self.stop(wait=False)  # the replicas started so far
            raise

    def submit(self, message: bytes) -> None:
        """Puts a packed batch into the first stage's queue, watching for dead replicas while it is full."""
        while True:
            try:
                self.queues[0].put(message, timeout=0.2)
                return
            except queue.Full:
                self._check_alive()

    def next_result(self, block: bool):
        """``(seq, outcome)`` from the last stage, or ``(None, None)`` when nothing is ready."""
        try:
            message = self.results.get(timeout=0.2) if block else self.results.get_nowait()
        except (queue.Empty, OSError, EOFError) as exc:
            # a replica killed mid-transfer can also break the queue's pipe: report the death, not the symptom
            self._check_alive()
            if not isinstance(exc, queue.Empty):
                raise
            return None, None
        kind, key, payload = _unpack(message)
        if kind == "error":
            raise PipelineStageError(f"pipeline stage {key!r} failed:\n{payload}")
        return key, payload

    def _check_alive(self) -> None:
        for name, proc in self.procs:
            if not proc.is_alive():
                raise StageDied(f"a replica of pipeline stage {name!r} died (exit code {proc.exitcode})")

    def restart(self) -> None:
        self.stop(wait=False)
        self._start()

    def stop(self, wait: bool) -> None:
        for i, stage in enumerate(self.stages):
            for _ in range(self.replicas.get(stage.name, 0)):
                try:
                    self.queues[i].put_nowait(None)
                except (queue.Full, OSError, ValueError):
                    pass
        for _, proc in self.procs:
            # after a failure, replicas may be blocked on a full queue forever: do not wait for them
            proc.join(timeout=5 if wait else 0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for q in [*self.queues, self.results]:
            q.cancel_join_thread()  # never block interpreter exit on a queue nobody reads any more
            q.close()
