"""The same workload through Ray Data, tuned as its users would run it: the anchor beside plain Trainer.predict.

Run by ``run_bench.py --ray-python PY`` with an interpreter that has ``ray[data]`` installed. ``ray.init`` runs once,
before any timing (a Ray user's cluster is up before the job); then every setting of the grid runs in that session,
each timed from building the dataset to the end of ``write_parquet``:

* fetching and preprocessing in an actor pool of ``fetch_actors`` actors with ``FETCH_THREADS`` requests in flight
  each (the I/O concurrency ElasticPredict's default settles on: 32 threads in each of 2 DataLoader workers);
* one actor pool per model stage (the encoder; with ``--multi`` the scorer in a second pool), each of
  ``model_actors`` actors of one CPU and one torch thread;
* ``batch_size`` rows per ``map_batches`` call in every stage, and one block of the input per batch.

Prints one ``RESULT {json}`` line: every setting's measurements and the fastest setting. With ``--kill-after S`` only
the first setting runs, and its encoder actor is SIGKILLed S seconds after it started; the output is checked for
duplicate and missing rows.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

FETCH_THREADS = 32
# the grid: every combination is run (in this order) and the fastest is the anchor
BATCH_SIZES = (32, 128)
MODEL_ACTORS = (1, 2)
FETCH_ACTORS = (2,)


class FetchPreprocess:
    """Fetches and preprocesses a batch of rows with ``FETCH_THREADS`` requests in flight."""

    def __init__(self, url: str) -> None:
        from workload import HttpRecords

        self.dataset = HttpRecords(url, 1 << 30)
        self.pool = ThreadPoolExecutor(FETCH_THREADS)

    def __call__(self, batch: dict) -> dict:
        samples = list(self.pool.map(self.dataset.__getitem__, [int(i) for i in batch["id"]]))
        return {"row_id": np.array([s["id"] for s in samples]), "tokens": np.stack([s["tokens"].numpy() for s in samples])}


class Encode:
    """The first model stage: the encoder, one torch thread."""

    def __init__(self, pid_file: str) -> None:
        import torch

        from configs import build_encoder

        torch.set_num_threads(1)
        self.torch = torch
        self.encoder = build_encoder()
        with open(pid_file, "a") as f:
            f.write(f"{os.getpid()}\n")

    def __call__(self, batch: dict) -> dict:
        with self.torch.inference_mode():
            embedding = self.encoder(self.torch.from_numpy(batch["tokens"])).numpy()
        return {"row_id": batch["row_id"], "embedding": embedding}


class Score:
    """The second model stage: the scorer over the encoder's embedding, one torch thread."""

    def __init__(self) -> None:
        import torch

        from configs import build_scorer

        torch.set_num_threads(1)
        self.torch = torch
        self.scorer = build_scorer()

    def __call__(self, batch: dict) -> dict:
        with self.torch.inference_mode():
            scores = self.scorer(self.torch.from_numpy(np.ascontiguousarray(batch["embedding"]))).numpy()
        return {"row_id": batch["row_id"], "embedding": batch["embedding"], "scores": scores}


def run_setting(ray, args, setting: dict, out: Path, pid_file: str) -> dict:
    pool = ray.data.ActorPoolStrategy
    batch = setting["batch_size"]
    # one block per batch, so that every actor of a pool has input as soon as the first batches are read
    ds = ray.data.range(args.rows, override_num_blocks=max(1, args.rows // batch))
    ds = ds.map_batches(FetchPreprocess, fn_constructor_args=(args.url,), batch_size=batch,
                        compute=pool(size=setting["fetch_actors"]), num_cpus=0.5)
    ds = ds.map_batches(Encode, fn_constructor_args=(pid_file,), batch_size=batch,
                        compute=pool(size=setting["model_actors"]), num_cpus=1)
    if args.multi:
        ds = ds.map_batches(Score, batch_size=batch, compute=pool(size=setting["model_actors"]), num_cpus=1)
    start = time.perf_counter()
    ds.write_parquet(str(out))  # the whole pipeline runs here (Ray Data is lazy)
    elapsed = time.perf_counter() - start
    import pyarrow.parquet as pq

    ids = []
    for path in sorted(out.glob("*.parquet")):
        ids.extend(pq.read_table(path, columns=["row_id"]).column("row_id").to_pylist())
    counts = Counter(ids)
    return {
        **setting,
        "seconds": elapsed,
        "rows": len(ids),
        "rows_per_s": len(ids) / elapsed,
        "duplicates": sum(c - 1 for c in counts.values() if c > 1),
        "missing": sum(1 for i in range(args.rows) if i not in counts),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--multi", action="store_true")
    parser.add_argument("--kill-after", type=float, default=None)
    args = parser.parse_args()

    import ray

    out = Path(args.out)
    settings = [dict(batch_size=b, fetch_actors=f, model_actors=m)
                for b, f, m in itertools.product(BATCH_SIZES, FETCH_ACTORS, MODEL_ACTORS)]
    # logical CPUs, an admission count only (the machine has what it has): the fetch actors mostly wait on the
    # network, so they ask for half a CPU each, each model actor for a whole one, and one more is left for Ray Data's
    # read and write tasks; enough for the largest setting of the grid, or its actors would wait for each other
    stages = 2 if args.multi else 1
    num_cpus = max(int(0.5 * s["fetch_actors"] + 0.999) + stages * s["model_actors"] + 1 for s in settings)
    init_start = time.perf_counter()
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    ray.data.DataContext.get_current().enable_progress_bars = False
    init_s = time.perf_counter() - init_start
    if args.kill_after is not None:
        settings = settings[:1]
    results, killed = [], []
    for i, setting in enumerate(settings):
        pid_file = f"{out}.actor-pids-{i}"
        if args.kill_after is not None:
            def kill_one_actor() -> None:
                # count from the moment the encoder actor is up, so the kill lands mid-run whatever start-up takes
                while not Path(pid_file).exists() or not Path(pid_file).read_text().split():
                    time.sleep(0.05)
                time.sleep(args.kill_after)
                pid = int(Path(pid_file).read_text().split()[0])
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

            threading.Thread(target=kill_one_actor, daemon=True).start()
        target = out / f"setting-{i}"
        shutil.rmtree(target, ignore_errors=True)  # write_parquet adds to what a directory holds
        result = run_setting(ray, args, setting, target, pid_file)
        Path(pid_file).unlink(missing_ok=True)
        results.append(result)
        print(f"  {json.dumps(result)}", file=sys.stderr, flush=True)
    ray.shutdown()
    # the fastest setting whose output is exact (every row once)
    exact = [r for r in results if r["duplicates"] == 0 and r["missing"] == 0] or results
    best = max(exact, key=lambda r: r["rows_per_s"])
    summary = {**best, "ray_init_s": init_s, "ray_num_cpus": num_cpus, "settings": results,
               "fetch_threads": FETCH_THREADS, "killed_actor": killed[0] if killed else None}
    print("RESULT " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
