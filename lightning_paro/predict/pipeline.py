"""Multi-model pipelines: each model a stage in its own process(es), stages joined by bounded queues.

The driver process leases shards and reads batches exactly like a single-model worker (same
sampler, DataLoader workers, writer and ledger); batches then flow through the stages, several
replicas per stage, and come back to the driver, which restores their order and hands them to the
writer. A shard is committed only after its last batch has left the last stage and been written.

This module is the driver: the replica counts (profiled, :func:`allocate_replicas`) and the loop that sends batches,
restores their order and replays them after a restart (:func:`run_pipeline`). The stage processes and their queues
are :mod:`lightning_paro.predict.stages`.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch.utils.data import DataLoader

from lightning_paro.predict.batch import StepOutcome
from lightning_paro.predict.config import ElasticPredictConfig
from lightning_paro.predict.loader import single_dataloader
from lightning_paro.predict.run import WorkerRun

# PipelineStage and PipelineStageError are defined with the stage processes; callers import them from here too.
from lightning_paro.predict.stages import (  # noqa: F401
    PipelineStage,
    PipelineStageError,
    StageDied,
    StageGraph,
    call_model,
    pack,
    rows_of,
)

log = logging.getLogger(__name__)


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


def profile_stages(stages: Sequence[PipelineStage], sample: Any, repeats: int = 2) -> dict:
    """Seconds per row of each stage, measured by running a sample batch through the chain in this process."""
    timings = {}
    data = sample
    with torch.inference_mode():
        for stage in stages:
            model = stage.build().to(stage.device).eval()
            size = rows_of(data, 1)
            call_model(model, data, stage.batch_size, size)  # warm-up
            start = time.perf_counter()
            for _ in range(repeats):
                output = call_model(model, data, stage.batch_size, size)
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
    graph = StageGraph(stages, report.replicas, config.row_retries, queue_size, start_method)
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
                pending[sent] = pack((sent, batch))
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
