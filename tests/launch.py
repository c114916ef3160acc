"""Run a worker script as N processes on this machine, the way a cluster launcher would, and clean up."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

WORKERS = Path(__file__).parent / "workers"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, nprocs: int, *args: str, timeout: float = 240, nodes: int = 1,
           extra_env: dict | None = None) -> list[str]:
    """Start ``nprocs`` processes per node (``nodes`` nodes) of ``workers/script`` with the torch.distributed
    environment set (like torchrun), wait for all, and return their outputs. Kills every process on failure."""
    return wait_all(start(script, nprocs, *args, nodes=nodes, extra_env=extra_env), timeout)


def start(script: str, nprocs: int, *args: str, nodes: int = 1, extra_env: dict | None = None,
          output: int = subprocess.PIPE) -> list[subprocess.Popen]:
    """Start the processes of :func:`launch` without waiting for them."""
    port = free_port()
    procs = []
    world = nprocs * nodes
    for node in range(nodes):
        for local in range(nprocs):
            env = dict(os.environ)
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                       RANK=str(node * nprocs + local), LOCAL_RANK=str(local), NODE_RANK=str(node),
                       LOCAL_WORLD_SIZE=str(nprocs), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            env.update(extra_env or {})
            procs.append(subprocess.Popen([sys.executable, str(WORKERS / script), *args], env=env,
                                          stdout=output, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    outputs: list[str] = []
    try:
        for p in procs:
            left = max(1.0, deadline - time.monotonic())
            out, _ = p.communicate(timeout=left)
            outputs.append(out)
            if p.returncode != 0:
                raise RuntimeError(f"worker exited with {p.returncode}:\n{out[-6000:]}")
    except BaseException:
        kill_all(procs)
        raise
    return outputs


def kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.communicate(timeout=10)
        except Exception:
            pass
