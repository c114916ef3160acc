"""One worker's part in a prediction job, as plain objects the Lightning callback only forwards to."""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import socket
import threading
import uuid
from typing import Any, Callable, Optional

from torch.utils.data import DataLoader

from lightning_paro.predict import shard_files
from lightning_paro.predict.batch import ElasticBatch, StepOutcome
from lightning_paro.predict.config import ElasticPredictConfig
from lightning_paro.predict.heartbeat import Heartbeat, ProgressClock
from lightning_paro.predict.isolation import predict_isolated
from lightning_paro.predict.ledger import LEASED, Lease, Ledger
from lightning_paro.predict.loader import BackgroundLoader, sharded_dataloader
from lightning_paro.predict.manifest import finalize_job
from lightning_paro.predict.progress import read_progress
from lightning_paro.predict.results import read_errors
from lightning_paro.predict.sampler import InFlightShards, ShardBatchSampler
from lightning_paro.predict.sources import (
    UnitRetry,
    inputs_to_check,
    is_sharded_source,
    joined_layout,
    source_layout,
)
from lightning_paro.predict.writer import (
    ErrorBudgetExceededError,
    ShardWriter,
    acknowledge_existing,
    error_budget_message,
)

log = logging.getLogger(__name__)


def default_worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def wrap_predict_step(step: Callable, row_retries: int) -> Callable:
    """``step`` made elastic: an ``ElasticBatch`` is predicted with poison isolation, anything else passes through."""

    @functools.wraps(step)  # keeps the signature Lightning inspects to decide which arguments to pass
    def elastic_predict_step(*args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        if not isinstance(batch, ElasticBatch):
            return step(*args, **kwargs)
        rest = args[1:]
        return predict_isolated(lambda data: step(data, *rest, **kwargs), batch, row_retries)

    return elastic_predict_step


class WorkerRun:
    """Sampler, writer and heartbeat of one worker, from set-up to the job's manifest."""

    def __init__(self, config: ElasticPredictConfig, loader: DataLoader) -> None:
        sharded = is_sharded_source(loader.dataset)
        source_ids = getattr(loader.dataset, "id_column", None) if sharded else None
        if config.id_column is None and source_ids:
            # a source names the stable input id of its rows: written by default so outputs join back to inputs
            config = dataclasses.replace(config, id_column=source_ids)
        self.config = config
        self.owner = config.worker_name or default_worker_name()
        self.output_dir = config.output_path
        shard_files.check_output_dir(self.output_dir)
        self.ledger = self.open_ledger()
        self.writer: Optional[ShardWriter] = None
        try:
            layout, stored = None, None
            if sharded:
                stored = self.ledger.stored_inputs()
                # joining a running job: the units and row counts the ledger holds, checked by stat (no input
                # opened); creating or resuming one: the source lists its units with their whole fingerprints
                if stored is not None and self._peers_alive():
                    layout = joined_layout(loader.dataset, stored)
                if layout is None:
                    layout = source_layout(loader.dataset)
            num_rows = len(loader.dataset) if layout is None else layout.num_rows
            shard_size = config.shard_size
            if shard_size is None:
                shape = self.ledger.job_shape()
                # a resumed or joining worker adopts the job's shard size unless told otherwise
                shard_size = shape[1] if shape is not None else 16 * int(loader.batch_size)
            if layout is None:
                self.ledger.ensure_job(num_rows, shard_size)
            else:
                self.ledger.ensure_job(num_rows, shard_size, layout.plan_shards(shard_size),
                                       inputs_to_check(stored, layout.units))
            self.ledger.register_worker(self.owner, socket.gethostname(), os.getpid())
            self.num_rows = num_rows
            self.in_flight = InFlightShards()
            self.clock = ProgressClock()
            self.stop = threading.Event()
            self.progress_text: Optional[str] = None
            self._last_progress_read = 0.0
            self.sampler = ShardBatchSampler(
                self.open_ledger, self.owner, int(loader.batch_size), config, self.in_flight, self._acknowledge, self.stop
            )
            self.dataloader = BackgroundLoader(sharded_dataloader(
                loader, self.sampler, config.id_column, config.row_retries, config.fetch_threads, layout,
                UnitRetry(config.unit_retries, config.unit_retry_backoff_s),
            ))
            self.fetch_threads_used: collections.Counter = collections.Counter()
            """Batches read with each number of fetch threads (0: the source read them without a thread pool)."""
            self.writer = ShardWriter(
                self.open_ledger,
                self.output_dir,
                config.format,
                self.owner,
                config.index_column,
                config.id_column,
                config.max_failed_rows,
                self.in_flight,
                self.clock,
                config.writer_queue_size,
            )
            self.heartbeat = Heartbeat(
                self.open_ledger,
                self.owner,
                config.lease_ttl_s,
                config.heartbeat_every_s,
                config.stall_timeout_s,
                self.clock,
                on_tick=self._read_progress,
                ledger_display=self.ledger.display_location,
            )
            self.writer.start()
            self.heartbeat.start()
        except BaseException:
            # a refused job (JobMismatchError), an unreachable ledger...: leave no connection or thread behind
            if self.writer is not None and self.writer.is_alive():
                self.writer.abort()
            self.ledger.close()
            raise
        self.manifest: Optional[dict] = None
        log.info("worker %s joined job %s (ledger %s)", self.owner, config.job, self.ledger.display_location)

    def _peers_alive(self) -> bool:
        """Whether another worker holds a lease that has not expired: this worker then joins a running job (else it
        resumes a stopped one, or starts one). Reads the leased shards only."""
        now = self.ledger.clock()
        return any(s.lease_expires is not None and s.lease_expires >= now for s in self.ledger.shards(states=(LEASED,)))

    def open_ledger(self) -> Ledger:
        return Ledger(self.config.ledger_location, self.config.job)

    def _acknowledge(self, ledger: Ledger, lease: Lease) -> bool:
        return acknowledge_existing(self.output_dir, self.config.format, self.owner, ledger, lease)

    def _read_progress(self, ledger: Ledger) -> None:
        now = ledger.clock()
        if now - self._last_progress_read < self.config.progress_interval_s:
            return
        self._last_progress_read = now
        self.progress_text = read_progress(ledger).summary()
        log.info("job %s: %s", self.config.job, self.progress_text)

    def note_batch(self, batch: Any) -> None:
        """Counts the fetch threads a batch of rows was read with."""
        if isinstance(batch, ElasticBatch) and not batch.ticket.idle:
            self.fetch_threads_used[batch.fetch_threads] += 1

    def on_batch_end(self, outputs: Any) -> None:
        """Hands one batch's predictions to the writer (blocking while its queue is full)."""
        # a heartbeat that stopped for good no longer renews this worker's leases: fail now, not after they expire
        self.heartbeat.check()
        if isinstance(outputs, StepOutcome):
            self.writer.submit(outputs)
        self.clock.touch()

    def finish(self) -> Optional[dict]:
        """Drains the writer; when the job is complete, writes its manifest and enforces the error budget."""
        self.writer.close()
        self.heartbeat.stop()
        if self.sampler.saw_done and self.config.finalize:
            self.manifest = finalize_job(
                self.output_dir,
                self.ledger,
                self.config.format,
                self.config.index_column,
                self.config.id_column,
                self.config.max_failed_rows,
            )
            failed = self.manifest["rows_failed"]
            if failed > self.config.max_failed_rows:
                raise ErrorBudgetExceededError(
                    error_budget_message(
                        failed,
                        self.config.max_failed_rows,
                        read_errors(self.output_dir),
                        self.output_dir,
                        self.config.index_column,
                    )
                )
        return self.manifest

    def abort(self) -> None:
        """Stops everything after an error and hands this worker's leases back at once."""
        self.stop.set()
        self.dataloader.close()
        self.writer.abort()
        self.heartbeat.stop()
        try:
            self.ledger.release(self.owner)
        except Exception as exc:  # the ledger may be the thing that failed; leases then just expire
            log.warning("could not release the leases of worker %s: %s", self.owner, exc)

    def close(self) -> None:
        self.dataloader.close()  # its thread runs the sampler, whose ledger connection closes next
        self.sampler.close()
        self.ledger.close()
