"""Loss curves of every communication option beside the exact (fp32) run: the demo GPT under IIG on 4 CPU processes
(2 groups of 2), from the same initial weights on the same batches, one fit per option in the same processes.

Writes bench/results/train/comm_curves.json (per-step training loss, averaged over the ranks, and the mean of the
last 50 steps per option) and comm_curves.png. Lightning's subprocess launcher starts the other ranks by running this
script again, so each rank runs the same fits in the same order.

Usage (root): ``python bench/train/comm_curves.py [--steps 400] [--layers 2] [--dim 32] [--plot-only]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import lightning as L

from lightning_paro import PaROStrategy
from lightning_paro.demo import StdlibData
from lightning_paro.demo.task import GPTTask

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "train"
OPTIONS: dict[str, dict] = {
    "fp32 (exact)": {},
    "bf16": {"param_dtype": "bf16", "reduce_dtype": "bf16"},
    "int8 between groups": {"inter_quant": "int8"},
    "int8 + error feedback": {"inter_quant": "int8", "error_feedback": True},
    "bf16 + int8": {"param_dtype": "bf16", "reduce_dtype": "bf16", "inter_quant": "int8"},
}
"""Each curve's strategy options."""
LAST = 50
"""The final loss of a run is the mean training loss of its last LAST steps."""


class StepLosses(L.Callback):
    """The training loss of every optimizer step, averaged over the ranks."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(trainer.strategy.reduce(outputs["loss"].detach().clone(), reduce_op="mean").item())


def fit_once(options: dict, args: argparse.Namespace) -> list[float]:
    L.seed_everything(0, verbose=False)
    model = GPTTask(seq_len=32, dim=args.dim, heads=2, layers=args.layers, lr=3e-3)
    data = StdlibData(seq_len=32, train_bytes=200_000, held_out_bytes=20_000, batch_size=4)
    record = StepLosses()
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=PaROStrategy(sharding="IIG", group_size=2, **options),
                        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, gradient_clip_val=1.0, callbacks=[record])
    trainer.fit(model, datamodule=data)
    return record.losses


def plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, diff) = plt.subplots(1, 2, figsize=(11, 4))
    exact = curves["fp32 (exact)"]
    for color, (name, losses) in enumerate(curves.items()):
        smooth = [statistics.mean(losses[max(0, i - 9):i + 1]) for i in range(len(losses))]
        ax.plot(range(1, len(losses) + 1), smooth, label=name, linewidth=1, color=f"C{color}")
        if name != "fp32 (exact)":
            gap = [statistics.mean(losses[max(0, i - 9):i + 1]) - statistics.mean(exact[max(0, i - 9):i + 1])
                   for i in range(len(losses))]
            diff.plot(range(1, len(losses) + 1), gap, label=name, linewidth=1, color=f"C{color}")
    ax.set(xlabel="optimizer step", ylabel="training loss (mean of 10 steps)", title="IIG, 2 groups of 2")
    diff.axhline(0, color="black", linewidth=0.5)
    diff.set(xlabel="optimizer step", ylabel="loss minus the fp32 run's (mean of 10 steps)")
    ax.legend(fontsize=8)
    diff.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--plot-only", action="store_true", help="redraw the png from the saved json")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads((RESULTS / "comm_curves.json").read_text())["losses"], RESULTS / "comm_curves.png")
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    curves = {name: fit_once(options, args) for name, options in OPTIONS.items()}
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return
    exact_final = statistics.mean(curves["fp32 (exact)"][-LAST:])
    summary = {name: {"final_loss": statistics.mean(losses[-LAST:]),
                      "vs_fp32": statistics.mean(losses[-LAST:]) - exact_final,
                      "options": OPTIONS[name]} for name, losses in curves.items()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "comm_curves.json").write_text(json.dumps({"steps": args.steps, "layers": args.layers, "dim": args.dim,
                                                          "last": LAST, "summary": summary, "losses": curves},
                                                         indent=1))
    plot(curves, RESULTS / "comm_curves.png")
    for name, s in summary.items():
        print(f"{name:24s} final loss (mean of last {LAST}) {s['final_loss']:.4f}  vs fp32 {s['vs_fp32']:+.4f}",
              flush=True)


if __name__ == "__main__":
    main()
