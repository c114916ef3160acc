"""The batch sampler that leases shards from the ledger and yields them batch by batch."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterator, Optional

from lightning_paro.predict.batch import BatchTicket, idle_ticket
from lightning_paro.predict.config import ElasticPredictConfig
from lightning_paro.predict.ledger import Lease, Ledger, LeaseWait

log = logging.getLogger(__name__)

# The longest pause between idle tickets while this worker's own shards are still in its pipeline (a commit of one
# of them ends the pause at once).
_IDLE_TICKET_PAUSE_S = 0.02


class InFlightShards:
    """Shards leased by this worker whose output is not committed yet (shared by sampler and writer)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._ids: set[int] = set()
        self._discarded = 0

    def add(self, shard_id: int) -> None:
        with self._changed:
            self._ids.add(shard_id)

    def discard(self, shard_id: int) -> None:
        with self._changed:
            self._ids.discard(shard_id)
            self._discarded += 1
            self._changed.notify_all()

    def __len__(self) -> int:
        with self._changed:
            return len(self._ids)

    def discards(self) -> int:
        """How many times a shard left the set so far (a mark for ``wait_for_discard``)."""
        with self._changed:
            return self._discarded

    def wait_for_discard(self, mark: int, timeout_s: float) -> bool:
        """Waits until a shard left the set after ``discards()`` returned ``mark``, at most ``timeout_s``; returns
        whether one did."""
        with self._changed:
            return self._changed.wait_for(lambda: self._discarded != mark, timeout_s)


def tickets_for_lease(lease: Lease, batch_size: int) -> Iterator[BatchTicket]:
    """The batches of one leased shard, the last one flagged so the writer knows the shard is complete."""
    for start in range(lease.start_row, lease.end_row, batch_size):
        end = min(start + batch_size, lease.end_row)
        yield BatchTicket(
            lease.shard_id, lease.start_row, lease.end_row, range(start, end), end == lease.end_row, lease.attempt
        )


class ShardBatchSampler:
    """Yields ``BatchTicket``s of leased shards until the ledger says the job is done.

    It runs where the DataLoader's sampler runs (the main process), so leasing never happens in
    DataLoader workers. While other workers still hold leases, it waits: with its own shards still
    in the pipeline it yields empty idle tickets so the model loop keeps turning and commits them
    (waiting silently there would deadlock), otherwise it sleeps ``poll_interval_s``.
    """

    def __init__(
        self,
        ledger_factory: Callable[[], Ledger],
        owner: str,
        batch_size: int,
        config: ElasticPredictConfig,
        in_flight: InFlightShards,
        acknowledge: Callable[[Ledger, Lease], bool],
        stop: threading.Event,
    ) -> None:
        self.ledger_factory = ledger_factory
        self.owner = owner
        self.batch_size = batch_size
        self.config = config
        self.in_flight = in_flight
        self.acknowledge = acknowledge
        self.stop = stop
        self.saw_done = False
        self.leases_taken = 0
        self._ledger: Optional[Ledger] = None

    def __iter__(self) -> Iterator[BatchTicket]:
        if self._ledger is None:
            self._ledger = self.ledger_factory()
        ledger = self._ledger
        cfg = self.config
        while not self.stop.is_set():
            idle = len(self.in_flight) == 0
            committed_mark = self.in_flight.discards()
            outcome = ledger.lease(
                self.owner,
                lease_ttl_s=cfg.lease_ttl_s,
                max_attempts=cfg.max_attempts,
                speculate_after_s=cfg.speculate_after_s if idle else None,
            )
            if isinstance(outcome, Lease):
                self.leases_taken += 1
                if outcome.speculative:
                    log.info("worker %s speculatively re-runs rows [%d, %d)", self.owner, outcome.start_row, outcome.end_row)
                if self.acknowledge(ledger, outcome):
                    continue
                self.in_flight.add(outcome.shard_id)
                yield from tickets_for_lease(outcome, self.batch_size)
                continue
            if outcome is LeaseWait.DONE:
                self.saw_done = True
                return
            if idle:
                time.sleep(cfg.poll_interval_s)
            elif not self.in_flight.wait_for_discard(committed_mark, _IDLE_TICKET_PAUSE_S):
                # this worker's own shards are still being predicted: an empty batch keeps its loop turning (the
                # DataLoader holds a batch until it has the next indices). A commit meanwhile asks the ledger again
                # at once, which at the job's end says it is done without one more idle batch
                yield idle_ticket()

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None
