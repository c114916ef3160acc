"""The one supervisor of prediction processes (:class:`Supervisor`): it starts child processes, notices those that
ended, and stops the rest. Two things run on it: replicas (:func:`run_replicas`: several predictor processes per
device, each restarted on its own when it crashes) and the stage processes of a pipeline
(:class:`lightning_paro.predict.stages.StageGraph`, restarted together with their queues).
"""

from __future__ import annotations

import logging
import multiprocessing
import socket
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional, Sequence

from lightning_paro.predict.ledger import Ledger

log = logging.getLogger(__name__)


class Supervisor:
    """Child processes of this process, each under a key: started, reaped when they end, stopped."""

    def __init__(self, start_method: str, daemon: bool = False) -> None:
        self.ctx = multiprocessing.get_context(start_method)
        self.daemon = daemon
        self.running: dict = {}
        """``{key: process}`` of the processes started and not yet reaped."""

    def start(self, key: Hashable, target: Callable, args: tuple, name: str) -> None:
        proc = self.ctx.Process(target=target, args=args, name=name, daemon=self.daemon)
        proc.start()
        self.running[key] = proc

    def ended(self) -> list[tuple[Hashable, Optional[int]]]:
        """``(key, exit code)`` of the processes that ended since the last call; they are reaped and forgotten."""
        out = []
        for key, proc in list(self.running.items()):
            if not proc.is_alive():
                proc.join()
                del self.running[key]
                out.append((key, proc.exitcode))
        return out

    def stop(self, grace_s: float = 0.0, kill_wait_s: float = 30.0) -> list[Hashable]:
        """Waits up to ``grace_s`` for each process to end by itself, then kills it; returns the keys of those killed
        (stopped here rather than ended). Every process is forgotten afterwards."""
        killed = []
        for key, proc in self.running.items():
            proc.join(timeout=grace_s)
            if proc.is_alive():
                proc.kill()
                killed.append(key)
                proc.join(timeout=kill_wait_s)
        self.running = {}
        return killed


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
    supervisor = Supervisor(start_method)
    host = socket.gethostname()
    slots = [(slot, device) for slot, device in enumerate(d for d in devices for _ in range(replicas_per_device))]
    report = ReplicaReport(restarts={slot: 0 for slot, _ in slots})
    contexts: dict = {}

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
        contexts[slot] = context = ReplicaContext(slot, device, restart, f"{host}-replica{slot}-r{restart}")
        supervisor.start(slot, target, (context,), f"predict-replica-{slot}")

    for slot, device in slots:
        start(slot, device)
    try:
        while supervisor.running:
            time.sleep(poll_s)
            for slot, exitcode in supervisor.ended():
                context = contexts[slot]
                if exitcode == 0:
                    report.exit_codes[slot] = 0
                    continue
                log.warning("replica %d on %s exited with %s", slot, context.device, exitcode)
                hand_back(context.worker_name, died=True)
                if report.restarts[slot] >= max_restarts:
                    report.exit_codes[slot] = exitcode
                    raise ReplicaFailedError(
                        f"replica {slot} on {context.device} crashed {report.restarts[slot] + 1} times (last exit code "
                        f"{exitcode}); raise max_restarts or look at its log. Committed shards are kept: rerunning "
                        "resumes the job."
                    )
                report.restarts[slot] += 1
                start(slot, context.device)
    finally:
        for slot in supervisor.stop():
            try:
                hand_back(contexts[slot].worker_name, died=False)
            except Exception as exc:  # the ledger may be what failed: the leases then expire
                log.warning("could not hand back the leases of replica %d: %s", slot, exc)
    return report
