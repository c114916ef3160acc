"""The automatic fetch threads against a fixed count, latency-bound, systems alternated within each pass.

Runs ElasticPredict (one model) and run_pipeline (two models) on the benchmark's latency-bound workload with
``fetch_threads=None`` (the default: chosen as it reads) and with a fixed count (default 32, what the choice settled
on before it could step down), alternating the two within each pass, and prints each run and the medians. Usage:
``bash bench/predict/run.sh`` is the full benchmark; this one runs as ``python bench/predict/fetch_ab.py [--passes N]
[--fixed 32]`` (from the repository root).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

from object_store import ObjectStore
from run_bench import rotated, run_once


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--rows", type=int, default=1500)
    parser.add_argument("--fixed", type=int, default=32)
    args = parser.parse_args()
    systems = [(f"{name} {label}", name, {**extra, "fetch_threads": threads})
               for name, extra in (("elastic", {"multi": False}), ("pipeline", {"max_replicas": 2}))
               for label, threads in (("auto", None), (f"fixed {args.fixed}", args.fixed))]
    rates: dict[str, list[float]] = {key: [] for key, _, _ in systems}
    workdir = Path(tempfile.mkdtemp(prefix="fetch-ab-"))
    try:
        with ObjectStore(30.0) as store:
            for p in range(args.passes):
                for key, name, kwargs in rotated(systems, p):
                    result = run_once(name, store.url, args.rows, workdir, **kwargs)
                    rates[key].append(result["rows_per_s"])
                    print(f"pass {p + 1} {key}: {result['rows_per_s']:.1f} rows/s, threads"
                          f" {result.get('fetch_threads_used')}", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for key, values in rates.items():
        print(f"{key}: median {statistics.median(values):.1f} rows/s ({', '.join(f'{v:.0f}' for v in values)})")


if __name__ == "__main__":
    main()
