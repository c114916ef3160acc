"""Where the CPU goes during one benchmark run: CPU seconds of each process (the run's own, its children, the local
object store) and the machine's idle share, over the run's own timed window.

    OMP_NUM_THREADS=1 python bench/predict/cpu_split.py [--rows 1500] [--config pipeline]
                                                        [--kwargs '{"max_replicas": 2}']

Starts the latency-bound object store (30 ms per request), runs one configuration of ``configs.py`` in a fresh
interpreter as ``run_bench.py`` does, samples ``/proc`` every 0.1 s, and reports the CPU seconds spent between the
run's start and its result (the window is the run's own ``seconds`` before its result line). The sampling costs CPU
too (a scan of ``/proc`` ten times a second), so the run is a little slower than in ``run_bench.py``. Linux only;
writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from object_store import ObjectStore  # noqa: E402
from run_bench import configuration_command  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(entry))
    return kids


def cpu_seconds(roots: list[int], kids: dict[int, list[int]] | None = None) -> dict[int, float]:
    """User + system CPU seconds of every process under ``roots`` (the roots included); ``kids``: the process tree
    (:func:`_children`), read now when None."""
    kids, todo, out = _children() if kids is None else kids, list(roots), {}
    while todo:
        pid = todo.pop()
        todo += kids.get(pid, [])
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / TICKS
    return out


def machine() -> tuple[int, int]:
    """(all jiffies, idle + iowait jiffies) of the whole machine."""
    values = list(map(int, open("/proc/stat").readline().split()[1:]))
    return sum(values), values[3] + values[4]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1500)
    ap.add_argument("--config", default="pipeline")
    ap.add_argument("--kwargs", default='{"max_replicas": 2}')
    ap.add_argument("--latency-ms", type=float, default=30.0)
    args = ap.parse_args()
    samples: list = []
    done = threading.Event()
    with ObjectStore(args.latency_ms) as store, tempfile.TemporaryDirectory() as tmp:
        command, env = configuration_command(args.config, store.url, args.rows, Path(tmp) / "out",
                                             json.loads(args.kwargs))
        run = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)

        def sample() -> None:
            while not done.is_set():
                kids = _children()  # one scan of /proc for both trees: the sampling's own CPU is in what it measures
                samples.append((time.perf_counter(), machine(), cpu_seconds([run.pid], kids),
                                cpu_seconds([store.proc.pid], kids)))
                time.sleep(0.1)

        sampler = threading.Thread(target=sample)
        sampler.start()
        result, ended = None, None
        for line in run.stdout:
            if line.startswith("RESULT "):
                ended, result = time.perf_counter(), json.loads(line[len("RESULT "):])
        done.set()
        sampler.join()
        run.wait()
    if result is None:
        sys.exit(f"the run printed no result (exit code {run.returncode})")
    window = [s for s in samples if ended - result["seconds"] <= s[0] <= ended]
    (t0, m0, start_run, start_store), (t1, m1, _, _) = window[0], window[-1]
    first: dict = {}
    last: dict = {}
    for _, _, run_cpu, store_cpu in window:  # a process that exits inside the window counts up to its last sample
        for side, cpu, at_start in (("run", run_cpu, start_run), ("store", store_cpu, start_store)):
            for pid, seconds in cpu.items():
                # present when the window opens: counted from there; started inside it: from zero
                first.setdefault((side, pid), seconds if pid in at_start else 0.0)
                last[(side, pid)] = seconds
    by_process: dict[str, float] = {}
    for (side, pid), seconds in last.items():
        name = "object store" if side == "store" else "driver" if pid == run.pid else f"child {pid}"
        by_process[name] = by_process.get(name, 0.0) + seconds - first[(side, pid)]
    print(json.dumps({"config": args.config, "kwargs": json.loads(args.kwargs), "rows": args.rows,
                      "rows_per_s": round(result["rows_per_s"], 1), "window_s": round(t1 - t0, 2),
                      "idle_share": round((m1[1] - m0[1]) / max(1, m1[0] - m0[0]), 3),
                      "cpu_s": {k: round(v, 2) for k, v in sorted(by_process.items(), key=lambda kv: -kv[1])}},
                     indent=1))


if __name__ == "__main__":
    main()
