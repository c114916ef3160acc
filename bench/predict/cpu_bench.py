"""What ElasticPredict costs on a compute-bound job it did not write: plain ``Trainer.predict`` + a
``BasePredictionWriter`` against ElasticPredict at its defaults, the same DataLoader, runs alternated.

    python bench/predict/cpu_bench.py [--passes 5] [--rows 2400] [--torch-threads 0] [--out results-file-stem]
                                      [--before COMMIT] [--overhead]

The workload (``cpu_workload.py``): compressed documents from a local HTTP object store (no added latency), decoded
and tokenized in 2 DataLoader workers, a 3-layer transformer encoder (width 256, 128 tokens) in the main process on
the same 2 cores, Parquet output. ``--torch-threads 0`` leaves torch's intra-op threads at torch's default (one per
core), as a user who sets nothing runs it; a number sets them with ``torch.set_num_threads``. Every run is a fresh
interpreter; the systems alternate within each pass and the first of them rotates from pass to pass.

Each run also reports where its CPU went: CPU seconds of the main process by thread (Python threads by name, torch's
intra-op threads and others by their OS name), of the DataLoader workers (the main process's children), and of the
object store, per row. Reported: medians of the passes; with ``--out``, also written as JSON and Markdown under
``bench/results/predict/``. ``--before COMMIT`` adds the package of an earlier commit as a third system (its
ElasticPredict at defaults, same harness), to tell what a change did; ``--overhead`` replaces the rows and the model with
near-free ones, leaving what each system costs per batch by itself.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results" / "predict"
sys.path.insert(0, str(HERE))

BATCH = 32
LOADER_WORKERS = 2


# ---- inside one run's interpreter --------------------------------------------------------------------------------


class ThreadCpu:
    """Samples the CPU seconds of every thread of this process (``/proc/self/task``) until stopped; a thread that
    ends keeps its last sample. Python threads are named by ``threading``'s names, others by their OS name."""

    def __init__(self, every_s: float = 0.25) -> None:
        self.every_s = every_s
        self.seconds: dict[int, float] = {}
        self.names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-thread-cpu", daemon=True)
        self._ticks = os.sysconf("SC_CLK_TCK")

    def start(self) -> "ThreadCpu":
        self.sample()
        self.base = dict(self.seconds)
        self._thread.start()
        return self

    def sample(self) -> None:
        py = {t.native_id: t.name for t in threading.enumerate()}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            comm = text[text.index("(") + 1: text.rindex(")")]
            fields = text.rsplit(")", 1)[1].split()
            tid_i = int(tid)
            self.seconds[tid_i] = (int(fields[11]) + int(fields[12])) / self._ticks
            name = py.get(tid_i) or self.names.get(tid_i) or f"os:{comm}"
            self.names[tid_i] = name

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        self.sample()
        by_name: dict[str, float] = {}
        for tid, seconds in self.seconds.items():
            name = self.names[tid]
            # pool threads numbered by Python (lightning-paro-fetch_3, Thread-7 (...)) are summed by their prefix
            key = "main" if tid == os.getpid() else name.split("_")[0].split(" (")[0]
            if key.startswith("lightning-paro-"):  # lightning-paro-<role>-<worker name>
                key = "-".join(key.split("-")[:3])
            by_name[key] = by_name.get(key, 0.0) + seconds - self.base.get(tid, 0.0)
        return {k: round(v, 3) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])}


def _children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class FixedTokens:
    """``--overhead``: the same samples as the workload's (128 token ids and an id), made without work."""

    def __init__(self, rows: int) -> None:
        import torch

        self.rows = rows
        self.tokens = torch.arange(128) % 4096

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int) -> dict:
        return {"tokens": self.tokens.clone(), "id": index}


class MeanEmbedding:
    """``--overhead``: a model that costs almost nothing and returns the workload's output shape."""

    def __new__(cls):
        import torch

        class _Mean(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = torch.nn.Embedding(4096, 256)

            def forward(self, tokens):
                return self.embed(tokens[:, :1]).mean(dim=1)

        return _Mean().eval()


OVERHEAD = os.environ.get("CPU_BENCH_OVERHEAD") == "1"


def _loader(url: str, rows: int):
    from torch.utils.data import DataLoader

    from cpu_workload import StoredDocuments

    dataset = FixedTokens(rows) if OVERHEAD else StoredDocuments(url, rows)
    return DataLoader(dataset, batch_size=BATCH, num_workers=LOADER_WORKERS)


def _module(elastic: bool):
    import lightning as L

    from cpu_workload import build_encoder as _build

    build_encoder = MeanEmbedding if OVERHEAD else _build

    class Encode(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = build_encoder()

        def predict_step(self, batch, batch_idx):
            embedding = self.encoder(batch["tokens"])
            return {"embedding": embedding} if elastic else (batch["id"], embedding)

    return Encode()


def baseline(url: str, rows: int, out: Path) -> dict:
    """Plain Trainer.predict with a BasePredictionWriter writing one Parquet file per batch."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from lightning.pytorch.callbacks import BasePredictionWriter

    from configs import _BatchClock, _embedding_column, _stamping_callback, _timing, _trainer

    class ParquetWriter(BasePredictionWriter):
        def __init__(self) -> None:
            super().__init__(write_interval="batch")

        def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
            ids, embedding = prediction
            table = pa.table({"row_id": pa.array(ids.numpy()), "embedding": _embedding_column(embedding)})
            pq.write_table(table, out / f"batch-{batch_idx:06d}.parquet")

    out.mkdir(parents=True, exist_ok=True)
    clock = _BatchClock()
    trainer = _trainer([ParquetWriter(), _stamping_callback(clock)])
    start = time.perf_counter()
    trainer.predict(_module(elastic=False), dataloaders=_loader(url, rows), return_predictions=False)
    elapsed = time.perf_counter() - start
    written = sum(pq.ParquetFile(p).metadata.num_rows for p in out.glob("*.parquet"))
    return {**_timing(elapsed, start, clock), "rows": written}


def elastic(url: str, rows: int, out: Path, **settings) -> dict:
    """The same Trainer.predict and DataLoader with ElasticPredict (its defaults unless ``settings`` name one)."""
    from configs import _BatchClock, _stamp_worker_batches, _threads_used, _timing, _trainer
    from lightning_paro.predict import ElasticPredict, read_predictions

    clock = _BatchClock()
    _stamp_worker_batches(clock)
    callback = ElasticPredict(str(out), **settings)
    trainer = _trainer([callback])
    start = time.perf_counter()
    trainer.predict(_module(elastic=True), dataloaders=_loader(url, rows))
    elapsed = time.perf_counter() - start
    table = read_predictions(out, columns=["row_id"])
    return {**_timing(elapsed, start, clock), "rows": table.num_rows,
            "unique_rows": len(set(table.column("row_id").to_pylist())),
            "fetch_threads_used": _threads_used(callback.run.fetch_threads_used)}


def run(system: str, url: str, rows: int, out: str, torch_threads: int, settings: dict) -> dict:
    import torch

    if torch_threads:
        torch.set_num_threads(torch_threads)
    threads = ThreadCpu().start()
    cpu0, children0 = time.process_time(), _children_cpu_s()
    if system == "baseline":
        result = baseline(url, rows, Path(out))
    else:
        result = elastic(url, rows, Path(out), **settings)
    result["main_cpu_s"] = round(time.process_time() - cpu0, 3)
    result["loader_workers_cpu_s"] = round(_children_cpu_s() - children0, 3)
    result["main_threads_cpu_s"] = threads.stop()
    result["rows_per_s"] = result["rows"] / result["seconds"]
    result["torch_threads"] = torch.get_num_threads()
    return result


# ---- the harness -------------------------------------------------------------------------------------------------


SYSTEMS = {
    "baseline": ("Trainer.predict + BasePredictionWriter (Parquet file per batch)", "baseline", {}),
    "elastic": ("ElasticPredict, defaults", "elastic", {}),
    "elastic_before": ("ElasticPredict, defaults, the package at the --before commit", "elastic", {}),
}
BEFORE_DIR: dict = {}
"""``--before``: the directory holding the package of the earlier commit (put first on PYTHONPATH for its runs)."""


def run_once(system: str, url: str, rows: int, workdir: Path, torch_threads: int, store_pid: int) -> dict:
    from cpu_split import cpu_seconds

    _, name, settings = SYSTEMS[system]
    out = workdir / f"{system}-{time.monotonic_ns()}"
    code = ("import json, sys; sys.path.insert(0, %r); import cpu_bench; r = cpu_bench.run(%r, %r, %d, %r, %d, "
            "json.loads(%r)); print('RESULT ' + json.dumps(r), flush=True)"
            % (str(HERE), name, url, rows, str(out), torch_threads, json.dumps(settings)))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # torch's default unless --torch-threads
    env["PYTHONWARNINGS"] = "ignore"
    if system == "elastic_before":
        env["PYTHONPATH"] = os.pathsep.join([BEFORE_DIR["path"], *filter(None, [env.get("PYTHONPATH")])])
    store0 = sum(cpu_seconds([store_pid]).values())
    load = os.getloadavg()[0]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1800)
    store_s = sum(cpu_seconds([store_pid]).values()) - store0
    shutil.rmtree(out, ignore_errors=True)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{system} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(line[len("RESULT "):])
    result["object_store_cpu_s"] = round(store_s, 3)
    result["load_avg_1min_before"] = round(load, 2)
    rows = result["rows"]
    result["cpu_ms_per_row"] = {
        "main process": round(1e3 * result["main_cpu_s"] / rows, 3),
        "DataLoader workers": round(1e3 * result["loader_workers_cpu_s"] / rows, 3),
        "object store": round(1e3 * store_s / rows, 3),
    }
    print(f"  {system}: {result['rows_per_s']:.1f} rows/s, {json.dumps(result)}", flush=True)
    return result


def summarize(passes: list[dict]) -> dict:
    out = {}
    for system in SYSTEMS:
        runs = [p[system] for p in passes if system in p]
        if not runs:
            continue
        rates = [r["rows_per_s"] for r in runs]
        threads: dict[str, list[float]] = {}
        for r in runs:
            for name, seconds in r["main_threads_cpu_s"].items():
                threads.setdefault(name, []).append(1e3 * seconds / r["rows"])
        out[system] = {
            "rows_per_s": {"median": statistics.median(rates), "runs": rates},
            "steady_rows_per_s": statistics.median(r.get("steady_rows_per_s", 0) for r in runs),
            "cpu_ms_per_row": {k: statistics.median(r["cpu_ms_per_row"][k] for r in runs)
                               for k in runs[0]["cpu_ms_per_row"]},
            "main_thread_cpu_ms_per_row": {k: round(statistics.median(v + [0.0] * (len(runs) - len(v))), 3)
                                           for k, v in threads.items()},
        }
    for other in ("elastic", "elastic_before"):
        ratios = [p[other]["rows_per_s"] / p["baseline"]["rows_per_s"] for p in passes if other in p and "baseline" in p]
        if ratios:
            out[f"{other}_over_baseline"] = {"median": statistics.median(ratios), "per_pass": ratios}
    return out


def render(results: dict) -> str:
    s, summary = results["settings"], results["summary"]
    lines = [
        "# Compute-bound job with CPU preprocessing: ElasticPredict against plain Trainer.predict",
        "",
        f"Commit {results['commit']}; {results['started_at']} to {results['finished_at']}; machine: "
        f"{results['machine']['cpus']} CPUs ({results['machine']['platform']}, Python {results['machine']['python']}); "
        f"1-minute load average before each run {min(results['loads'])} to {max(results['loads'])}.",
        "",
        f"Settings: {s['passes']} passes, systems alternated (the first rotates each pass), each run a fresh process; "
        f"{s['rows']} rows; compressed JSON documents (600 words) from a local HTTP object store (no added latency, one "
        f"request per row), decompressed, parsed, NFKC-normalised, split by a regular expression and hashed to word and "
        f"bigram ids (128 tokens) in {LOADER_WORKERS} DataLoader workers; batch {BATCH}; a 3-layer transformer encoder "
        f"(width 256, 4 heads) in the main process, torch intra-op threads "
        f"{s['torch_threads'] or 'torch default'} (ran with {results['torch_threads_seen']}); output Parquet. "
        "ElasticPredict at its defaults (SQLite ledger in the output directory, shard size 16 batches, "
        "fetch_threads chosen as it reads).",
        "",
        "| system | rows/s (median) | each pass | rows/s after the first batch (median) | CPU ms per row: main process / "
        "DataLoader workers / object store | main process CPU ms per row by thread |",
        "|---|---|---|---|---|---|",
    ]
    for system, (label, _, _) in SYSTEMS.items():
        if system not in summary:
            continue
        v = summary[system]
        if system == "elastic_before":
            label = label.replace("the --before commit", f"commit {results['settings']['before']}")
        cpu = v["cpu_ms_per_row"]
        by_thread = ", ".join(f"{k} {ms:.2f}" for k, ms in v["main_thread_cpu_ms_per_row"].items() if ms >= 0.005)
        lines.append(f"| {label} | {v['rows_per_s']['median']:.1f} | "
                     f"{', '.join(f'{x:.1f}' for x in v['rows_per_s']['runs'])} | {v['steady_rows_per_s']:.1f} | "
                     f"{cpu['main process']:.2f} / {cpu['DataLoader workers']:.2f} / {cpu['object store']:.2f} | "
                     f"{by_thread} |")
    lines.append("")
    for key, label in (("elastic_over_baseline", "ElasticPredict / Trainer.predict"),
                       ("elastic_before_over_baseline",
                        f"ElasticPredict at commit {s.get('before')} / Trainer.predict")):
        if key in summary:
            r = summary[key]
            lines.append(f"* {label}: **{r['median']:.3f}** (median of the per-pass ratios; "
                         f"{', '.join(f'{x:.3f}' for x in r['per_pass'])})")
    return "\n".join(lines)


def _provenance() -> dict:
    """Commit, date and machine (``bench/provenance.py``), stored with the results."""
    sys.path.insert(0, str(HERE.parent))
    import provenance

    return provenance.stamp()


def main() -> None:
    from object_store import ObjectStore

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--rows", type=int, default=2400)
    parser.add_argument("--torch-threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--systems", default="baseline,elastic")
    parser.add_argument("--out", default=None, help="stem of the result files under bench/results/predict/")
    parser.add_argument("--overhead", action="store_true",
                        help="the same loop with samples made without work and a near-free model: what each system "
                             "costs per batch by itself")
    parser.add_argument("--before", default=None,
                        help="a commit: its package runs as a third system, elastic_before (git archive into a "
                             "temporary directory)")
    args = parser.parse_args()
    if args.overhead:
        os.environ["CPU_BENCH_OVERHEAD"] = "1"
    systems = args.systems.split(",")
    if args.before:
        before = Path(tempfile.mkdtemp(prefix="cpu-bench-before-"))
        archive = subprocess.run(["git", "archive", args.before, "lightning_paro"], capture_output=True,
                                 cwd=HERE.parent.parent, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
        BEFORE_DIR["path"] = str(before)
        systems.append("elastic_before")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "lightning_paro", "bench/predict"],
                           capture_output=True, text=True, cwd=HERE.parent.parent).stdout.strip()
    results: dict = {
        "commit": commit + (" (with uncommitted changes)" if dirty else ""),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "settings": vars(args) | {"batch_size": BATCH, "dataloader_workers": LOADER_WORKERS},
        "started_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "passes": [],
    }
    workdir = Path(tempfile.mkdtemp(prefix="cpu-bench-"))
    try:
        with ObjectStore(0.0) as store:
            # every object made once before the timed runs (a store serves what it holds)
            from concurrent.futures import ThreadPoolExecutor

            from cpu_workload import StoredDocuments

            docs = StoredDocuments(store.url, args.rows)
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(docs.__getitem__, range(args.rows)))
            for p in range(args.passes):
                order = systems[p % len(systems):] + systems[:p % len(systems)]
                entry: dict = {}
                results["passes"].append(entry)
                print(f"pass {p + 1}: {' then '.join(order)}", flush=True)
                for system in order:
                    entry[system] = run_once(system, store.url, args.rows, workdir, args.torch_threads,
                                             store.proc.pid)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if BEFORE_DIR:
            shutil.rmtree(BEFORE_DIR["path"], ignore_errors=True)
    results["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    results["loads"] = [r["load_avg_1min_before"] for p in results["passes"] for r in p.values()]
    results["torch_threads_seen"] = sorted({r["torch_threads"] for p in results["passes"] for r in p.values()})
    if {"baseline", "elastic"} <= set(systems):
        results["summary"] = summarize(results["passes"])
        text = render(results)
        print(text)
        if args.out:
            RESULTS.mkdir(parents=True, exist_ok=True)
            results["provenance"] = _provenance()
            (RESULTS / f"{args.out}.json").write_text(json.dumps(results, indent=1))
            (RESULTS / f"{args.out}.md").write_text(text + "\n")
            print(f"wrote {RESULTS / args.out}.json and .md")


if __name__ == "__main__":
    main()
