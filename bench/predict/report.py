"""Renders bench/results/predict/results.json as the markdown tables used in docs/predict.md."""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "results" / "predict"


def _rate(entry: dict) -> str:
    if "error" in entry:
        return "failed"
    return f"{entry['rows_per_s']:.1f}"


def render(results: dict) -> str:
    lat, comp = results["latency_bound"], results["compute_bound"]
    s = results["settings"]
    lines = [
        f"Settings: {s['rows']} rows (latency-bound) / {s['compute_rows']} rows (compute-bound), batch "
        f"{s['batch_size']}, {s['dataloader_workers']} DataLoader workers, torch threads {s['torch_threads']}, "
        f"{s['latency_ms']:.0f} ms per object request, fetch_threads {s['fetch_threads']}; machine: "
        f"{results['machine']['cpus']} CPUs. Finished {results['finished_at']}.",
        "",
        "Standalone stage throughput (the machine's limits):",
        "",
        f"* read path alone (fetch + preprocess, {2 * s['fetch_threads']} requests in flight): "
        f"{lat['read_limit']['read_rows_per_s']:.0f} rows/s",
        f"* encoder alone (1 thread): {lat['model_limit']['encoder_rows_per_s']:.0f} rows/s; "
        f"scorer alone: {lat['model_limit']['scorer_rows_per_s']:.0f} rows/s",
        "",
        "| workload | configuration | rows/s | vs baseline | rows written (unique) | peak RSS MiB (main + largest child) |",
        "|---|---|---|---|---|---|",
    ]

    def row(workload: str, label: str, entry: dict, base: dict) -> None:
        if "error" in entry:
            lines.append(f"| {workload} | {label} | failed | | | |")
            return
        ratio = entry["rows_per_s"] / base["rows_per_s"]
        unique = entry.get("unique_rows", "")
        extra = f" ({unique})" if unique != "" else ""
        rss = entry.get("peak_rss_mib", "")
        lines.append(f"| {workload} | {label} | {_rate(entry)} | {ratio:.2f}x | {entry['rows']}{extra} | {rss} |")

    b1, bm = lat["baseline_single"], lat["baseline_multi"]
    row("latency-bound, 1 model", "Trainer.predict + BasePredictionWriter", b1, b1)
    row("latency-bound, 1 model", "ElasticPredict, fetch_threads=1", lat["elastic_single_no_fetch_threads"], b1)
    row("latency-bound, 1 model", f"ElasticPredict, fetch_threads={s['fetch_threads']}", lat["elastic_single"], b1)
    if "ray_single" in lat:
        row("latency-bound, 1 model", "Ray Data map_batches, actor pool", lat["ray_single"], b1)
    row("latency-bound, 2 models", "Trainer.predict, both models in predict_step", bm, bm)
    row("latency-bound, 2 models", "ElasticPredict, both models in predict_step", lat["elastic_multi_in_one_step"], bm)
    reps = lat["pipeline_multi"].get("replicas", {})
    row("latency-bound, 2 models", f"run_pipeline, stage replicas {reps}", lat["pipeline_multi"], bm)
    if "ray_multi" in lat:
        row("latency-bound, 2 models", "Ray Data map_batches, actor pool", lat["ray_multi"], bm)
    cb1, cbm = comp["baseline_single"], comp["baseline_multi"]
    row("compute-bound, 1 model", "Trainer.predict + BasePredictionWriter", cb1, cb1)
    row("compute-bound, 1 model", "ElasticPredict", comp["elastic_single"], cb1)
    row("compute-bound, 2 models", "Trainer.predict, both models in predict_step", cbm, cbm)
    reps = comp["pipeline_multi"].get("replicas", {})
    row("compute-bound, 2 models", f"run_pipeline, stage replicas {reps}", comp["pipeline_multi"], cbm)
    kill = lat.get("ray_single_actor_killed")
    if kill:
        lines += ["", f"Ray Data with its model actor SIGKILLed mid-run: {json.dumps(kill)}"]
    return "\n".join(lines)


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS / "results.json"
    print(render(json.loads(path.read_text())))
