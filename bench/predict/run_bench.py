"""Batch-prediction benchmark: plain Trainer.predict + BasePredictionWriter vs ElasticPredict / run_pipeline.

    python bench/predict/run_bench.py [--passes 3] [--rows 1500] [--compute-rows 6000] [--latency-ms 30]
                                      [--ray-python PY]

Starts a local HTTP object store (127.0.0.1, fixed latency per request) for the latency-bound read path and runs
every configuration in a fresh process, ``--passes`` times, in an order that rotates from pass to pass so that the
machine's busy spells hit every configuration alike. ElasticPredict and run_pipeline run with their default
``fetch_threads`` (chosen as they read) unless a row says otherwise. Plain Trainer.predict runs latency-bound with
the I/O concurrency its users would give it (``LATENCY_ANCHORS``: a thread pool in ``__getitems__`` or more DataLoader
workers; the fastest in each pass is the tuned anchor), and Ray Data (``ray_bench.py``) with ``ray.init`` before the
timing and its batch size and actors per model stage tuned. The compute-bound pass also measures the model stage alone
(inputs in memory, same batch, one thread). Reported: the median of the passes for each rate, and the
median of the per-pass ratios. Writes ``bench/results/predict/results.json`` and ``results.md``. Run it inside a
private network namespace (``unshare --net``, see run.sh) so that Ray's listeners stay off the network.
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
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results" / "predict"
sys.path.insert(0, str(HERE))

from object_store import ObjectStore  # noqa: E402
from report import render  # noqa: E402

# (key, configuration, keyword arguments): every ElasticPredict and run_pipeline setting not named is its default
# plain Trainer.predict as its users would tune it for latency-bound reads: a thread pool in the dataset's
# __getitems__ (16 or 32 per DataLoader worker; ElasticPredict's default settles on 32), or as many DataLoader workers
# as ElasticPredict has fetch threads per worker (32); the fastest of them in each pass is the tuned anchor
LATENCY_ANCHORS = {
    "single": [("baseline_single_getitems_16", {"getitems_threads": 16}),
               ("baseline_single_getitems_32", {"getitems_threads": 32}),
               ("baseline_single_workers_32", {"loader_workers": 32})],
    "multi": [("baseline_multi_getitems_32", {"getitems_threads": 32}),
              ("baseline_multi_workers_32", {"loader_workers": 32})],
}
LATENCY = [
    ("baseline_single", "baseline", {"multi": False}),
    *[(key, "baseline", {"multi": False, **kw}) for key, kw in LATENCY_ANCHORS["single"]],
    ("elastic_single", "elastic", {"multi": False}),
    ("elastic_single_fetch_threads_16", "elastic", {"multi": False, "fetch_threads": 16}),
    ("baseline_multi", "baseline", {"multi": True}),
    *[(key, "baseline", {"multi": True, **kw}) for key, kw in LATENCY_ANCHORS["multi"]],
    ("elastic_multi_in_one_step", "elastic", {"multi": True}),
    ("pipeline_multi", "pipeline", {"max_replicas": 2}),
]
COMPUTE = [
    ("model_limit", "model_limit", {"multi": True, "measure_rows": 1280}),
    ("baseline_single", "baseline", {"multi": False}),
    ("elastic_single", "elastic", {"multi": False}),
    ("elastic_single_fetch_threads_16", "elastic", {"multi": False, "fetch_threads": 16}),
    ("baseline_multi", "baseline", {"multi": True}),
    ("pipeline_multi", "pipeline", {"max_replicas": 2}),
    # two models whose CPU time together leaves room on two cores (the second a third of the first)
    ("model_limit_light", "model_limit", {"multi": True, "measure_rows": 1280, "scorer_layers": 2}),
    ("baseline_multi_light", "baseline", {"multi": True, "scorer_layers": 2}),
    ("pipeline_multi_light", "pipeline", {"max_replicas": 2, "scorer_layers": 2}),
]
# the ratios of the acceptance criteria: (name, numerator, denominator), keys as "workload.configuration.measure"
RATIOS = [
    ("compute-bound, 1 model: ElasticPredict / Trainer.predict + writer",
     "compute.elastic_single.rows_per_s", "compute.baseline_single.rows_per_s"),
    ("compute-bound, 1 model: ElasticPredict / the model stage alone (whole run)",
     "compute.elastic_single.rows_per_s", "compute.model_limit.encoder_rows_per_s"),
    ("compute-bound, 1 model: ElasticPredict / the model stage alone (after the first batch)",
     "compute.elastic_single.steady_rows_per_s", "compute.model_limit.encoder_rows_per_s"),
    ("compute-bound, 1 model: Trainer.predict + writer / the model stage alone (whole run)",
     "compute.baseline_single.rows_per_s", "compute.model_limit.encoder_rows_per_s"),
    ("compute-bound, 2 models: run_pipeline / the slowest stage alone (whole run)",
     "compute.pipeline_multi.rows_per_s", "compute.model_limit.rows_per_s"),
    ("compute-bound, 2 models: run_pipeline / the slowest stage alone (after the first batch)",
     "compute.pipeline_multi.steady_rows_per_s", "compute.model_limit.rows_per_s"),
    ("compute-bound, 2 models: run_pipeline / Trainer.predict with both models",
     "compute.pipeline_multi.rows_per_s", "compute.baseline_multi.rows_per_s"),
    ("compute-bound, 2 models, light second stage: run_pipeline / the slowest stage alone (whole run)",
     "compute.pipeline_multi_light.rows_per_s", "compute.model_limit_light.rows_per_s"),
    ("compute-bound, 2 models, light second stage: run_pipeline / the slowest stage alone (after the first batch)",
     "compute.pipeline_multi_light.steady_rows_per_s", "compute.model_limit_light.rows_per_s"),
    ("compute-bound, 2 models, light second stage: run_pipeline / Trainer.predict with both models",
     "compute.pipeline_multi_light.rows_per_s", "compute.baseline_multi_light.rows_per_s"),
    ("latency-bound, 1 model: ElasticPredict (defaults) / Trainer.predict + writer, tuned I/O concurrency",
     "latency.elastic_single.rows_per_s", "latency.baseline_single_tuned.rows_per_s"),
    ("latency-bound, 1 model: ElasticPredict (defaults) / Ray Data, tuned",
     "latency.elastic_single.rows_per_s", "latency.ray_single.rows_per_s"),
    ("latency-bound, 2 models: run_pipeline (defaults) / Trainer.predict with both models, tuned I/O concurrency",
     "latency.pipeline_multi.rows_per_s", "latency.baseline_multi_tuned.rows_per_s"),
    ("latency-bound, 2 models: run_pipeline (defaults) / Ray Data, one actor pool per model, tuned",
     "latency.pipeline_multi.rows_per_s", "latency.ray_multi.rows_per_s"),
    ("latency-bound, 1 model: ElasticPredict (defaults) / Trainer.predict + writer, 2 serial DataLoader workers",
     "latency.elastic_single.rows_per_s", "latency.baseline_single.rows_per_s"),
]


def pick_tuned(lat: dict) -> None:
    """Adds ``baseline_<models>_tuned``: the fastest plain Trainer.predict of this pass (the serial one included),
    with the key of the setting it was."""
    for models in ("single", "multi"):
        keys = [f"baseline_{models}"] + [key for key, _ in LATENCY_ANCHORS[models]]
        runs = {k: lat[k] for k in keys if k in lat and "rows_per_s" in lat[k]}
        if runs:
            best = max(runs, key=lambda k: runs[k]["rows_per_s"])
            lat[f"baseline_{models}_tuned"] = {**runs[best], "setting": best}


def configuration_command(name: str, url, rows: int, out: Path, kwargs: dict) -> tuple[list[str], dict]:
    """The command and environment that run one configuration of ``configs.py`` in a fresh interpreter and print
    its result as a ``RESULT {json}`` line."""
    code = (
        "import json, sys; sys.path.insert(0, %r); import configs; from pathlib import Path; "
        "r = configs.run(%r, %r, %d, Path(%r), **json.loads(%r)); print('RESULT ' + json.dumps(r), flush=True)"
        % (str(HERE), name, url, rows, str(out), json.dumps(kwargs))
    )
    return [sys.executable, "-c", code], {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def run_once(name: str, url, rows: int, workdir: Path, **kwargs) -> dict:
    """Runs one configuration in a fresh interpreter (own memory, no state shared with other runs)."""
    out = workdir / f"{name}-{len(list(workdir.iterdir()))}"
    command, env = configuration_command(name, url, rows, out, kwargs)
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(line[len("RESULT "):])
    result.pop("pid", None)
    result["load_avg_1min"] = round(os.getloadavg()[0], 2)
    shutil.rmtree(out, ignore_errors=True)
    print(f"  {name} {kwargs}: {json.dumps(result)}", flush=True)
    return result


def run_ray(python: str, url: str, rows: int, workdir: Path, multi: bool, kill_after=None) -> dict:
    out = workdir / f"ray-{'multi' if multi else 'single'}-{'kill' if kill_after else 'clean'}-{time.monotonic_ns()}"
    command = [python, str(HERE / "ray_bench.py"), "--url", url, "--rows", str(rows), "--out", str(out)]
    if multi:
        command.append("--multi")
    if kill_after is not None:
        command += ["--kill-after", str(kill_after)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    except subprocess.TimeoutExpired as exc:
        return {"error": f"Ray run did not finish within 600 s: {str(exc.stderr or '')[-1500:]}"}
    finally:
        shutil.rmtree(out, ignore_errors=True)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        return {"error": (proc.stdout[-1000:] + proc.stderr[-3000:]).strip()}
    result = json.loads(line[len("RESULT "):])
    result["load_avg_1min"] = round(os.getloadavg()[0], 2)
    print(f"  ray multi={multi} kill={kill_after}: best {result['rows_per_s']:.1f} rows/s at batch "
          f"{result['batch_size']}, {result['model_actors']} actor(s) per model stage; {json.dumps(result)}", flush=True)
    return result


def _commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "lightning_paro", "bench/predict"],
                           capture_output=True, text=True, cwd=HERE.parent.parent).stdout.strip()
    return head.strip() + (" (with uncommitted changes)" if dirty else "")


def rotated(items: list, shift: int) -> list:
    shift %= len(items)
    return items[shift:] + items[:shift]


def lookup(entry: dict, path: str):
    workload, key, measure = path.split(".")
    value = entry.get(workload, {}).get(key, {})
    return value.get(measure) if isinstance(value, dict) else None


def summarize(passes: list[dict]) -> dict:
    """Medians over the passes: of every rate, and of the per-pass ratios of the acceptance criteria."""
    rates: dict = {}
    for entry in passes:
        for workload in ("latency", "compute"):
            for key, result in entry.get(workload, {}).items():
                for measure, value in result.items():
                    if measure.endswith("rows_per_s") and isinstance(value, (int, float)):
                        rates.setdefault(f"{workload}.{key}.{measure}", []).append(value)
    ratios = {}
    for label, num, den in RATIOS:
        values = [lookup(e, num) / lookup(e, den) for e in passes if lookup(e, num) and lookup(e, den)]
        if values:
            ratios[label] = {"median": statistics.median(values), "per_pass": values}
    return {
        "rates": {k: {"median": statistics.median(v), "runs": v} for k, v in rates.items()},
        "ratios": ratios,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--passes", type=int, default=3, help="runs of every configuration (medians are reported)")
    parser.add_argument("--rows", type=int, default=1500, help="rows of the latency-bound runs")
    parser.add_argument("--compute-rows", type=int, default=6000, help="rows of the compute-bound runs")
    parser.add_argument("--latency-ms", type=float, default=30.0)
    parser.add_argument("--ray-python", default=None, help="an interpreter with ray[data] installed")
    parser.add_argument("--skip-latency", action="store_true", help="only the compute-bound pass")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "settings": vars(args) | {"batch_size": 32, "dataloader_workers": 2, "torch_threads": 1, "shard_size": 256,
                                  "latency_anchors": LATENCY_ANCHORS},
        "commit": _commit(),
        "started_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "passes": [],
    }
    if args.ray_python:
        results["ray_version"] = subprocess.run([args.ray_python, "-c", "import ray; print(ray.__version__)"],
                                                capture_output=True, text=True).stdout.strip()
    workdir = Path(tempfile.mkdtemp(prefix="predict-bench-"))
    try:
        with ObjectStore(args.latency_ms) as store:
            for p in range(args.passes):
                entry: dict = {"latency": {}, "compute": {}}
                results["passes"].append(entry)
                if not args.skip_latency:
                    print(f"pass {p + 1}: latency-bound read path ({args.latency_ms} ms per row), {args.rows} rows",
                          flush=True)
                    lat = entry["latency"]
                    lat["read_limit"] = run_once("read_limit", store.url, 600, workdir, concurrency=32)
                    for key, name, kwargs in rotated(LATENCY, p):
                        lat[key] = run_once(name, store.url, args.rows, workdir, **kwargs)
                    pick_tuned(lat)
                    if args.ray_python:
                        lat["ray_single"] = run_ray(args.ray_python, store.url, args.rows, workdir, multi=False)
                        lat["ray_multi"] = run_ray(args.ray_python, store.url, args.rows, workdir, multi=True)
                print(f"pass {p + 1}: compute-bound (records generated locally), {args.compute_rows} rows", flush=True)
                comp = entry["compute"]
                for key, name, kwargs in rotated(COMPUTE, p):
                    comp[key] = run_once(name, None, args.compute_rows, workdir, **kwargs)
            if args.ray_python and not args.skip_latency:
                results["ray_single_actor_killed"] = run_ray(args.ray_python, store.url, args.rows, workdir,
                                                             multi=False, kill_after=4.0)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["summary"] = summarize(results["passes"])
    results["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    sys.path.insert(0, str(HERE.parent))
    import provenance

    results["provenance"] = provenance.stamp()
    (RESULTS / "results.json").write_text(json.dumps(results, indent=1))
    text = render(results)
    (RESULTS / "results.md").write_text(text + "\n")
    print(text)
    print(f"wrote {RESULTS / 'results.json'} and results.md")


if __name__ == "__main__":
    main()
