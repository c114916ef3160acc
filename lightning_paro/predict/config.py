"""Settings of an elastic prediction job."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from lightning_paro.predict.shard_files import FORMATS

LEDGER_FILE_NAME = "_ledger.sqlite"


@dataclass(frozen=True)
class ElasticPredictConfig:
    """Everything that decides how one worker takes part in a prediction job."""

    output_dir: str
    """Directory that receives the shard files, the errors, the manifest and the success marker."""
    ledger: Optional[str] = None
    """SQLite file path or ``postgresql://`` URL of the shard ledger; default: ``_ledger.sqlite`` in output_dir."""
    job_name: Optional[str] = None
    """Name of the job inside the ledger; default: the output directory's absolute path."""
    shard_size: Optional[int] = None
    """Rows per shard (the unit of leasing, retry and commit); default: 16 batches."""
    format: str = "parquet"
    """Output file format: ``"parquet"`` or ``"jsonl"``."""
    index_column: str = "row_id"
    """Name of the column holding each row's dataset index (always written)."""
    id_column: Optional[str] = None
    """Key of a per-sample id in the dataset's samples (dict samples) to copy into the output."""
    lease_ttl_s: float = 10.0
    """Seconds a lease lives without a heartbeat (on the ledger database's clock); a dead or hung worker's shards
    move after this (a dead worker's on the same machine at once)."""
    heartbeat_interval_s: Optional[float] = None
    """Seconds between lease renewals; default: a quarter of lease_ttl_s."""
    stall_timeout_s: float = 600.0
    """Stop renewing leases when no batch finished for this long, so a hung worker loses its shards."""
    max_attempts: int = 3
    """Leases of one shard that may end without a commit before it is split (rows that kill workers)."""
    speculate_after_s: Optional[float] = 60.0
    """An idle worker duplicates a shard leased longer ago than this (tail stragglers); None disables."""
    poll_interval_s: float = 0.5
    """Seconds an idle worker waits between asking the ledger for work."""
    fetch_threads: Optional[int] = None
    """Rows of a batch read concurrently (threads per DataLoader worker). None (the default): each DataLoader worker
    chooses as it reads, doubling its threads while that reads batches faster (latency-bound storage) and keeping
    one thread when it does not (rows bound by CPU); see ``FetchTuner``. A number fixes it."""
    row_retries: int = 1
    """Retries of a failing row (dataset) or batch (predict_step) before it is bisected and reported."""
    unit_retries: int = 2
    """Retries of a source unit (a file, a row group, an object) that cannot be opened or read, before its rows fail
    together with the cause."""
    unit_retry_backoff_s: float = 0.5
    """Seconds before a unit's first retry; each next one waits twice as long."""
    max_failed_rows: int = 0
    """Error budget: the job fails once more rows than this were isolated as poison."""
    writer_queue_size: int = 8
    """Batches that may wait for the background writer before predict_step blocks (backpressure)."""
    progress_interval_s: float = 10.0
    """Seconds between global progress reads from the ledger (shown on the progress bar, logged)."""
    finalize: bool = True
    """Write the manifest and success marker when this worker sees the job complete."""
    worker_name: Optional[str] = None
    """Name of this worker in the ledger; default: host, process id and a random suffix."""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {self.format!r}")
        if self.shard_size is not None and self.shard_size <= 0:
            raise ValueError(f"shard_size must be positive, got {self.shard_size}")
        if self.lease_ttl_s <= 0 or self.max_attempts < 1 or self.max_failed_rows < 0 or self.row_retries < 0:
            raise ValueError("lease_ttl_s > 0, max_attempts >= 1, row_retries >= 0 and max_failed_rows >= 0 are required")
        if self.fetch_threads is not None and (isinstance(self.fetch_threads, bool) or self.fetch_threads < 1):
            raise ValueError(f"fetch_threads must be None (chosen automatically) or at least 1, got {self.fetch_threads!r}")
        if self.unit_retries < 0 or self.unit_retry_backoff_s < 0:
            raise ValueError(f"unit_retries and unit_retry_backoff_s must be >= 0, got {self.unit_retries} and "
                             f"{self.unit_retry_backoff_s}")
        if self.writer_queue_size < 1:
            raise ValueError("writer_queue_size must be at least 1")

    @property
    def output_path(self) -> Path:
        return Path(self.output_dir)

    @property
    def ledger_location(self) -> str:
        return self.ledger or str(self.output_path / LEDGER_FILE_NAME)

    @property
    def job(self) -> str:
        return self.job_name or os.path.abspath(self.output_dir)

    @property
    def heartbeat_every_s(self) -> float:
        return self.heartbeat_interval_s or self.lease_ttl_s / 4
