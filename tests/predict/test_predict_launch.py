"""Workers launched by torchrun (elastic, with restarts) and by the replica supervisor."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_paro.predict import ReplicaContext, ReplicaFailedError, run_replicas
from lightning_paro.predict.config import LEDGER_FILE_NAME
from lightning_paro.predict.ledger import COMMITTED, Ledger
from lightning_paro.predict.supervisor import Supervisor
from predict_app import JobSpec, run_job
from predict_procs import assert_exact_output

APP = Path(__file__).with_name("predict_app.py")


def _isolated_network_prefix() -> list[str]:
    """torchrun's rendezvous store listens on all interfaces: run it in a private network namespace."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs unshare and ip to confine torchrun's rendezvous listener")
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {probe.stderr.decode().strip()}")
    return ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]


@pytest.mark.timeout(300)
def test_torchrun_elastic_workers_with_a_crash_and_restart(tmp_path):
    out = tmp_path / "out"
    torchrun = Path(sys.executable).with_name("torchrun")
    command = _isolated_network_prefix() + [
        str(torchrun), "--nnodes=1:2", "--nproc_per_node=2", "--max-restarts=2", "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0", "--rdzv-conf=last_call_timeout=1", "--monitor-interval=0.2",
        str(APP), str(out), "600", "1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=280, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # rank 1 killed itself in the first attempt; torchrun restarted the group, whose workers joined the job
    # (whatever was left of it) and exited cleanly
    assert "exitcode: -9" in proc.stderr
    assert "worker rank0-try1 committed=" in proc.stdout and "worker rank1-try1 committed=" in proc.stdout, (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )
    committed_by = {s.committed_by for s in Ledger(str(out / LEDGER_FILE_NAME), str(out.resolve())).shards((COMMITTED,))}
    assert "rank1-try0" in committed_by
    assert_exact_output(out, 600)


def replica_target(context: ReplicaContext) -> None:
    """Slot 0's first incarnation dies right after publishing its second shard, before committing it;
    slot 1 starts only once that happened, so it cannot finish the job first and skip the crash."""
    out = os.environ["PREDICT_REPLICA_TEST_OUT"]
    died = out + ".slot0-died"
    spec = JobSpec(output_dir=out, rows=500, shard_size=25, step_sleep_s=0.005, lease_ttl_s=30.0,
                   worker_name=context.worker_name)
    if context.slot == 0 and context.restart == 0:
        spec.crash_after_publishes, spec.crash_marker = 2, died
    elif context.slot == 1:
        spec.start_barrier = (out + ".slot1-ready", (died,))
    run_job(spec)


@pytest.mark.timeout(90)
def test_replicas_per_device_restart_a_crashed_replica(tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setenv("PREDICT_REPLICA_TEST_OUT", str(out))
    report = run_replicas(
        replica_target, replicas_per_device=2, devices=("cpu",), max_restarts=2,
        ledger=str(out / LEDGER_FILE_NAME), job=str(out.resolve()), start_method="fork",
    )
    assert report.restarts == {0: 1, 1: 0}
    assert report.exit_codes == {0: 0, 1: 0}
    # the lease of the dead replica was released at once, not after its 30 s expiry
    assert_exact_output(out, 500)


def always_crash(context: ReplicaContext) -> None:
    os._exit(3)


@pytest.mark.timeout(60)
def test_replica_crashing_past_its_budget_is_a_clear_error():
    with pytest.raises(ReplicaFailedError, match="crashed 2 times .*exit code 3"):
        run_replicas(always_crash, replicas_per_device=1, max_restarts=1, start_method="fork")


def _exit_with(code: int) -> None:
    os._exit(code)


def _sleep_long() -> None:
    time.sleep(600)


@pytest.mark.timeout(60)
def test_the_supervisor_reaps_ended_processes_and_kills_the_rest():
    supervisor = Supervisor("fork")
    supervisor.start("crash", _exit_with, (3,), "crash")
    supervisor.start("clean", _exit_with, (0,), "clean")
    supervisor.start("hang", _sleep_long, (), "hang")
    ended: list = []
    for _ in range(300):
        ended += supervisor.ended()
        if len(ended) == 2:
            break
        time.sleep(0.05)
    assert sorted(ended) == [("clean", 0), ("crash", 3)] and list(supervisor.running) == ["hang"]
    hang = supervisor.running["hang"]
    assert supervisor.stop(grace_s=0.1, kill_wait_s=10) == ["hang"]
    assert not hang.is_alive() and hang.exitcode == -9 and supervisor.running == {}
