"""How long a killed worker's shard waits before another worker leases it again.

A worker process leases a shard and renews it with the worker's heartbeat thread (``ElasticPredictConfig``'s
default lease and heartbeat); a second worker, registered on this machine, has committed every other shard and asks
the ledger for work every ``poll_interval_s``, as an idle worker does. The first worker is killed with SIGKILL at a
random point of its heartbeat cycle, and the time from the kill to the shard's next lease is measured. "Same host":
the killed worker registered as it does in a job (its host, boot id, pid namespace and pid). "Another host": its
entry in the ledger names another host and boot id, so its process cannot be looked up and only its heartbeats count.

    OMP_NUM_THREADS=1 python bench/predict/recovery.py [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lightning_paro.predict.config import ElasticPredictConfig
from lightning_paro.predict.heartbeat import Heartbeat, ProgressClock
from lightning_paro.predict.ledger import Lease, Ledger

JOB = "recovery"
_FORK = multiprocessing.get_context("fork")


def _victim(location: str, config: ElasticPredictConfig, ready) -> None:
    ledger = Ledger(location, JOB)
    ledger.register_worker("victim", socket.gethostname(), os.getpid())
    lease = ledger.lease("victim", config.lease_ttl_s, config.max_attempts)
    assert isinstance(lease, Lease)
    beat = Heartbeat(lambda: Ledger(location, JOB), "victim", config.lease_ttl_s, config.heartbeat_every_s,
                     config.stall_timeout_s, ProgressClock())
    beat.start()
    ready.send(lease.shard_id)
    while True:
        beat.clock.touch()  # busy predicting: never stalled
        time.sleep(0.05)


def _as_another_host(ledger: Ledger) -> None:
    with ledger.db.transaction(JOB) as tx:
        tx.execute("UPDATE paro_predict_workers SET host = 'another-host' WHERE job = $1 AND owner = 'victim'", (JOB,))
        has_processes = tx.fetchone(
            "SELECT 1 FROM sqlite_master WHERE name = 'paro_predict_processes'") is not None
        if has_processes:  # a ledger that records processes: another boot id, so the pid means nothing here
            tx.execute("UPDATE paro_predict_processes SET process_space = 'another-boot-id/pid:[1]' "
                       "WHERE job = $1 AND owner = 'victim'", (JOB,))


def measure_once(case: str, config: ElasticPredictConfig, rng: random.Random) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        location = str(Path(tmp) / "ledger.sqlite")
        survivor = Ledger(location, JOB)
        survivor.ensure_job(4, 1)
        survivor.register_worker("survivor", socket.gethostname(), os.getpid())
        receive, send = _FORK.Pipe(duplex=False)
        proc = _FORK.Process(target=_victim, args=(location, config, send), daemon=True)
        proc.start()
        try:
            victim_shard = receive.recv()
            if case == "another host":
                _as_another_host(survivor)
            for _ in range(3):  # the survivor does every other shard: only the victim's is left
                lease = survivor.lease("survivor", config.lease_ttl_s, config.max_attempts)
                survivor.commit(lease.shard_id, "survivor", 1, 0, "f")
            beat = Heartbeat(lambda: Ledger(location, JOB), "survivor", config.lease_ttl_s, config.heartbeat_every_s,
                             config.stall_timeout_s, ProgressClock())
            beat.start()
            time.sleep(config.heartbeat_every_s + rng.uniform(0, config.heartbeat_every_s))
            os.kill(proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            while True:  # the idle worker's loop (ShardBatchSampler)
                lease = survivor.lease("survivor", config.lease_ttl_s, config.max_attempts)
                if isinstance(lease, Lease):
                    assert lease.shard_id == victim_shard
                    waited = time.monotonic() - killed
                    break
                beat.clock.touch()
                time.sleep(config.poll_interval_s)
            beat.stop()
        finally:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=30)
            survivor.close()
    return waited


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    config = ElasticPredictConfig(output_dir="unused")
    rng = random.Random(0)
    results = {"lease_ttl_s": config.lease_ttl_s, "heartbeat_s": config.heartbeat_every_s,
               "poll_interval_s": config.poll_interval_s, "cases": {}}
    for case in ("same host", "another host"):
        waits = [measure_once(case, config, rng) for _ in range(args.repeats)]
        results["cases"][case] = waits
        print(f"{case}: kill -9 to re-lease {statistics.median(waits):.2f} s median "
              f"({', '.join(f'{w:.2f}' for w in waits)}); lease {config.lease_ttl_s:g} s, "
              f"heartbeat {config.heartbeat_every_s:g} s, poll {config.poll_interval_s:g} s", flush=True)
    if args.json:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from provenance import stamp

        results["provenance"] = stamp()
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
