"""Renders bench/results/predict/results.json as the markdown used in docs/predict.md."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "results" / "predict"

LABELS = {
    "latency": [
        ("1 model", "baseline_single", "Trainer.predict + BasePredictionWriter, 2 DataLoader workers, serial reads",
         "baseline_single_tuned"),
        ("1 model", "baseline_single_getitems_16", "Trainer.predict + writer, 16 threads in __getitems__ per worker",
         "baseline_single_tuned"),
        ("1 model", "baseline_single_getitems_32", "Trainer.predict + writer, 32 threads in __getitems__ per worker",
         "baseline_single_tuned"),
        ("1 model", "baseline_single_workers_32", "Trainer.predict + writer, 32 DataLoader workers",
         "baseline_single_tuned"),
        ("1 model", "baseline_single_tuned", "**tuned anchor**: the fastest Trainer.predict of the pass",
         "baseline_single_tuned"),
        ("1 model", "elastic_single", "ElasticPredict, defaults (fetch_threads chosen)", "baseline_single_tuned"),
        ("1 model", "elastic_single_fetch_threads_1", "ElasticPredict, fetch_threads=1", "baseline_single_tuned"),
        ("1 model", "elastic_single_fetch_threads_16", "ElasticPredict, fetch_threads=16", "baseline_single_tuned"),
        ("1 model", "ray_single", "Ray Data, tuned (the fastest setting of the pass)", "baseline_single_tuned"),
        ("2 models", "baseline_multi", "Trainer.predict, both models in predict_step, serial reads",
         "baseline_multi_tuned"),
        ("2 models", "baseline_multi_getitems_32", "Trainer.predict, both models, 32 threads in __getitems__ per worker",
         "baseline_multi_tuned"),
        ("2 models", "baseline_multi_workers_32", "Trainer.predict, both models, 32 DataLoader workers",
         "baseline_multi_tuned"),
        ("2 models", "baseline_multi_tuned", "**tuned anchor**: the fastest Trainer.predict of the pass",
         "baseline_multi_tuned"),
        ("2 models", "elastic_multi_in_one_step", "ElasticPredict, defaults, both models in predict_step",
         "baseline_multi_tuned"),
        ("2 models", "pipeline_multi", "run_pipeline, defaults, one process per stage", "baseline_multi_tuned"),
        ("2 models", "ray_multi", "Ray Data, one actor pool per model, tuned (the fastest setting of the pass)",
         "baseline_multi_tuned"),
    ],
    "compute": [
        ("1 model", "model_limit", "the model stage alone (inputs in memory)", None),
        ("1 model", "baseline_single", "Trainer.predict + BasePredictionWriter", "baseline_single"),
        ("1 model", "elastic_single", "ElasticPredict, defaults (fetch_threads chosen)", "baseline_single"),
        ("1 model", "elastic_single_fetch_threads_16", "ElasticPredict, fetch_threads=16", "baseline_single"),
        ("2 models", "baseline_multi", "Trainer.predict, both models in predict_step", "baseline_multi"),
        ("2 models", "pipeline_multi", "run_pipeline, defaults, one process per stage", "baseline_multi"),
        ("2 models, light second stage", "model_limit_light", "the slower stage alone (inputs in memory)", None),
        ("2 models, light second stage", "baseline_multi_light", "Trainer.predict, both models in predict_step",
         "baseline_multi_light"),
        ("2 models, light second stage", "pipeline_multi_light", "run_pipeline, defaults, one process per stage",
         "baseline_multi_light"),
    ],
}


def _runs(passes: list, workload: str, key: str) -> list:
    return [p[workload][key] for p in passes if key in p.get(workload, {})]


def _median(values: list):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt(value, digits: int = 1) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def _threads(runs: list) -> str:
    counts: dict = {}
    for run in runs:
        for threads, batches in run.get("fetch_threads_used", {}).items():
            counts[threads] = counts.get(threads, 0) + batches
    total = sum(counts.values())
    if not total:
        return ""
    shown = sorted(counts.items(), key=lambda kv: -kv[1])[:3]
    return ", ".join(f"{t}: {100 * n / total:.0f}%" for t, n in shown)


def render(results: dict) -> str:
    s, passes = results["settings"], results["passes"]
    loads = [r.get("load_avg_1min") for p in passes for w in ("latency", "compute") for r in p.get(w, {}).values()
             if isinstance(r, dict) and r.get("load_avg_1min") is not None]
    lines = [
        f"Settings: {s['passes']} passes (medians of the passes; ratios: median of the per-pass ratios), "
        f"{s['rows']} rows latency-bound / {s['compute_rows']} rows compute-bound, batch {s['batch_size']}, "
        f"{s['dataloader_workers']} DataLoader workers, torch threads {s['torch_threads']} per process, "
        f"{s['latency_ms']:.0f} ms per object request, shards of {s['shard_size']} rows, SQLite ledger, "
        f"ElasticPredict and run_pipeline fetch_threads: their default (chosen as they read) unless a row names it; "
        f"run_pipeline max_replicas 2 (one process per stage); machine: {results['machine']['cpus']} CPUs; "
        f"1-minute load average after each run {min(loads):.1f} to {max(loads):.1f}. "
        f"Ran {results.get('started_at', '?')} to {results['finished_at']}, commit {results.get('commit', '?')}.",
        "",
        "Anchors: plain Trainer.predict writes a Parquet file per batch from a BasePredictionWriter; latency-bound, it "
        "is run with the I/O concurrency its users would give it (a thread pool in the dataset's __getitems__, or 32 "
        "DataLoader workers), and the fastest of those in each pass is the tuned anchor. Ray Data "
        f"{results.get('ray_version', '')}: ray.init once before the timing (logical CPUs: enough for every actor of "
        "the largest setting, 4 for one model and 6 for two), then "
        "map_batches with an actor pool for fetch + preprocess (2 actors of half a CPU, 32 requests in flight each) and "
        "one actor pool per model stage (actors of 1 CPU and 1 torch thread), timed from building the dataset to the "
        "end of write_parquet; batch size (32, 128) and actors per model stage (1, 2) are tuned: every setting runs in "
        "each pass and the fastest is reported.",
        "",
    ]
    reads = [p["latency"]["read_limit"]["read_rows_per_s"] for p in passes if "read_limit" in p.get("latency", {})]
    models = _runs(passes, "compute", "model_limit")
    lines += ["Stage limits (medians):", ""]
    if reads:
        lines.append(f"* read path alone (fetch + preprocess, 32 requests in flight): {_median(reads):.0f} rows/s")
    if models:
        lines.append(
            f"* encoder alone (batch {s['batch_size']}, 1 thread, inputs in memory): "
            f"{_median([m['encoder_rows_per_s'] for m in models]):.0f} rows/s; scorer alone: "
            f"{_median([m['scorer_rows_per_s'] for m in models]):.0f} rows/s"
        )
    light = _runs(passes, "compute", "model_limit_light")
    if light:
        lines.append(f"* light second stage (the scorer with 2 layers, not 6) alone: "
                     f"{_median([m['scorer_rows_per_s'] for m in light]):.0f} rows/s (encoder in that run: "
                     f"{_median([m['encoder_rows_per_s'] for m in light]):.0f} rows/s)")
    lines += [
        "",
        "| workload | configuration | rows/s, whole run (median) | each pass | rows/s after the first batch | vs "
        "baseline (median of per-pass ratios) | fetch threads per DataLoader worker (share of batches) | rows "
        "written (unique) | peak RSS MiB (main + largest child) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for workload, title in (("latency", "latency-bound"), ("compute", "compute-bound")):
        for models_label, key, label, base_key in LABELS[workload]:
            runs = _runs(passes, workload, key)
            if not runs:
                continue
            if any("error" in r for r in runs):
                lines.append(f"| {title}, {models_label} | {label} | failed: see results.json | | | | | | |")
                continue
            rates = [r["rows_per_s"] for r in runs]
            steady = _median([r.get("steady_rows_per_s") for r in runs])
            ratio = ""
            if base_key is not None:
                per_pass = [p[workload][key]["rows_per_s"] / p[workload][base_key]["rows_per_s"] for p in passes
                            if key in p.get(workload, {}) and base_key in p[workload]]
                ratio = f"{_median(per_pass):.2f}x ({min(per_pass):.2f} to {max(per_pass):.2f})"
            written = ""
            if "rows" in runs[0]:
                unique = runs[0].get("unique_rows")
                written = f"{runs[0]['rows']}" + (f" ({unique})" if unique is not None else "")
                if any(r["rows"] != runs[0]["rows"] or r.get("unique_rows", r["rows"]) != r["rows"] for r in runs):
                    written += ", not in every pass"
            rss = _median([r.get("peak_rss_mib") for r in runs])
            if key.endswith("_tuned") or key.startswith("ray_"):
                won = [r.get("setting") or f"batch {r.get('batch_size')}, {r.get('model_actors')} actor(s) per model"
                       for r in runs]
                label += f" (won: {'; '.join(won)})"
            lines.append(
                f"| {title}, {models_label} | {label} | {_median(rates):,.1f} | "
                f"{', '.join(f'{r:,.0f}' for r in rates)} | {_fmt(steady)} | {ratio} | {_threads(runs)} | {written} | "
                f"{_fmt(rss)} |"
            )
    summary = results.get("summary", {}).get("ratios", {})
    if summary:
        lines += ["", "Ratios of the acceptance criteria (median of the per-pass ratios; each pass in brackets):", ""]
        for label, value in summary.items():
            lines.append(f"* {label}: **{value['median']:.3f}** ({', '.join(f'{v:.3f}' for v in value['per_pass'])})")
    kill = results.get("ray_single_actor_killed")
    if kill:
        lines += ["", f"Ray Data with its model actor SIGKILLed mid-run: {json.dumps(kill)}"]
    return "\n".join(lines)


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS / "results.json"
    print(render(json.loads(path.read_text())))
