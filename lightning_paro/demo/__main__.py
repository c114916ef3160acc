"""The demo a newcomer runs first: the whole mission on one machine, through the package's own command line.

1. ``fit``: a small GPT-style byte-level language model trained with the PaRO strategy (IIG) on 4 CPU processes
   arranged as 2 groups of 2, on the Python standard library's own source files, with a progress bar and the loss
   and traffic per step logged; a checkpoint at the end.
2. ``predict``: elastic batch prediction (``lightning_paro.predict.ElasticPredict``) scoring held-out files with that
   checkpoint, per-file bits per byte written to Parquet.
3. A final summary: the loss curve, the bytes each rank moved inside and between groups per optimizer step, the
   model-state memory per rank, and where every output is.

Usage: ``python -m lightning_paro.demo [HYDRA OVERRIDES...]`` (e.g. ``strategy.sharding=NIG``); the overrides go to
both commands.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

DEFAULTS = ["strategy=paro", "strategy.sharding=IIG", "strategy.group_size=2", "trainer=cpu4", "run.name=demo"]


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


def _run_dir(overrides: list[str]) -> Path:
    for o in overrides:
        if o.startswith("run.dir="):
            return Path(o.split("=", 1)[1])
    name = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("run.name=")), "demo")
    return Path("runs") / name


def main(argv: list[str] | None = None) -> None:
    overrides = list(sys.argv[1:] if argv is None else argv)
    if any(o in ("-h", "--help") for o in overrides):
        print(__doc__)
        return
    _run("fit", overrides)
    _run("predict", overrides)
    run_dir = _run_dir(overrides).resolve()
    fit = json.loads((run_dir / "summary.json").read_text())
    pred = json.loads((run_dir / "predict.json").read_text())
    mem = fit.get("memory_bytes_rank0", {})
    lines = [
        "",
        "=" * 78,
        f"demo summary: {fit['strategy']} on {fit['world_size']} processes, {fit['optimizer_steps']} optimizer steps"
        f" in {fit['seconds']} s",
        f"  loss curve (rank 0): {_curve(fit['loss_per_step_rank0'])}",
    ]
    if fit.get("val_bits_per_byte") is not None:
        lines.append(f"  held-out bits per byte after training: {fit['val_bits_per_byte']:.3f}")
    if "intra_bytes_per_step" in fit:
        lines.append(f"  bytes sent per optimizer step by each rank: {_mb(fit['intra_bytes_per_step'])} inside its"
                     f" group, {_mb(fit['inter_bytes_per_step'])} between groups")
    if mem:
        lines.append(f"  model states on rank 0: parameters {_mb(mem['params'])}, gradients {_mb(mem['grads'])},"
                     f" optimizer {_mb(mem['optim'])}")
    lines += [
        f"  batch prediction: {pred['files']} held-out files scored, {pred['bits_per_byte']:.3f} bits per byte"
        f" (easiest {Path(pred['easiest']).name}, hardest {Path(pred['hardest']).name})",
        "  outputs:",
        f"    checkpoint   {fit['checkpoint']}",
        f"    predictions  {pred['output_dir']}  (lightning_paro.predict.read_predictions)",
        f"    logs         {fit['logs']}",
        f"    summaries    {run_dir / 'summary.json'}, {run_dir / 'predict.json'}",
        "=" * 78,
    ]
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
