"""A collective that fails on one rank makes every surviving rank raise, in bounded time, and exit.

End to end (``workers/faults.py``): a real ``Trainer(strategy=PaROStrategy(sharding=..., group_size=2))`` fit on 4
CPU processes, broken on one rank at step 2 in each of the ways a job dies: a collective raises (a flat all-gather,
and a point-to-point send inside HO-Ring), the rank is killed with SIGKILL during backward, or the rank stops issuing
collectives. Every survivor must exit with a non-zero code, within a bound after the fault, with a
``CollectiveError`` that names the operation and scope in its output, and leave no process behind.

Unit level (one process): the communication thread's failure is sticky (queued work never runs, every later wait and
submit raises the first error), a collective that makes no progress is declared failed after the stall limit, and
``Unit.gather`` waits for each of its handles.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from launch import free_port, kill_all, start

from lightning_paro.comm import ho_ring
from lightning_paro.comm.collectives import CollectiveError, Communicator
from lightning_paro.comm.group_cache import default_timeout
from lightning_paro.comm.topology import Topology
from lightning_paro.strategy.units import Unit
from lightning_paro.strategy.distributed import default_process_group_backend

WORLD = 4
FAULT_STEP = 2
ERROR = re.compile(r"CollectiveError: PaRO (\S+) over scope '(intra|inter|global)' failed: (.*)")

# fault -> (sharding, faulting rank, strategy timeout in s, seconds survivors may take after the fault, what the
# faulting rank itself must report, None if it cannot report)
SCENARIOS = {
    "raise-flat": ("IIG", 1, 60, 30, r"PaRO all_gather over scope 'intra' failed: RuntimeError: injected fault"),
    "raise-send": ("GGG", 1, 60, 30, r"PaRO all_gather over scope 'global' failed: .*inter-gather phase.*injected"),
    "kill": ("NIG", 2, 60, 30, None),
    "hang": ("IGG", 3, 15, 15 + 30, None),
}


def _run(fault: str) -> tuple[dict[int, str], dict[int, float], dict[int, int], float, list[subprocess.Popen]]:
    """Launch the job with ``fault``; wait until every rank but a hung one has exited (or 150 s); kill the rest.

    Returns each rank's output, exit time (unix), exit code, the fault's time, and the processes.
    """
    sharding, fault_rank, timeout_s, _, _ = SCENARIOS[fault]
    procs = start("faults.py", WORLD, fault, sharding, str(fault_rank), str(FAULT_STEP), str(timeout_s))
    outputs: dict[int, str] = {}
    exited: dict[int, float] = {}
    deadline = time.monotonic() + 150
    expected = WORLD - (fault == "hang")
    try:
        while len(exited) < expected and time.monotonic() < deadline:
            for r, p in enumerate(procs):
                if r in exited or (fault == "hang" and r == fault_rank):
                    continue
                try:
                    outputs[r], _ = p.communicate(timeout=0.05)
                    exited[r] = time.time()
                except subprocess.TimeoutExpired:
                    pass
        for r, p in enumerate(procs):
            if r not in outputs:  # the hung rank, or a rank that did not exit in time (the test then fails)
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                outputs[r], _ = p.communicate(timeout=10)
    finally:
        kill_all(procs)
    codes = {r: p.returncode for r, p in enumerate(procs)}
    stamps = [float(m.group(1)) for out in outputs.values() for m in re.finditer(r"^FAULT (\S+)", out, re.M)]
    assert stamps, "no rank reported its fault:\n" + "\n".join(o[-2000:] for o in outputs.values())
    return outputs, exited, codes, min(stamps), procs


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", list(SCENARIOS))
def test_every_surviving_rank_raises_and_exits(fault):
    sharding, fault_rank, timeout_s, bound_s, own_error = SCENARIOS[fault]
    outputs, exited, codes, fault_at, procs = _run(fault)
    survivors = [r for r in range(WORLD) if r != fault_rank]
    for r in survivors:
        out = outputs[r]
        assert r in exited, f"rank {r} did not exit on its own:\n{out[-3000:]}"
        assert codes[r] > 0, f"rank {r} exited with {codes[r]}:\n{out[-3000:]}"
        assert "FIT FINISHED" not in out
        assert ERROR.search(out), f"rank {r} printed no error naming a PaRO operation and scope:\n{out[-3000:]}"
        took = exited[r] - fault_at
        assert took <= bound_s, f"rank {r} exited {took:.1f} s after the fault (bound {bound_s} s)"
        if fault == "hang":  # nothing broke a connection: only the timeout can have ended the wait
            assert took >= timeout_s - 1, f"rank {r} gave up {took:.1f} s after the fault, before the timeout"
    if own_error is not None:
        assert codes[fault_rank] > 0 and re.search(own_error, outputs[fault_rank]), outputs[fault_rank][-3000:]
    if fault == "kill":
        assert codes[fault_rank] == -signal.SIGKILL
    for p in procs:  # nothing left in any rank's process group (each rank is a session leader)
        with pytest.raises(ProcessLookupError):
            os.killpg(p.pid, 0)


# ---------------------------------------------------------------------------------------------- unit level
@pytest.fixture
def comm(world_of_one):
    return world_of_one


def _block(comm: Communicator) -> threading.Event:
    """Hold the communication thread until the returned event is set, so that work queues up behind it."""
    gate = threading.Event()
    comm.submit(lambda: gate.wait(30))
    return gate


@pytest.mark.timeout(60)
def test_a_failure_is_sticky_and_queued_work_never_runs(comm, monkeypatch):
    def broken_broadcast(*args, **kwargs):
        raise RuntimeError("connection lost")

    gate = _block(comm)
    monkeypatch.setattr(dist, "broadcast", broken_broadcast)
    ran = []
    failed = comm.broadcast(torch.zeros(3), async_op=True)
    after = [comm.submit(lambda: ran.append("queued"), what="gradient accumulation", scope="global"),
             comm.all_reduce(torch.ones(2), "global", async_op=True)]
    gate.set()
    with pytest.raises(CollectiveError, match=r"^PaRO broadcast over scope 'global' failed: RuntimeError: connection "
                                              r"lost$") as first:
        failed.wait()
    for handle in after:  # each handle raises the first failure, and its work never ran
        with pytest.raises(CollectiveError) as later:
            handle.wait()
        assert later.value is first.value
    assert ran == [] and comm.error is first.value
    started = time.monotonic()
    with pytest.raises(CollectiveError) as refused:  # later submits are refused at once
        comm.all_gather(torch.zeros(2), torch.zeros(2), "intra")
    assert refused.value is first.value and time.monotonic() - started < 1.0
    with pytest.raises(CollectiveError):
        comm.run(lambda: None, "strategy.barrier")


@pytest.mark.timeout(60)
def test_a_collective_that_never_finishes_fails_after_the_stall_limit(comm):
    gate = threading.Event()
    comm._worker.stall_limit = 0.5  # the backend's own timeout would end a real collective first
    stuck = comm.submit(lambda: gate.wait(30), what="all_gather", scope="global")
    queued = comm.submit(lambda: None)
    started = time.monotonic()
    with pytest.raises(CollectiveError, match=r"PaRO all_gather over scope 'global' failed: no progress for"):
        stuck.wait()
    assert 0.4 < time.monotonic() - started < 5
    with pytest.raises(CollectiveError):
        queued.wait()
    with pytest.raises(CollectiveError):
        comm.broadcast(torch.zeros(1))
    gate.set()


@pytest.mark.timeout(30)
def test_ho_ring_wait_gives_up_on_a_stalled_collective():
    work = ho_ring.HORingWork(stall_limit=0.3)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="HO-Ring collective failed: TimeoutError: no chunk finished a phase"):
        work.wait()
    assert time.monotonic() - started < 3


class _Handle:
    def __init__(self, error: Exception | None) -> None:
        self.error, self.waited = error, False

    def wait(self) -> None:
        self.waited = True
        if self.error is not None:
            raise self.error


class _Flat:
    def __init__(self, handle: _Handle) -> None:
        self.handle, self.gathered = handle, False

    def gather_params(self, async_op: bool) -> _Handle:
        self.gathered = True
        return self.handle


def test_unit_gather_waits_for_each_handle():
    """The first of two gathers failed while the last succeeded: the unit must raise, not trust the last one."""
    first, last = _Handle(CollectiveError("all_gather", "intra", "peer gone")), _Handle(None)
    unit = Unit("block", torch.nn.Linear(1, 1), [_Flat(first), _Flat(last)])
    with pytest.raises(CollectiveError, match="peer gone"):
        unit.gather(async_op=False)
    assert first.waited


def test_default_backend_carries_cpu_tensors_beside_the_device_backend():
    assert default_process_group_backend(torch.device("cpu")) == "gloo"
    assert default_process_group_backend(torch.device("cuda", 1)) == "cuda:nccl,cpu:gloo"


@pytest.mark.timeout(60)
def test_groups_take_the_default_groups_timeout(monkeypatch):
    """The package's groups wait as long as init_process_group(timeout=...) says, not torch's default for new groups
    (30 minutes): read back through a private torch API, which this guards."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=17))
    try:
        assert default_timeout() == timedelta(seconds=17)
        topo = Topology.from_process_group()
        cpu = torch.device("cpu")
        assert topo.groups.world._get_backend(cpu).options._timeout == timedelta(seconds=17)
        groups = ho_ring.create_groups(topo)
        assert groups.timeout == 17 and groups.world._get_backend(cpu).options._timeout == timedelta(seconds=17)
        groups.close()
        assert Communicator(topo)._worker.timeout_s == 17
    finally:
        dist.destroy_process_group()
