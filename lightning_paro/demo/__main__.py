"""The demo a newcomer runs first: the whole mission on one machine, through the package's own command line.

1. ``fit experiment=demo``: a small GPT-style byte-level language model trained with the PaRO strategy (IIG) on 4
   CPU processes arranged as 2 groups of 2, on the Python standard library's own source files, with a progress bar
   and the loss and traffic per step logged; a checkpoint at the end.
2. ``predict experiment=demo``: elastic batch prediction (``lightning_paro.predict.ElasticPredict``) scoring held-out
   files with that checkpoint, per-file bits per byte written to Parquet.
3. A final summary: the loss curve, the bytes each rank moved inside and between groups per optimizer step, the
   model-state memory per rank, and where every output is; with matplotlib installed, the same as a plot
   (``summary.png`` beside ``summary.json``).

Usage: ``python -m lightning_paro.demo [HYDRA OVERRIDES...]`` (e.g. ``strategy.sharding=NIG``); the overrides go to
both commands, after ``experiment=demo``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

DEFAULTS = ["experiment=demo"]
PLOT_FILE = "summary.png"


def _run(command: str, overrides: list[str]) -> None:
    cmd = [sys.executable, "-m", "lightning_paro", command, *DEFAULTS, *overrides]
    print(f"\n$ python -m lightning_paro {command} {' '.join(DEFAULTS + overrides)}", flush=True)
    done = subprocess.run(cmd)
    if done.returncode != 0:
        raise SystemExit(f"demo: `{command}` failed with exit code {done.returncode}")


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def _curve(losses: list[float], points: int = 12) -> str:
    k = max(1, len(losses) // points)
    means = [sum(losses[i:i + k]) / len(losses[i:i + k]) for i in range(0, len(losses), k)]
    return " ".join(f"{x:.2f}" for x in means) + f"   (mean per {k} optimizer step{'s' if k > 1 else ''})"


def write_plot(fit: dict, path: Path) -> Optional[Path]:
    """Loss per optimizer step and bytes sent per step inside and between groups (rank 0), as a PNG; None when
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    losses = fit.get("loss_per_step_rank0") or []
    traffic = fit.get("traffic_per_step_rank0") or {}
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), constrained_layout=True)
    left.plot(range(1, len(losses) + 1), losses, color="tab:blue")
    left.set(title="training loss (rank 0)", xlabel="optimizer step", ylabel="cross-entropy (nats per byte)")
    if traffic:
        steps = range(1, len(traffic["intra"]) + 1)
        right.plot(steps, [b / 1e6 for b in traffic["intra"]], label="inside its group", color="tab:green")
        right.plot(steps, [b / 1e6 for b in traffic["inter"]], label="between groups", color="tab:red")
        right.legend()
    right.set(title="bytes sent per optimizer step (rank 0)", xlabel="optimizer step", ylabel="MB")
    right.set_ylim(bottom=0)
    fig.suptitle(f"{fit['strategy']} on {fit['world_size']} processes")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _validation_bytes(cfg, world_size: int) -> int:
    """Bytes the validation at the end of fit scored: limit_val_batches batches per rank, or all held-out windows."""
    from lightning_paro.demo.data import split_files

    data = cfg.data
    _, held_out = split_files(data["train_bytes"], data["held_out_bytes"])
    windows = (sum(p.stat().st_size for p in held_out) + len(held_out) - 1) // (data["seq_len"] + 1)
    limit = cfg.trainer.get("limit_val_batches", 1.0)
    if isinstance(limit, int):
        windows = min(windows, world_size * limit * data["val_batch_size"])
    return windows * data["seq_len"]


def main(argv: list[str] | None = None) -> None:
    overrides = list(sys.argv[1:] if argv is None else argv)
    if any(o in ("-h", "--help") for o in overrides):
        print(__doc__)
        return
    _run("fit", overrides)
    _run("predict", overrides)
    from lightning_paro.cli.compose import load_config
    from lightning_paro.predict import read_predictions

    cfg = load_config(DEFAULTS + overrides)
    run_dir = Path(cfg.run.dir)
    fit = json.loads((run_dir / "summary.json").read_text())
    pred = json.loads((run_dir / "predict.json").read_text())
    rows = read_predictions(pred["output_dir"]).to_pylist()
    scored = sum(r["bytes_scored"] for r in rows)
    per_file = sum(r["bits_per_byte"] * r["bytes_scored"] for r in rows) / max(1, scored)
    ranked = sorted(rows, key=lambda r: r["bits_per_byte"])
    mem = fit.get("memory_bytes_rank0", {})
    val = fit.get("validation", {}).get("val_bits_per_byte")
    data = cfg.data or {}
    lines = [
        "",
        "=" * 78,
        f"demo summary: {fit['strategy']} on {fit['world_size']} processes, {fit['optimizer_steps']} optimizer steps"
        f" in {fit['seconds']} s",
        f"  loss curve (rank 0): {_curve(fit['loss_per_step_rank0'])}",
    ]
    if "intra_bytes_per_step" in fit:
        lines.append(f"  bytes sent per optimizer step by each rank: {_mb(fit['intra_bytes_per_step'])} inside its"
                     f" group, {_mb(fit['inter_bytes_per_step'])} between groups")
    if mem:
        lines.append(f"  model states on rank 0: parameters {_mb(mem['params'])}, gradients {_mb(mem['grads'])},"
                     f" optimizer {_mb(mem['optim'])}")
    seq = data.get("seq_len")
    lines.append(f"  held-out bits per byte (8: no better than chance), each byte predicted from the bytes before it in"
                 f" its {seq}-byte window:")
    if val is not None:
        lines.append(f"    {val:.3f}  validation at the end of fit: {_validation_bytes(cfg, fit['world_size']):,}"
                     " bytes of the held-out files run together, from the start")
    lines += [
        f"    {per_file:.3f}  predict: {scored:,} bytes, the first {data.get('max_bytes_per_file')} of each of the"
        f" {len(rows)} held-out files (easiest {Path(ranked[0]['path']).name}, hardest"
        f" {Path(ranked[-1]['path']).name})" if rows else "    predict wrote no rows",
        "    the same model on different bytes of the same files: the two figures are not expected to agree",
    ]
    plot = write_plot(fit, run_dir / PLOT_FILE)
    lines += [
        "  outputs:",
        f"    checkpoint   {fit['checkpoint']}",
        f"    predictions  {pred['output_dir']}  (Parquet: pandas.read_parquet, pyarrow, DuckDB)",
        f"    logs         {fit['logs']}",
        f"    summaries    {run_dir / 'summary.json'}, {run_dir / 'predict.json'}",
        f"    plot         {plot}" if plot else "    plot         (pip install matplotlib for summary.png)",
        "=" * 78,
    ]
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
