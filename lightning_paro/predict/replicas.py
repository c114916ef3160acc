"""Several predictor processes per device, each restarted when it crashes (the predictor scheduler)."""

from __future__ import annotations

import logging
import multiprocessing
import socket
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from lightning_paro.predict.ledger import Ledger

log = logging.getLogger(__name__)


class ReplicaFailedError(RuntimeError):
    """A replica kept crashing past its restart budget."""


@dataclass(frozen=True)
class ReplicaContext:
    """What one replica process is told about itself."""

    slot: int
    """Index of the replica over all devices (stable across restarts)."""
    device: str
    """The device this replica should use, e.g. ``"cpu"`` or ``"cuda:1"``."""
    restart: int
    """0 for the first start of this slot, then 1, 2, ... after crashes."""
    worker_name: str
    """A unique ledger worker name for this incarnation (pass it to ``ElasticPredict(worker_name=...)``)."""


@dataclass
class ReplicaReport:
    """How the replicas ended."""

    exit_codes: dict = field(default_factory=dict)
    """Final exit code of each slot."""
    restarts: dict = field(default_factory=dict)
    """Restarts of each slot."""


def _replica_entry(target: Callable[[ReplicaContext], None], context: ReplicaContext) -> None:
    target(context)


def run_replicas(
    target: Callable[[ReplicaContext], None],
    replicas_per_device: int = 2,
    devices: Sequence[str] = ("cpu",),
    max_restarts: int = 3,
    ledger: Optional[str] = None,
    job: Optional[str] = None,
    start_method: str = "spawn",
    poll_s: float = 0.1,
) -> ReplicaReport:
    """Runs ``target(context)`` in ``replicas_per_device`` processes per device until each exits cleanly.

    ``target`` builds its Trainer with ``ElasticPredict(worker_name=context.worker_name, ...)`` and calls
    ``trainer.predict``; all replicas share the job's ledger, so they split the shards between them.
    A replica that dies is started again (up to ``max_restarts`` times per slot). With ``ledger`` and
    ``job`` given, the dead replica's leases are reclaimed at once (each counts as an attempt: it died), so its
    shard is re-leased without waiting for the lease to expire; replicas this supervisor stops itself (when it
    fails or is interrupted) hand their leases back gracefully, not counted as attempts.
    """
    if replicas_per_device < 1 or not devices:
        raise ValueError("replicas_per_device must be >= 1 and devices non-empty")
    ctx = multiprocessing.get_context(start_method)
    host = socket.gethostname()
    slots = [(slot, device) for slot, device in enumerate(d for d in devices for _ in range(replicas_per_device))]
    report = ReplicaReport(restarts={slot: 0 for slot, _ in slots})
    running: dict = {}

    def hand_back(worker_name: str, died: bool) -> None:
        if ledger is None or job is None:
            return
        handle = Ledger(ledger, job)
        try:
            if died:
                handle.reclaim(worker_name)
            else:
                handle.release(worker_name)
        finally:
            handle.close()

    def start(slot: int, device: str) -> None:
        restart = report.restarts[slot]
        context = ReplicaContext(slot, device, restart, f"{host}-replica{slot}-r{restart}")
        proc = ctx.Process(target=_replica_entry, args=(target, context), name=f"predict-replica-{slot}")
        proc.start()
        running[slot] = (proc, context)

    for slot, device in slots:
        start(slot, device)
    try:
        while running:
            time.sleep(poll_s)
            for slot, (proc, context) in list(running.items()):
                if proc.is_alive():
                    continue
                proc.join()
                del running[slot]
                if proc.exitcode == 0:
                    report.exit_codes[slot] = 0
                    continue
                log.warning("replica %d on %s exited with %s", slot, context.device, proc.exitcode)
                hand_back(context.worker_name, died=True)
                if report.restarts[slot] >= max_restarts:
                    report.exit_codes[slot] = proc.exitcode
                    raise ReplicaFailedError(
                        f"replica {slot} on {context.device} crashed {report.restarts[slot] + 1} times (last exit code "
                        f"{proc.exitcode}); raise max_restarts or look at its log. Committed shards are kept: rerunning "
                        "resumes the job."
                    )
                report.restarts[slot] += 1
                start(slot, context.device)
    finally:
        for proc, context in running.values():
            stopped_here = proc.is_alive()
            if stopped_here:
                proc.kill()
            proc.join(timeout=30)
            if stopped_here:
                try:
                    hand_back(context.worker_name, died=False)
                except Exception as exc:  # the ledger may be what failed: the leases then expire
                    log.warning("could not hand back the leases of replica %d: %s", context.slot, exc)
    return report
