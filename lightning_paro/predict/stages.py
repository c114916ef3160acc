"""The stages of a multi-model pipeline: what a stage is, the model call and the loop of one replica process, and
the graph of replica processes and the bounded queues between them (:class:`StageGraph`, whose processes run under
the :class:`~lightning_paro.predict.supervisor.Supervisor`).

A batch travels between processes as one pickled message (:func:`pack`); a replica runs its model on it with
poison isolation and passes the rows that passed on to the next stage, or the outcome back to the driver
(:mod:`lightning_paro.predict.pipeline`).
"""

from __future__ import annotations

import pickle
import queue
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from lightning.fabric.utilities import move_data_to_device

from lightning_paro.predict.batch import ElasticBatch, RowFailure, StepOutcome, batch_size_of, slice_batch, take
from lightning_paro.predict.isolation import predict_isolated
from lightning_paro.predict.supervisor import Supervisor


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


def call_model(model: torch.nn.Module, data: Any, batch_size: Optional[int], size: int) -> Any:
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


def next_stage_batch(batch: ElasticBatch, outcome: StepOutcome) -> ElasticBatch:
    """The rows that passed a stage, with their outputs as the next stage's input (and the failures so far)."""
    if len(outcome.chunks) == 1:
        positions = outcome.chunks[0][0]  # one chunk: its positions, a range when every row passed
    else:
        positions = [p for chunk_positions, _ in outcome.chunks for p in chunk_positions]
    data = concat_outputs([prediction for _, prediction in outcome.chunks]) if outcome.chunks else None
    return ElasticBatch(
        data=data,
        ticket=batch.ticket,
        indices=take(batch.indices, positions),
        ids=take(batch.ids, positions) if batch.ids is not None else None,
        failures=outcome.failures,
    )


def pack(item: Any) -> bytes:
    """Plain pickling: tensors are copied into the message instead of shared through file descriptors,
    so a replica that dies mid-transfer cannot leave the receiver waiting on a vanished sender."""
    return pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(message: bytes) -> Any:
    return pickle.loads(message)


def _stage_loop(stage: PipelineStage, is_last: bool, row_retries: int, inbox, outbox, results) -> None:
    """Body of one replica process: take (seq, batch), run the model with poison isolation, pass it on."""
    try:
        torch.set_num_threads(stage.threads)
        model = stage.build().to(stage.device).eval()
    except BaseException:
        results.put(pack(("error", stage.name, traceback.format_exc())))
        return
    with torch.inference_mode():
        while True:
            message = inbox.get()
            if message is None:
                return
            seq, batch = unpack(message)
            try:
                if batch.data is not None and stage.device != "cpu":
                    batch.data = move_data_to_device(batch.data, stage.device)
                outcome = predict_isolated(
                    lambda data: call_model(model, data, stage.batch_size, rows_of(data, len(batch.indices))),
                    batch,
                    row_retries,
                )
                outcome.failures = [
                    f if f.stage != "predict_step" else RowFailure(f.index, f.row_id, stage.name, f.error, f.traceback)
                    for f in outcome.failures
                ]
            except BaseException:
                results.put(pack(("error", stage.name, traceback.format_exc())))
                return
            if is_last:
                results.put(pack(("done", seq, outcome)))
            else:
                outbox.put(pack((seq, next_stage_batch(batch, outcome))))


def rows_of(data: Any, fallback: int) -> int:
    """Rows in ``data`` (its batch size), or ``fallback`` where it has none."""
    size = batch_size_of(data)
    return size if size is not None else fallback


class StageDied(RuntimeError):
    """A stage replica process is gone (killed, crashed)."""


class StageGraph:
    """The stage processes and the queues between them; rebuilt whole after a replica dies, because a
    process killed while holding a queue's lock can leave that queue unusable for everyone."""

    def __init__(self, stages, replicas: dict, row_retries: int, queue_size: int, start_method: str) -> None:
        self.stages = list(stages)
        self.replicas = replicas
        self.row_retries = row_retries
        self.queue_size = queue_size
        self.supervisor = Supervisor(start_method, daemon=True)
        self._start()

    def _start(self) -> None:
        ctx = self.supervisor.ctx
        self.queues = [ctx.Queue(maxsize=self.queue_size) for _ in self.stages]
        self.results = ctx.Queue()
        last = len(self.stages) - 1
        try:
            for i, stage in enumerate(self.stages):
                outbox = self.queues[i + 1] if i < last else None
                for r in range(self.replicas[stage.name]):
                    self.supervisor.start((stage.name, r), _stage_loop,
                                          (stage, i == last, self.row_retries, self.queues[i], outbox, self.results),
                                          f"pipeline-{stage.name}-{r}")
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
        kind, key, payload = unpack(message)
        if kind == "error":
            raise PipelineStageError(f"pipeline stage {key!r} failed:\n{payload}")
        return key, payload

    def _check_alive(self) -> None:
        for (name, _), exitcode in self.supervisor.ended():
            raise StageDied(f"a replica of pipeline stage {name!r} died (exit code {exitcode})")

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
        # after a failure, replicas may be blocked on a full queue forever: do not wait for them
        self.supervisor.stop(grace_s=5 if wait else 0, kill_wait_s=5)
        for q in [*self.queues, self.results]:
            q.cancel_join_thread()  # never block interpreter exit on a queue nobody reads any more
            q.close()
