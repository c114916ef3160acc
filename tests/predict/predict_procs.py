"""Forked worker processes for the fault tests: Lightning is imported once by pytest, workers start in ms."""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import tempfile
import time
from pathlib import Path

import pyarrow as pa

from lightning_paro.predict import read_predictions
from predict_app import JobSpec, worker_main

_FORK = multiprocessing.get_context("fork")
_STACKS = Path(tempfile.gettempdir())


def _stacks_file(pid: int) -> Path:
    return _STACKS / f"lightning-paro-test-worker-{pid}.stacks"


def _traced_worker(spec: JobSpec) -> None:
    """The worker, with every thread's stack written to a file on SIGUSR1 (read by :meth:`Workers.wait_all` when a
    worker hangs)."""
    with open(_stacks_file(os.getpid()), "w") as stacks:
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        worker_main(spec)


class Workers:
    """Starts, kills and reaps worker processes; kills whatever is left when the test ends."""

    def __init__(self) -> None:
        self.procs: list = []

    def start(self, spec: JobSpec):
        proc = _FORK.Process(target=_traced_worker, args=(spec,), daemon=False)
        proc.start()
        self.procs.append(proc)
        return proc

    def kill(self, proc) -> None:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=30)

    def alive(self) -> list:
        return [p for p in self.procs if p.is_alive()]

    def wait_all(self, timeout_s: float) -> list[int]:
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
        still = self.alive()
        if still:  # a hang: say where each worker's threads are
            for proc in still:
                os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(1.0)
            stacks = "\n".join(f"--- worker {p.pid}:\n{_read_stacks(p.pid)}" for p in still)
            raise AssertionError(f"workers still running after {timeout_s} s: {[p.pid for p in still]}\n{stacks}")
        return [p.exitcode for p in self.procs]

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=30)
            _stacks_file(proc.pid).unlink(missing_ok=True)


def _read_stacks(pid: int) -> str:
    try:
        return _stacks_file(pid).read_text()[-6000:]
    except OSError as exc:
        return f"(no stacks: {exc})"


def assert_exact_output(output_dir: Path, rows: int, skip: set = frozenset()) -> pa.Table:
    """Every row appears exactly once, in input order, with the right value; no temporary files remain."""
    table = read_predictions(output_dir)
    expected = [i for i in range(rows) if i not in skip]
    assert table.column("row_id").to_pylist() == expected
    assert table.column("y").to_pylist() == [3.0 * i + 1.0 for i in expected]
    leftovers = [p.name for p in output_dir.rglob(".tmp-*")]
    assert leftovers == []
    assert (output_dir / "_SUCCESS").exists()
    return table
