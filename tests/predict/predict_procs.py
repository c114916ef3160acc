"""Forked worker processes for the fault tests: Lightning is imported once by pytest, workers start in ms."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pyarrow as pa

from lightning_paro.predict import read_predictions
from predict_app import JobSpec, worker_main

_FORK = multiprocessing.get_context("fork")


class Workers:
    """Starts, kills and reaps worker processes; kills whatever is left when the test ends."""

    def __init__(self) -> None:
        self.procs: list = []

    def start(self, spec: JobSpec):
        proc = _FORK.Process(target=worker_main, args=(spec,), daemon=False)
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
        assert not still, f"workers still running after {timeout_s} s: {[p.pid for p in still]}"
        return [p.exitcode for p in self.procs]

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=30)


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
