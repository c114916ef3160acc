"""A process that has imported torch, Lightning and the package once, and forks each test worker from there.

Importing them costs about 4 CPU seconds per process; the multi-process tests start a few hundred worker processes,
which on 2 cores is minutes of the suite. A worker forked from here starts with those modules loaded and then runs
its script exactly as ``python SCRIPT ARGS`` would: its own session (``setsid``), its environment, ``sys.argv``,
``sys.path[0]`` the script's folder, the script run as ``__main__``, and a normal interpreter exit (atexit handlers,
non-daemon threads joined); an uncaught exception prints its traceback and exits with 1.

Forking is safe here because this process runs no thread and has touched no device, process group or OpenMP pool:
it only imports, then waits on its control pipe.

Protocol (one JSON line each way): the test process writes ``{"script", "args", "env", "out", "status"}``; this
process forks, answers ``{"pid"}``, and when the worker ends writes its exit status (as ``Popen.returncode``: the
code, or minus the signal) to the ``status`` file (written whole, then renamed). ``launch.py`` wraps this as a
``Popen``-like handle.
"""

from __future__ import annotations

import json
import os
import runpy
import select
import sys


def _preload() -> None:
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import lightning.pytorch  # noqa: F401

    import lightning_paro  # noqa: F401


def _write_status(path: str, status: int) -> None:
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    with open(path + ".tmp", "w") as f:
        f.write(str(code))
    os.replace(path + ".tmp", path)


def _serve() -> dict | None:
    """Answer requests until the control pipe closes (returns None) or this is a forked worker (returns its
    request)."""
    children: dict[int, str] = {}
    control = sys.stdin.buffer
    buffered = b""
    while True:
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                _write_status(children.pop(pid), status)
        ready, _, _ = select.select([control], [], [], 0.02)
        if not ready:
            continue
        chunk = os.read(control.fileno(), 65536)
        if not chunk:  # the test session ended: its workers were killed by it or have ended
            return None
        buffered += chunk
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                return request
            children[pid] = request["status"]
            sys.stdout.write(json.dumps({"pid": pid}) + "\n")
            sys.stdout.flush()


def _become_worker(request: dict) -> None:
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["script"]
    sys.argv = [script, *request["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))


if __name__ == "__main__":
    _preload()
    sys.stdout.write(json.dumps({"ready": os.getpid()}) + "\n")
    sys.stdout.flush()
    worker = _serve()
    if worker is None:
        sys.exit(0)
    _become_worker(worker)
    runpy.run_path(worker["script"], run_name="__main__")
