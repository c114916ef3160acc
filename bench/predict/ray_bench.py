"""The same workload through Ray Data (``map_batches`` with an actor pool), as a second anchor.

Run by ``run_bench.py --ray-python PY`` with an interpreter that has ``ray[data]`` installed. With
``--kill-after S`` the model actor is SIGKILLed S seconds after it started, and the output is
checked for duplicate and missing rows.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


class FetchPreprocess:
    """Fetches and preprocesses a batch of rows with 16 requests in flight (same as ElasticPredict's fetch_threads)."""

    def __init__(self, url: str) -> None:
        from workload import HttpRecords

        self.dataset = HttpRecords(url, 1 << 30)
        self.pool = ThreadPoolExecutor(16)

    def __call__(self, batch: dict) -> dict:
        samples = list(self.pool.map(self.dataset.__getitem__, [int(i) for i in batch["id"]]))
        return {"row_id": np.array([s["id"] for s in samples]), "tokens": np.stack([s["tokens"].numpy() for s in samples])}


class Model:
    def __init__(self, multi: bool, pid_file: str) -> None:
        import torch

        from configs import build_encoder, build_scorer

        torch.set_num_threads(1)
        self.torch = torch
        self.encoder = build_encoder()
        self.scorer = build_scorer() if multi else None
        with open(pid_file, "a") as f:
            f.write(f"{os.getpid()}\n")

    def __call__(self, batch: dict) -> dict:
        with self.torch.inference_mode():
            embedding = self.encoder(self.torch.from_numpy(batch["tokens"]))
            out = {"row_id": batch["row_id"], "embedding": list(embedding.numpy())}
            if self.scorer is not None:
                out["scores"] = list(self.scorer(embedding).numpy())
        return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--multi", action="store_true")
    parser.add_argument("--kill-after", type=float, default=None)
    args = parser.parse_args()

    import pyarrow.parquet as pq
    import ray

    out = Path(args.out)
    pid_file = str(out) + ".actor-pids"
    # logical CPUs: the fetch actors mostly wait on the network, so they get a fraction of a CPU each and
    # the model actor a whole one; 4 logical CPUs leave room for Ray Data's read task on the 2 real cores
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    killed = []

    def kill_one_actor() -> None:
        # count from the moment the model actor is up, so the kill lands mid-run whatever Ray's start-up takes
        while not Path(pid_file).exists() or not Path(pid_file).read_text().split():
            time.sleep(0.05)
        time.sleep(args.kill_after)
        pid = int(Path(pid_file).read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    if args.kill_after is not None:
        threading.Thread(target=kill_one_actor, daemon=True).start()
    start = time.perf_counter()
    ds = ray.data.range(args.rows, override_num_blocks=max(1, args.rows // 256))
    ds = ds.map_batches(FetchPreprocess, fn_constructor_args=(args.url,), batch_size=32, concurrency=2, num_cpus=0.5)
    ds = ds.map_batches(Model, fn_constructor_args=(args.multi, pid_file), batch_size=32, concurrency=1, num_cpus=1)
    ds.write_parquet(str(out))
    elapsed = time.perf_counter() - start
    ids = []
    for path in sorted(out.glob("*.parquet")):
        ids.extend(pq.read_table(path, columns=["row_id"]).column("row_id").to_pylist())
    counts = Counter(ids)
    result = {
        "seconds": elapsed,
        "rows": len(ids),
        "rows_per_s": len(ids) / elapsed,
        "duplicates": sum(c - 1 for c in counts.values() if c > 1),
        "missing": sum(1 for i in range(args.rows) if i not in counts),
        "killed_actor": killed[0] if killed else None,
    }
    ray.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
