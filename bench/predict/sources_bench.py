"""Prediction over a large Parquet input: ElasticPredict over ParquetSource vs Ray Data vs plain Trainer.predict.

    bash bench/predict/run.sh --sources            # sets up the Ray environment if needed, then runs this
    python bench/predict/sources_bench.py [--rows 1000000] [--repeats 3] [--ray-python PY]
    python bench/predict/sources_bench.py --report  # re-renders sources.md from sources.json
    python bench/predict/sources_bench.py --profile-only  # re-measures only the per-step CPU profile

Generates a seeded Parquet input (several files, uneven row groups, 16 float32 features and an int64 id)
in a temporary directory, then scores it with a 2-layer MLP with three systems, interleaved pass by pass:

* ``elastic``: ``Trainer.predict`` with ``ElasticPredict(out)`` (default settings, SQLite ledger, Parquet output)
  over ``ParquetSource`` (a unit per row group), the DataLoader's default collate (columns read as batches);
* ``elastic_rows``: the same with a ``collate_fn`` of the user's, which gets the rows as dicts;
* ``ray``: ``ray.data.read_parquet(dir).map_batches(model_fn, batch_size=B).write_parquet(out)``, local Ray on
  the CPU, run with an interpreter from a separate environment (``--ray-python``; never the project's);
* ``plain``: ``Trainer.predict`` over an ``IterableDataset`` streaming the files with pyarrow ``iter_batches``
  and a ``BasePredictionWriter`` writing one Parquet file.

Each run is a fresh process; its wall time covers start-up of the system (Trainer, DataLoader workers,
``ray.init``) up to the output being complete. Peak memory is sampled from ``/proc`` every 0.2 s over the run
process and all its descendants (DataLoader workers; Ray's GCS, raylet and workers), with the CPU time of the
main process during the run and of its descendants. Every output is checked against the input: same row count,
every id exactly once, and each score equal to a NumPy reference. A profile then measures, in one process, the
CPU time per 1,000 rows of each step of the two Lightning read paths, of Lightning's batch transfer and of the model.
Writes ``bench/results/predict/sources.json`` and ``sources.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results" / "predict"
DEFAULT_RAY_VENV = HERE / ".ray-venv"
RAY_REQUIREMENTS = ["ray[data]==2.60.0", "pyarrow==26.0.1", "numpy==2.4.6"]
# pinned like the project's own environment (scripts/env.sh): the CPU build of the same torch release
TORCH_REQUIREMENT = ["torch==2.13.0"]

NUM_FEATURES = 16
FEATURES = [f"f{i:02d}" for i in range(NUM_FEATURES)]
HIDDEN = 64
ID_BASE = 1_000_000_000
SYSTEMS = ("elastic", "elastic_rows", "ray", "plain")
LABELS = {
    "elastic": "ElasticPredict over ParquetSource (defaults, SQLite ledger)",
    "elastic_rows": "ElasticPredict over ParquetSource with a user collate_fn (rows as dicts)",
    "ray": "Ray Data read_parquet + map_batches + write_parquet",
    "plain": "Trainer.predict over an IterableDataset (iter_batches) + BasePredictionWriter",
}


# ----------------------------------------------------------------------------------------------------------
# the input and the model (shared by every system and by the reference check)


def generate_input(directory: Path, rows: int, files: int, seed: int) -> dict:
    """Writes ``rows`` rows over ``files`` Parquet files of uneven sizes, each with uneven row groups."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    weights = rng.uniform(0.3, 1.7, files)
    sizes = np.floor(weights / weights.sum() * rows).astype(np.int64)
    sizes[-1] += rows - sizes.sum()
    layout, first = [], 0
    for number, size in enumerate(sizes):
        groups, left = [], int(size)
        while left > 0:  # row groups between 2,000 and 60,000 rows
            group = min(left, int(rng.integers(2_000, 60_001)))
            groups.append(group)
            left -= group
        schema = pa.schema([(name, pa.float32()) for name in FEATURES] + [("id", pa.int64())])
        with pq.ParquetWriter(directory / f"part-{number:02d}.parquet", schema) as writer:
            for group in groups:
                x = rng.standard_normal((group, NUM_FEATURES), dtype=np.float32)
                ids = np.arange(ID_BASE + first, ID_BASE + first + group, dtype=np.int64)
                columns = [pa.array(x[:, i]) for i in range(NUM_FEATURES)] + [pa.array(ids)]
                writer.write_table(pa.Table.from_arrays(columns, schema=schema), row_group_size=group)
                first += group
        layout.append({"file": f"part-{number:02d}.parquet", "rows": int(size), "row_groups": groups})
    return {"rows": first, "files": layout, "bytes": sum(p.stat().st_size for p in directory.iterdir())}


def mlp_weights(seed: int = 1):
    import numpy as np

    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((HIDDEN, NUM_FEATURES)) / NUM_FEATURES ** 0.5).astype(np.float32)
    b1 = (rng.standard_normal(HIDDEN) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((1, HIDDEN)) / HIDDEN ** 0.5).astype(np.float32)
    b2 = (rng.standard_normal(1) * 0.1).astype(np.float32)
    return w1, b1, w2, b2


def build_mlp():
    """The 2-layer MLP (16 -> 64 -> 1) with fixed weights, the same in every system."""
    import torch

    w1, b1, w2, b2 = mlp_weights()
    model = torch.nn.Sequential(torch.nn.Linear(NUM_FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1))
    with torch.no_grad():
        for layer, (w, b) in zip((model[0], model[2]), ((w1, b1), (w2, b2))):
            layer.weight.copy_(torch.from_numpy(w))
            layer.bias.copy_(torch.from_numpy(b))
    return model.eval()


def reference_scores(x):
    import numpy as np

    w1, b1, w2, b2 = mlp_weights()
    return (np.maximum(x @ w1.T + b1, 0) @ w2.T + b2)[:, 0]


# ----------------------------------------------------------------------------------------------------------
# the three systems (each runs in its own process: ``sources_bench.py --system NAME ...``)


def _trainer(callbacks):
    import lightning as L

    return L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=callbacks, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False)


def collate_rows(rows: list):
    """The user's collate for ParquetSource rows (dicts of column values): the features as one float32 tensor."""
    import numpy as np
    import torch

    return torch.from_numpy(np.array([[row[name] for name in FEATURES] for row in rows], dtype=np.float32))


def features_of(batch: dict):
    """predict_step's input with the default collate: the 16 feature columns (float64 tensors) as float32."""
    import torch

    return torch.stack([batch[name] for name in FEATURES], dim=1).float()


def run_elastic(data: str, out: str, batch_size: int, workers: int, per_row: bool = False) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_paro.predict import ElasticPredict, ParquetSource

    class Scorer(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = build_mlp()

        def predict_step(self, batch, batch_idx):
            return {"score": self.mlp(batch if per_row else features_of(batch))[:, 0]}

    start, cpu = time.perf_counter(), time.process_time()
    source = ParquetSource(data, columns=FEATURES + ["id"], key="id")
    if per_row:
        loader = DataLoader(source, batch_size=batch_size, num_workers=workers, collate_fn=collate_rows)
    else:
        loader = DataLoader(source, batch_size=batch_size, num_workers=workers)
    _trainer([ElasticPredict(out)]).predict(Scorer(), dataloaders=loader)
    return {"seconds": time.perf_counter() - start, "cpu_s_main_process_in_run": time.process_time() - cpu}


class ParquetStream:
    """The plain anchor's input: the files' batches streamed with pyarrow, files split among DataLoader workers."""

    def __init__(self, data: str, batch_size: int) -> None:
        self.files = sorted(str(p) for p in Path(data).glob("*.parquet"))
        self.batch_size = batch_size

    def __iter__(self):
        import numpy as np
        import pyarrow.parquet as pq
        import torch
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        files = self.files if info is None else self.files[info.id::info.num_workers]
        for path in files:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=self.batch_size, columns=FEATURES + ["id"]):
                x = np.stack([batch.column(name).to_numpy() for name in FEATURES], axis=1)
                yield {"x": torch.from_numpy(x), "id": torch.from_numpy(batch.column("id").to_numpy())}


def run_plain(data: str, out: str, batch_size: int, workers: int) -> dict:
    import lightning as L
    import pyarrow as pa
    import pyarrow.parquet as pq
    from lightning.pytorch.callbacks import BasePredictionWriter
    from torch.utils.data import DataLoader, IterableDataset

    class Stream(ParquetStream, IterableDataset):
        pass

    class Scorer(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = build_mlp()

        def predict_step(self, batch, batch_idx):
            return batch["id"], self.mlp(batch["x"])[:, 0]

    class ParquetWriter(BasePredictionWriter):
        def __init__(self, path: str) -> None:
            super().__init__(write_interval="batch")
            self.path = path
            self.writer = None

        def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
            ids, scores = prediction
            table = pa.table({"id": ids.numpy(), "score": scores.numpy()})
            if self.writer is None:
                self.writer = pq.ParquetWriter(self.path, table.schema)
            self.writer.write_table(table)

        def on_predict_end(self, trainer, pl_module):
            if self.writer is not None:
                self.writer.close()

    start, cpu = time.perf_counter(), time.process_time()
    Path(out).mkdir(parents=True, exist_ok=True)
    loader = DataLoader(Stream(data, batch_size), batch_size=None, num_workers=workers)
    _trainer([ParquetWriter(str(Path(out) / "predictions.parquet"))]).predict(
        Scorer(), dataloaders=loader, return_predictions=False)
    return {"seconds": time.perf_counter() - start, "cpu_s_main_process_in_run": time.process_time() - cpu}


_RAY_MODEL = None


def ray_model_fn(batch: dict) -> dict:
    """Ray Data's batch function: the model is built once per Ray worker process."""
    import numpy as np
    import torch

    global _RAY_MODEL
    if _RAY_MODEL is None:
        torch.set_num_threads(1)
        _RAY_MODEL = build_mlp()
    x = np.stack([batch[name] for name in FEATURES], axis=1).astype(np.float32, copy=False)
    with torch.inference_mode():
        scores = _RAY_MODEL(torch.from_numpy(x))[:, 0].numpy()
    return {"id": batch["id"], "score": scores}


def run_ray(data: str, out: str, batch_size: int, workers: int, temp_dir: str) -> dict:
    import ray

    start, cpu = time.perf_counter(), time.process_time()
    ray.init(include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1", _temp_dir=temp_dir)
    started = time.perf_counter()
    try:
        ds = ray.data.read_parquet(data, columns=FEATURES + ["id"])
        ds.map_batches(ray_model_fn, batch_size=batch_size, batch_format="numpy").write_parquet(out)
        seconds = time.perf_counter() - start
        cpu = time.process_time() - cpu
        cpus = ray.cluster_resources().get("CPU")
    finally:
        ray.shutdown()
    return {"seconds": seconds, "ray_init_seconds": started - start, "ray_cpus": cpus, "cpu_s_main_process_in_run": cpu}


def system_main(args) -> None:
    import torch

    torch.set_num_threads(1)
    if args.system in ("elastic", "elastic_rows"):
        result = run_elastic(args.data, args.out, args.batch_size, args.loader_workers, args.system == "elastic_rows")
    elif args.system == "plain":
        result = run_plain(args.data, args.out, args.batch_size, args.loader_workers)
    else:
        result = run_ray(args.data, args.out, args.batch_size, args.loader_workers, args.ray_temp)
    print("RESULT " + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------------------------------------
# measuring: memory of a process tree, output checks


def _children_map() -> dict:
    children: dict = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def process_tree(root: int) -> list:
    children, tree, todo = _children_map(), [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def _cpu_ticks(pid: int) -> int:
    """User + system CPU time of a process so far, in clock ticks."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def _rss_pss_kib(pid: int) -> tuple:
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
    except OSError:
        pass
    return rss, pss


class TreeMemory(threading.Thread):
    """Samples the summed RSS and PSS of a process and all its descendants; keeps the peaks, the process count and
    the last CPU time seen of each process (a process's CPU after its last sample, at most 0.2 s, is missed)."""

    def __init__(self, pid: int, interval_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval_s = pid, interval_s
        self.peak_rss_kib = self.peak_pss_kib = self.max_processes = self.samples = 0
        self.cpu_ticks: dict = {}
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            tree = process_tree(self.pid)
            sizes = [_rss_pss_kib(pid) for pid in tree]
            self.peak_rss_kib = max(self.peak_rss_kib, sum(s[0] for s in sizes))
            self.peak_pss_kib = max(self.peak_pss_kib, sum(s[1] for s in sizes))
            self.max_processes = max(self.max_processes, len(tree))
            for pid in tree:
                self.cpu_ticks[pid] = max(self.cpu_ticks.get(pid, 0), _cpu_ticks(pid))
            self.samples += 1
            self.stopping.wait(self.interval_s)


def _kill_tree(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _leftovers(marker: str) -> list:
    """Processes whose command line names ``marker`` (this run's output or Ray temp directory)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def read_output(system: str, out: Path):
    import pyarrow.parquet as pq

    if system in ("elastic", "elastic_rows"):
        files = sorted(p for p in out.glob("*.parquet") if not p.name.startswith(("_", ".")))
    else:
        files = sorted(out.rglob("*.parquet"))
    ids, scores = [], []
    for path in files:
        table = pq.read_table(path, columns=["id", "score"])
        ids.append(table.column("id").to_numpy())
        scores.append(table.column("score").to_numpy())
    return files, ids, scores


def check_output(system: str, out: Path, reference) -> dict:
    """Row count, every input id exactly once, and every score equal to the NumPy reference."""
    import numpy as np

    files, ids, scores = read_output(system, out)
    ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    scores = np.concatenate(scores) if scores else np.zeros(0, np.float32)
    expected = reference.shape[0]
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    unique = int(np.unique(ids).size)
    exact = len(ids) == expected and bool(np.array_equal(sorted_ids, np.arange(ID_BASE, ID_BASE + expected)))
    max_error = float(np.abs(scores[order] - reference).max()) if exact else None
    return {"output_files": len(files), "rows": int(len(ids)), "unique_ids": unique,
            "duplicates": int(len(ids) - unique), "missing": int(expected - unique),
            "exactly_once": exact, "max_abs_score_error": max_error,
            "scores_match": bool(exact and max_error < 1e-4)}


def run_system(system: str, args, data: Path, workdir: Path, number: int, reference) -> dict:
    out = workdir / f"out-{system}-{number}"
    python = args.ray_python if system == "ray" else sys.executable
    ray_temp = workdir / f"ray-{number}"
    command = [python, str(Path(__file__).resolve()), "--system", system, "--data", str(data), "--out", str(out),
               "--batch-size", str(args.batch_size), "--loader-workers", str(args.loader_workers),
               "--ray-temp", str(ray_temp)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": str(HERE)}
    load_before = os.getloadavg()[0]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    monitor = TreeMemory(proc.pid)
    monitor.start()
    try:
        stdout, stderr = proc.communicate(timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        _kill_tree(process_tree(proc.pid))
        stdout, stderr = proc.communicate()
    finally:
        monitor.stopping.set()
        monitor.join()
        left = _leftovers(str(ray_temp)) + _leftovers(str(out))
        _kill_tree(left)
    line = next((l for l in stdout.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        result = {"error": (stdout[-1500:] + stderr[-3000:]).strip()}
    else:
        result = json.loads(line[len("RESULT "):])
        result.update(check_output(system, out, reference))
        result["rows_per_s"] = result["rows"] / result["seconds"]
    result.update({"system": system, "peak_rss_mib": round(monitor.peak_rss_kib / 1024, 1),
                   "peak_pss_mib": round(monitor.peak_pss_kib / 1024, 1), "max_processes": monitor.max_processes,
                   "memory_samples": monitor.samples, "load_1min_before": round(load_before, 1),
                   "cpu_s_main_process": round(monitor.cpu_ticks.get(proc.pid, 0) / os.sysconf("SC_CLK_TCK"), 1),
                   "cpu_s_descendants": round(sum(t for pid, t in monitor.cpu_ticks.items() if pid != proc.pid)
                                              / os.sysconf("SC_CLK_TCK"), 1),
                   "leftover_processes_killed": len(left)})
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(ray_temp, ignore_errors=True)
    brief = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in result.items() if k != "error"}
    print(f"  {json.dumps(brief)}" + (f"\n  ERROR {result['error'][-600:]}" if "error" in result else ""), flush=True)
    return result


# ----------------------------------------------------------------------------------------------------------
# the profile: where each system's time per batch goes, measured in one process


def profile(data: Path, batch_size: int, batches: int = 200, rounds: int = 3) -> dict:
    """Milliseconds per 1,000 rows of each step of the two Lightning read paths, of Lightning's batch transfer and
    of the model, measured in this process on one thread (the package's own classes for ElasticPredict's path);
    each step's CPU time (``time.process_time``: not inflated by other jobs taking the cores away) is measured in
    ``rounds`` rounds and the smallest is kept."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    from lightning.fabric.utilities.apply_func import move_data_to_device

    from lightning_paro.predict import ParquetSource
    from lightning_paro.predict.batch import BatchTicket
    from lightning_paro.predict.dataset import ElasticCollate
    from lightning_paro.predict.sources import SourceDataset, source_layout

    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    model = build_mlp()

    def fresh():
        source = ParquetSource(str(data), columns=FEATURES + ["id"], key="id")
        return source, source_layout(source)

    _, layout = fresh()
    batches = min(batches, layout.num_rows // batch_size)
    rows = batches * batch_size
    tickets = [BatchTicket(0, 0, 0, range(b * batch_size, (b + 1) * batch_size), False, 1)
               for b in range(batches)]

    def one_round() -> dict:
        steps: dict = {}

        def timed(name, fn):
            t = time.process_time()
            value = fn()
            steps[name] = time.process_time() - t
            return value

        # ElasticPredict's read path as its DataLoader workers run it: SourceDataset.__getitems__ (the pieces of
        # row groups a batch covers, ParquetSource.read: row group read, slice, to_pylist, the id of each row)
        source, layout = fresh()
        dataset = SourceDataset(source, layout)
        loaded = timed("elastic, user collate_fn: SourceDataset.__getitems__ (the whole read, rows as dicts)",
                       lambda: [dataset.__getitems__(ticket) for ticket in tickets])
        source, layout = fresh()
        pieces = [(layout.units[u], lo, hi) for ticket in tickets
                  for u, lo, hi in layout.pieces(ticket.indices[0], ticket.indices[-1] + 1)]
        timed("elastic, user collate_fn: of which row groups read as Arrow (ParquetSource._row_group)",
              lambda: [source._row_group(unit) for unit, _, _ in pieces])
        timed("elastic, user collate_fn: of which Arrow slices to Python dicts (to_pylist)",
              lambda: [source._row_group(unit).slice(lo, hi - lo).to_pylist() for unit, lo, hi in pieces])
        ids_only = ElasticCollate(lambda samples: None, "id")
        timed("elastic, user collate_fn: ElasticCollate's id of each row", lambda: [ids_only(item) for item in loaded])
        tensors = timed("elastic, user collate_fn: the collate_fn (row dicts to a float32 tensor)",
                        lambda: [collate_rows(item.samples) for item in loaded])
        # Lightning's batch transfer (LightningModule.transfer_batch_to_device -> move_data_to_device), run on every
        # batch in the main process: on the ElasticBatch the callback's DataLoader yields (the user's tensor, the
        # per-row lists of indices and ids, the ticket with its tuple of indices), and on the plain anchor's batch
        collate = ElasticCollate(collate_rows, "id")
        wrapped = [collate(item) for item in loaded]
        timed("elastic, user collate_fn: Lightning's batch transfer of the ElasticBatch (main process)",
              lambda: [move_data_to_device(batch, cpu) for batch in wrapped])

        # the defaults' path (no collate_fn): the source reads each ticket's pieces as column batches
        source, layout = fresh()
        batched = SourceDataset(source, layout, batched=True)
        loaded_batched = timed("elastic, defaults: SourceDataset.__getitems__ (the whole read, as column batches)",
                               lambda: [batched.__getitems__(ticket) for ticket in tickets])
        default = ElasticCollate(None, "id")
        wrapped_batched = timed("elastic, defaults: ElasticCollate (the ids from the id column)",
                                lambda: [default(item) for item in loaded_batched])
        timed("elastic, defaults: Lightning's batch transfer of the ElasticBatch (main process)",
              lambda: [move_data_to_device(batch, cpu) for batch in wrapped_batched])
        timed("elastic, defaults: predict_step's stack of the 16 columns into a float32 tensor",
              lambda: [features_of(batch.data) for batch in wrapped_batched])
        plain_batches = [{"x": x, "id": torch.arange(len(x))} for x in tensors]
        timed("plain: Lightning's batch transfer of the batch (main process)",
              lambda: [move_data_to_device(batch, cpu) for batch in plain_batches])

        # the plain anchor's read path: iter_batches over the files, columns stacked into a float32 tensor
        def plain_read() -> None:
            done = 0
            for path in sorted(data.glob("*.parquet")):
                for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size, columns=FEATURES + ["id"]):
                    torch.from_numpy(np.stack([batch.column(name).to_numpy() for name in FEATURES], axis=1))
                    np.array(batch.column("id").to_numpy())
                    done += batch.num_rows
                    if done >= rows:
                        return

        timed("plain: iter_batches + columns stacked to a float32 tensor", plain_read)

        def forward() -> None:
            with torch.inference_mode():
                for x in tensors:
                    model(x)

        timed("model (the MLP's forward, 1 thread)", forward)
        return steps

    measured = [one_round() for _ in range(rounds)]
    return {"rows": rows, "batch_size": batch_size, "rounds": rounds,
            "ms_per_1000_rows": {k: round(min(m[k] for m in measured) / rows * 1e6, 3) for k in measured[0]}}


# ----------------------------------------------------------------------------------------------------------
# the harness


def ensure_ray(venv: Path) -> str:
    """The interpreter of the separate Ray environment, created (from PyPI) when missing."""
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import ray, torch, pyarrow, numpy"]
    if python.exists() and subprocess.run(check, capture_output=True, check=False).returncode == 0:
        return str(python)
    print(f"setting up Ray in {venv} (separate from the project's environment)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    (venv / ".gitignore").write_text("*\n")
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run(pip + RAY_REQUIREMENTS, check=True)
    subprocess.run(pip + TORCH_REQUIREMENT, check=True)
    subprocess.run(check, check=True)
    return str(python)


def _median(values):
    return statistics.median(values) if values else None


def summarize(runs: list) -> dict:
    summary = {}
    for system in SYSTEMS:
        mine = [r for r in runs if r["system"] == system and "error" not in r]
        summary[system] = {
            "runs": len(mine),
            "failed_runs": sum(1 for r in runs if r["system"] == system and "error" in r),
            "rows_per_s_median": _median([r["rows_per_s"] for r in mine]),
            "rows_per_s_all": [round(r["rows_per_s"], 1) for r in mine],
            "seconds_median": _median([r["seconds"] for r in mine]),
            "peak_pss_mib_median": _median([r["peak_pss_mib"] for r in mine]),
            "peak_rss_mib_median": _median([r["peak_rss_mib"] for r in mine]),
            "all_exactly_once": bool(mine) and all(r["exactly_once"] and r["scores_match"] for r in mine),
            "rows_checked": [r["rows"] for r in mine],
            "cpu_s_main_process_median": _median([r["cpu_s_main_process"] for r in mine if "cpu_s_main_process" in r]),
            "cpu_s_main_process_in_run_median": _median(
                [r["cpu_s_main_process_in_run"] for r in mine if "cpu_s_main_process_in_run" in r]),
            "cpu_s_descendants_median": _median([r["cpu_s_descendants"] for r in mine if "cpu_s_descendants" in r]),
        }
        if system == "ray":
            summary[system]["rows_per_s_after_ray_init_median"] = _median(
                [r["rows"] / (r["seconds"] - r["ray_init_seconds"]) for r in mine])
        ratios = []
        for p in sorted({r["pass"] for r in runs}):
            here = {r["system"]: r for r in runs if r["pass"] == p and "error" not in r}
            if system in here and "elastic" in here:
                ratios.append(here[system]["rows_per_s"] / here["elastic"]["rows_per_s"])
        summary[system]["ratio_to_elastic_per_pass"] = [round(x, 3) for x in ratios]
        summary[system]["ratio_to_elastic_median"] = _median(ratios)
    return summary


def render(results: dict) -> str:
    s, m, d = results["settings"], results["machine"], results["input"]
    groups = [g for f in d["files"] for g in f["row_groups"]]
    lines = [
        (f"Input: {d['rows']:,} rows in {len(d['files'])} Parquet files ({d['bytes'] / 2**20:.0f} MiB), "
         f"{len(groups)} row groups of {min(groups):,} to {max(groups):,} rows; {NUM_FEATURES} float32 features "
         f"and an int64 id (seed {s['seed']}). Model: MLP {NUM_FEATURES}-{HIDDEN}-1, torch threads 1. Batch "
         f"{s['batch_size']}; Lightning systems: {s['loader_workers']} DataLoader workers; Ray: defaults "
         f"(local, {results.get('ray_cpus')} CPUs). Machine: {m['cpus']} CPUs, no GPU, shared with other jobs "
         f"(1-minute load average {m['load_1min_start']} at the start, {m['load_1min_end']} at the end). "
         f"Passes: {s['repeats']}, the systems interleaved in a rotating order. Finished {results['finished_at']}"
         + (f", commit {results['provenance']['commit'][:7]}" if results.get("provenance") else "") + "."),
        "",
        ("| system | rows/s (median) | rows/s, each run | vs ElasticPredict (median of per-pass ratios) | "
         "peak PSS MiB, whole job (median) | peak RSS MiB, whole job (median) | CPU s, main process during the "
         "run / its descendants (median) | runs | output check |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for system in SYSTEMS:
        if system not in s["systems"]:
            continue
        r = results["summary"][system]
        if not r["runs"]:
            lines.append(f"| {LABELS[system]} | failed | | | | | | 0 | |")
            continue
        check = (f"{r['rows_checked'][0]:,} rows, every id once, scores match" if r["all_exactly_once"]
                 else "MISMATCH (see sources.json)")
        ratio = r["ratio_to_elastic_median"]
        cpu = ""
        if r.get("cpu_s_main_process_in_run_median") is not None:
            cpu = f"{r['cpu_s_main_process_in_run_median']:.1f} / {r['cpu_s_descendants_median']:.1f}"
        elif r.get("cpu_s_main_process_median") is not None:
            cpu = f"{r['cpu_s_main_process_median']:.1f} (with imports) / {r['cpu_s_descendants_median']:.1f}"
        each = ", ".join(f"{x:,.0f}" for x in r["rows_per_s_all"])
        lines.append(
            f"| {LABELS[system]} | {r['rows_per_s_median']:,.0f} | {each}"
            f" | {ratio:.2f}x | {r['peak_pss_mib_median']:,.0f} | {r['peak_rss_mib_median']:,.0f} | {cpu} | "
            f"{r['runs']} | {check} |")
    ray = results["summary"].get("ray", {})
    if ray.get("rows_per_s_after_ray_init_median"):
        init = statistics.median(r["ray_init_seconds"] for r in results["runs"]
                                 if r["system"] == "ray" and "error" not in r)
        lines += ["", (f"Ray's time includes `ray.init` (median {init:.1f} s); without it Ray's median is "
                       f"{ray['rows_per_s_after_ray_init_median']:,.0f} rows/s.")]
    prof = results.get("profile")
    if prof:
        lines += ["", (f"Profile, one process, one thread, {prof['rows']:,} rows in batches of {prof['batch_size']} "
                       f"(CPU ms per 1,000 rows, the smallest of {prof.get('rounds', 1)} rounds):"), ""]
        lines += [f"* {step}: {ms}" for step, ms in prof["ms_per_1000_rows"].items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--loader-workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--ray-python", default=None, help="interpreter with ray[data] and torch (default: "
                        "bench/predict/.ray-venv, created when missing)")
    parser.add_argument("--ensure-ray", action="store_true", help="only create the Ray environment if missing")
    parser.add_argument("--report", action="store_true", help="only re-render sources.md from sources.json")
    parser.add_argument("--profile-only", action="store_true",
                        help="only (re)measure the profile, on a freshly generated input, into sources.json")
    parser.add_argument("--results", default=str(RESULTS))
    # one system's run (internal)
    parser.add_argument("--system", choices=SYSTEMS)
    parser.add_argument("--data")
    parser.add_argument("--out")
    parser.add_argument("--ray-temp")
    args = parser.parse_args()

    if args.system:
        import sources_bench  # by module name, so Ray's workers import the batch function instead of unpickling it

        sources_bench.system_main(args)
        return
    results_dir = Path(args.results)
    if args.profile_only:
        results = json.loads((results_dir / "sources.json").read_text())
        with tempfile.TemporaryDirectory(prefix="predict-sources-profile-") as tmp:
            generate_input(Path(tmp), args.rows, args.files, args.seed)
            results["profile"] = profile(Path(tmp), args.batch_size)
        (results_dir / "sources.json").write_text(json.dumps(results, indent=1))
        args.report = True
    if args.report:
        results = json.loads((results_dir / "sources.json").read_text())
        (results_dir / "sources.md").write_text(render(results) + "\n")
        print(render(results))
        return
    systems = [s for s in args.systems.split(",") if s]
    if args.ensure_ray:
        ensure_ray(DEFAULT_RAY_VENV)
        return
    if "ray" in systems and args.ray_python is None:
        args.ray_python = ensure_ray(DEFAULT_RAY_VENV)

    import numpy as np
    import pyarrow.parquet as pq

    results_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="predict-sources-bench-"))
    results: dict = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "gpu": False, "load_1min_start": round(os.getloadavg()[0], 1)},
        "settings": {k: v for k, v in vars(args).items() if k in ("rows", "files", "seed", "batch_size",
                                                                  "loader_workers", "repeats")}
        | {"systems": systems, "torch_threads": 1, "memory_sample_interval_s": 0.2},
        "memory_method": (
            "the harness samples /proc every 0.2 s: the run's process and all its descendants (DataLoader worker "
            "processes; for Ray the GCS server, raylet, dashboard agents and worker processes, which ray.init starts "
            "under the driver), summing Pss and Rss from /proc/<pid>/smaps_rollup; the peak of each sum is reported. "
            "PSS divides shared pages (libraries, fork copy-on-write, Ray's shared-memory object store) among the "
            "processes that map them; RSS counts them in every process, so it overstates a job with many processes."),
        "runs": [],
    }
    try:
        data = workdir / "input"
        t = time.perf_counter()
        results["input"] = generate_input(data, args.rows, args.files, args.seed)
        print(f"generated {args.rows:,} rows in {time.perf_counter() - t:.1f} s under {data}", flush=True)
        table = pq.read_table(data, columns=FEATURES + ["id"])
        ids = table.column("id").to_numpy()
        x = np.stack([table.column(name).to_numpy() for name in FEATURES], axis=1)
        reference = np.empty(len(ids), np.float32)
        reference[ids - ID_BASE] = reference_scores(x)
        del table, x
        number = 0
        for p in range(args.repeats):
            order = systems[p % len(systems):] + systems[:p % len(systems)]
            print(f"pass {p + 1}/{args.repeats}: {', '.join(order)}", flush=True)
            for system in order:
                result = run_system(system, args, data, workdir, number, reference)
                result["pass"] = p + 1
                results["runs"].append(result)
                if system == "ray" and "ray_cpus" in result:
                    results["ray_cpus"] = result["ray_cpus"]
                number += 1
                results["summary"] = summarize(results["runs"])
                results["machine"]["load_1min_end"] = round(os.getloadavg()[0], 1)
                results["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
                (results_dir / "sources.json").write_text(json.dumps(results, indent=1))
        results["profile"] = profile(data, args.batch_size)
        print(f"profile: {results['profile']}", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    sys.path.insert(0, str(HERE.parent))
    import provenance

    results["provenance"] = provenance.stamp()
    (results_dir / "sources.json").write_text(json.dumps(results, indent=1))
    (results_dir / "sources.md").write_text(render(results) + "\n")
    print(render(results))


if __name__ == "__main__":
    main()
