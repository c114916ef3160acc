"""The background thread that renews this worker's leases while it makes progress, and hands on at once the leases
of a worker of the same machine whose process has ended."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from lightning_paro.predict.db import LedgerUnavailableError, redact_url
from lightning_paro.predict.ledger import Ledger

log = logging.getLogger(__name__)


class ProgressClock:
    """When this worker last finished a batch; a worker that stops finishing batches is hung."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def touch(self) -> None:
        self.last = time.monotonic()

    def idle_for(self) -> float:
        return time.monotonic() - self.last


class HeartbeatFailedError(LedgerUnavailableError):
    """The heartbeat thread stopped for good: this worker's leases are no longer renewed."""


class Heartbeat(threading.Thread):
    """Renews leases every ``interval_s``; stops renewing once no batch finished for ``stall_timeout_s``.

    Renewal alone would keep a hung worker's shards forever (its heartbeat thread is still alive);
    tying renewal to progress makes a hung worker lose its shards like a dead one.
    """

    def __init__(
        self,
        ledger_factory: Callable[[], Ledger],
        owner: str,
        lease_ttl_s: float,
        interval_s: float,
        stall_timeout_s: float,
        clock: ProgressClock,
        on_tick: Optional[Callable[[Ledger], None]] = None,
        ledger_display: str = "the prediction ledger",
    ) -> None:
        super().__init__(name=f"lightning-paro-heartbeat-{owner}", daemon=True)
        self.ledger_factory = ledger_factory
        self.owner = owner
        self.lease_ttl_s = lease_ttl_s
        self.interval_s = interval_s
        self.stall_timeout_s = stall_timeout_s
        self.clock = clock
        self.on_tick = on_tick
        self.stopped = threading.Event()
        self.stalled = False
        self.ledger_display = redact_url(ledger_display)
        self.error: Optional[BaseException] = None
        """The last error of the thread (a failed renewal is retried at the next tick)."""
        self.failure: Optional[HeartbeatFailedError] = None
        """Set when the thread ended without being stopped: the worker must stop too (``check``)."""

    def run(self) -> None:
        try:
            ledger = self.ledger_factory()
        except Exception as exc:
            self.error = exc
            detail = redact_url(f"{type(exc).__name__}: {exc}").strip()
            self.failure = HeartbeatFailedError(
                f"The heartbeat of worker {self.owner} could not open the ledger at {self.ledger_display} ({detail}), "
                "so this worker's leases would expire while it still works on them and other workers would redo its "
                "shards. Stopping this worker: its committed shards are kept, and rerunning it resumes the job once "
                "the ledger can be opened."
            )
            log.error("%s", self.failure)
            return
        try:
            while not self.stopped.wait(self.interval_s):
                try:
                    # a worker of this machine that died hands its shards on now, not when its leases expire
                    ledger.reclaim_dead_neighbours()
                except Exception as exc:  # the renewal below reports an unreachable ledger
                    self.error = exc
                if self.clock.idle_for() > self.stall_timeout_s:
                    if not self.stalled:
                        log.warning(
                            "worker %s finished no batch for %.0f s: no longer renewing its leases so other workers "
                            "take its shards",
                            self.owner,
                            self.clock.idle_for(),
                        )
                    self.stalled = True
                    continue
                self.stalled = False
                try:
                    ledger.renew(self.owner, self.lease_ttl_s)
                    if self.on_tick is not None:
                        self.on_tick(ledger)
                except Exception as exc:  # keep trying: the database may come back before the leases run out
                    self.error = exc
                    log.warning("worker %s could not renew its leases: %s", self.owner, exc)
        finally:
            ledger.close()

    def check(self) -> None:
        """Raises ``HeartbeatFailedError`` if the thread has ended for good (called by the worker at each batch)."""
        if self.failure is not None:
            raise self.failure

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=30)
