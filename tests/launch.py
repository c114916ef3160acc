"""Run a worker script as N processes on this machine, the way a cluster launcher would, and clean up."""

from __future__ import annotations

import atexit
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

WORKERS = Path(__file__).parent / "workers"
ZYGOTE = Path(__file__).parent / "zygote.py"


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
          output: int = subprocess.PIPE, fresh: bool = False) -> list:
    """Start the processes of :func:`launch` without waiting for them: forked from the session's zygote (torch,
    Lightning and the package already imported: ``zygote.py``), or, with ``fresh`` (or the environment variable
    ``PARO_TEST_FRESH_WORKERS=1`` for all), each a new interpreter."""
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
            if fresh or os.environ.get("PARO_TEST_FRESH_WORKERS"):
                procs.append(subprocess.Popen([sys.executable, str(WORKERS / script), *args], env=env,
                                              stdout=output, stderr=subprocess.STDOUT, text=True,
                                              start_new_session=True))
            else:
                procs.append(_zygote().start(str(WORKERS / script), args, env, keep_output=output != subprocess.DEVNULL))
    return procs


class ForkedWorker:
    """A worker forked by ``zygote.py``, with the part of ``subprocess.Popen``'s interface the tests use (``pid``,
    ``poll``, ``wait``, ``communicate``, ``returncode``, ``kill``). Its output goes to a file, read when it ends."""

    def __init__(self, pid: int, out: str, status: str, keep_output: bool) -> None:
        self.pid, self._out, self._status, self._keep_output = pid, out, status, keep_output
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and os.path.exists(self._status):
            with open(self._status) as f:
                self.returncode = int(f.read())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self._out), timeout)
            time.sleep(0.02)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str | None, None]:
        self.wait(timeout)
        if not self._keep_output:
            return None, None
        with open(self._out, errors="replace") as f:
            return f.read(), None

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class _Zygote:
    """The session's ``zygote.py`` process (started on first use, ended with this process)."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="paro-test-workers-")
        self.proc = subprocess.Popen([sys.executable, str(ZYGOTE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        ready = json.loads(self.proc.stdout.readline() or "{}")
        if "ready" not in ready:
            raise RuntimeError("the test worker zygote did not start (run with PARO_TEST_FRESH_WORKERS=1 to bypass)")
        self.lock = threading.Lock()
        self.count = itertools.count()
        atexit.register(self.close)

    def start(self, script: str, args, env: dict, keep_output: bool) -> ForkedWorker:
        with self.lock:
            n = next(self.count)
            out, status = os.path.join(self.folder, f"{n}.out"), os.path.join(self.folder, f"{n}.status")
            self.proc.stdin.write(json.dumps({"script": script, "args": list(args), "env": env, "out": out,
                                              "status": status}) + "\n")
            self.proc.stdin.flush()
            pid = json.loads(self.proc.stdout.readline())["pid"]
        return ForkedWorker(pid, out, status, keep_output)

    def close(self) -> None:
        import shutil

        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


_ZYGOTE: _Zygote | None = None


def _zygote() -> _Zygote:
    global _ZYGOTE
    if _ZYGOTE is None or _ZYGOTE.proc.poll() is not None:
        _ZYGOTE = _Zygote()
    return _ZYGOTE


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
