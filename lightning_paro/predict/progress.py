"""One view of a job's progress across all its workers, computed from the ledger."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Optional

from lightning_paro.predict.ledger import COMMITTED, LEASED, POISONED, SPLIT, Ledger


@dataclass(frozen=True)
class JobProgress:
    """Rows and shards done, speed and ETA of a whole job."""

    total_rows: int
    """Rows in the dataset."""
    done_rows: int
    """Rows of committed or poisoned shards."""
    failed_rows: int
    """Rows isolated as poison (errors files)."""
    total_shards: int
    """Current shards (split shards count as their halves)."""
    committed_shards: int
    """Shards whose output is committed."""
    leased_shards: int
    """Shards currently leased to some worker (live or expired lease)."""
    poisoned_shards: int
    """Single-row shards given up after repeated worker deaths."""
    retries: int
    """Leases beyond the first, over all shards (redos after crashes, hangs and expiries)."""
    active_workers: int
    """Workers holding a live lease right now (those presumed dead left out)."""
    rows_per_s: Optional[float]
    """Committed rows per second over the recent window, None before there is enough to measure."""
    eta_s: Optional[float]
    """Seconds to completion at that speed; shards waiting on a dead worker count from when they come free."""
    waiting_shards: int = 0
    """Leased shards whose worker stopped renewing (dead or hung): nobody works on them until their lease expires."""
    waiting_rows: int = 0
    """Rows of those shards."""
    waiting_free_in_s: Optional[float] = None
    """Seconds until the last of those shards can be leased again (0 once all their leases expired)."""

    @property
    def fraction(self) -> float:
        return self.done_rows / self.total_rows if self.total_rows else 1.0

    @property
    def complete(self) -> bool:
        return self.committed_shards + self.poisoned_shards == self.total_shards

    def as_dict(self) -> dict:
        return asdict(self) | {"fraction": self.fraction, "complete": self.complete}

    def summary(self) -> str:
        speed = f"{self.rows_per_s:,.1f} rows/s" if self.rows_per_s is not None else "- rows/s"
        eta = _duration(self.eta_s) if self.eta_s is not None else "-"
        return (
            f"{self.done_rows:,}/{self.total_rows:,} rows ({100 * self.fraction:.1f}%), {speed}, ETA {eta}, "
            f"shards {self.committed_shards}/{self.total_shards} committed, {self.leased_shards} leased, "
            f"{self.active_workers} workers, {self.retries} retries, {self.failed_rows} failed rows"
            + (f", {self.waiting_shards} shard{'s' if self.waiting_shards > 1 else ''} waiting on dead workers "
               f"(free in {_duration(self.waiting_free_in_s)})" if self.waiting_shards else "")
        )


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def read_progress(ledger: Ledger, now: Optional[float] = None, window_s: float = 60.0) -> JobProgress:
    """The job's progress; speed is measured over the last ``window_s`` seconds of commits.

    ``now`` is a time on the database's clock (``Ledger.now``, the default), like every time in the ledger. A leased
    shard waits on a dead worker once its worker has been silent for longer than its lease has left (its lease ran
    out, or is past half its length since the last renewal: a live worker renews at least every quarter of it by
    default); the ETA then counts that shard from when its lease runs out, redone by one worker.
    """
    now = ledger.now() if now is None else now
    shape = ledger.job_shape()
    total_rows = shape[0] if shape else 0
    all_shards = ledger.shards()
    retries = sum(max(s.attempts - 1, 0) for s in all_shards) + sum(1 for s in all_shards if s.state == SPLIT)
    shards = [s for s in all_shards if s.state != SPLIT]
    committed = [s for s in shards if s.state == COMMITTED]
    poisoned = [s for s in shards if s.state == POISONED]
    leased = [s for s in shards if s.state == LEASED]
    done_rows = sum(s.num_rows for s in committed) + sum(s.num_rows for s in poisoned)
    failed_rows = sum(s.rows_failed or 0 for s in committed) + sum(s.num_rows for s in poisoned)
    last_seen = {owner: seen for owner, _, _, _, seen in ledger.workers()}
    waiting = [s for s in leased if _silent_for(s, last_seen, now) > (s.lease_expires or now) - now]
    waiting_ids = {s.shard_id for s in waiting}
    active = {s.owner for s in leased
              if s.shard_id not in waiting_ids and s.lease_expires is not None and s.lease_expires >= now}
    free_in = max((max(0.0, (s.lease_expires or now) - now) for s in waiting), default=None)

    recent = [s for s in committed if s.committed_at is not None and s.committed_at >= now - window_s]
    rate = None
    if recent:
        first = min(s.committed_at for s in committed if s.committed_at is not None)
        span = min(window_s, now - first) if first < now - window_s else now - first
        # the first commit of a run has no measured start: count it only once a second commit bounds the span
        if first >= now - window_s:
            recent = [s for s in recent if s.committed_at > first]
        if span > 0 and recent:
            rate = sum(s.num_rows for s in recent) / span
    remaining = total_rows - done_rows
    eta = remaining / rate if rate else (0.0 if remaining == 0 else None)
    if eta is not None and rate and waiting:
        # the job cannot end before the largest waiting shard comes free and one worker redoes it
        per_worker = rate / max(len(active), 1)
        eta = max(eta, free_in + max(s.num_rows for s in waiting) / per_worker)
    return JobProgress(
        total_rows=total_rows,
        done_rows=done_rows,
        failed_rows=failed_rows,
        total_shards=len(shards),
        committed_shards=len(committed),
        leased_shards=len(leased),
        poisoned_shards=len(poisoned),
        retries=retries,
        active_workers=len(active),
        rows_per_s=rate,
        eta_s=eta,
        waiting_shards=len(waiting),
        waiting_rows=sum(s.num_rows for s in waiting),
        waiting_free_in_s=free_in,
    )


def _silent_for(shard, last_seen: dict, now: float) -> float:
    """Seconds since the shard's worker last renewed it (or leased it, if later)."""
    renewed = max(t for t in (last_seen.get(shard.owner), shard.leased_at, -math.inf) if t is not None)
    return now - renewed


def wait_for_completion(ledger: Ledger, timeout_s: float, poll_s: float = 0.2) -> JobProgress:
    """Polls until every shard is committed or poisoned; raises TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        progress = read_progress(ledger)
        if progress.complete:
            return progress
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {ledger.job!r} not complete after {timeout_s} s: {progress.summary()}")
        time.sleep(poll_s)
