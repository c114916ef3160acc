"""Run the command line as a user would, in its own process group, and make sure nothing outlives it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence


@dataclass(frozen=True)
class Finished:
    """What a command line left behind."""

    returncode: int
    """Exit status of the launched process."""
    stdout: str
    """Its standard output."""
    stderr: str
    """Its standard error."""

    def describe(self) -> str:
        return f"exit {self.returncode}\n--- stdout\n{self.stdout[-4000:]}\n--- stderr\n{self.stderr[-4000:]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", **extra)
    return env


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def run_cli(args: Sequence[str], cwd: Path, timeout: float, prefix: Optional[Sequence[str]] = None,
            env: Optional[dict] = None) -> Finished:
    """``python -m lightning_paro ARGS`` (or ``PREFIX ARGS``) in ``cwd``; kills its whole process group on timeout
    and fails if any process of the group is still alive shortly after it exits."""
    command = list(prefix) if prefix is not None else [sys.executable, "-m", "lightning_paro"]
    proc = subprocess.Popen(command + list(args), cwd=cwd, env=env or cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # A rank that died leaves the others waiting (and holding the pipes): show what the processes said.
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"{command + list(args)} did not finish in {timeout} s (exit code of the first process:"
                             f" {proc.returncode})\nstdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}") from None
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        raise
    deadline = time.monotonic() + 15
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _group_alive(proc.pid):
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"processes of {command + list(args)} outlived it\n{err[-3000:]}")
    return Finished(proc.returncode, out, err)
