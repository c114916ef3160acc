"""Process groups are created once per layout and default group, and released with the default group."""

from __future__ import annotations

import gc
import socket
import threading

import pytest
import torch
import torch.distributed as dist

from lightning_paro.comm.collectives import Communicator
from lightning_paro.comm.topology import Topology


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(monkeypatch, port: int) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)


@pytest.mark.timeout(60)
def test_groups_are_shared_while_the_default_group_lives_and_released_with_it(monkeypatch):
    port = _free_port()
    before = threading.active_count()
    _init(monkeypatch, port)
    try:
        first, second = Communicator(Topology.from_process_group()), Communicator(Topology.from_process_group())
        assert first._groups is second._groups and first._worker is second._worker
        assert threading.active_count() == before + 1  # one communication thread for both
        x = torch.ones(3)
        second.all_reduce(x, "global")
        first.close()
        second.close()
        del first, second
    finally:
        dist.destroy_process_group()
    gc.collect()
    # The cached groups went with the default group: their threads stopped and the rendezvous port is free again.
    assert threading.active_count() == before
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))

    _init(monkeypatch, _free_port())  # a new default group starts with new groups that work
    try:
        comm = Communicator(Topology.from_process_group())
        x = torch.full((4,), 2.0)
        comm.all_reduce(x, "global")
        assert torch.equal(x, torch.full((4,), 2.0))
        comm.close()
    finally:
        dist.destroy_process_group()


_EXIT_SCRIPT = """
import atexit, os, threading
# Registered before the package's own exit handler, so it runs after it (atexit runs last-in first-out).
atexit.register(lambda: print("alive at exit:", sorted(t.name for t in threading.enumerate() if t.daemon)))
import torch, torch.distributed as dist
from lightning_paro.comm.collectives import Communicator
from lightning_paro.comm.topology import Topology
dist.init_process_group("gloo", rank=0, world_size=1)
comm = Communicator(Topology.from_process_group())
x = torch.ones(3)
comm.all_reduce(x, "global")
print("reduced", x.tolist())
"""


@pytest.mark.timeout(120)
def test_the_communication_thread_is_stopped_before_interpreter_exit(tmp_path):
    """A daemon thread still running when the interpreter finalizes can abort the process after its work is done
    (a forced unwind through torch's C++ frames); the package stops its threads at exit, before finalization."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], env=env, capture_output=True, text=True, timeout=100,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "reduced [1.0, 1.0, 1.0]" in proc.stdout
    alive = proc.stdout.split("alive at exit:")[1].strip()
    assert "paro-comm" not in alive, alive
