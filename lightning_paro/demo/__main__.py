"""The demo: a small GPT trained with the PaRO strategy on 4 CPU processes (2 groups of 2) on Python's own source.

Run ``python -m lightning_paro.demo`` (or ``bash scripts/demo.sh``). It prints a loss curve, the bytes moved inside
and between groups per optimizer step, the model-state memory per rank, and where the outputs are.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import lightning as L
from lightning_paro import PaROStrategy
from lightning_paro.demo.data import ByteChunks, stdlib_files
from lightning_paro.demo.model import GPT, GPTConfig
from lightning_paro.strategy.checkpoint import convert_to_full


class _Report(L.Callback):
    """Collects what the summary shows, on each rank, before the strategy hands the module back."""

    def on_train_end(self, trainer, pl_module):
        s = trainer.strategy
        pl_module.report = {"memory": s.memory_report(), "summary": s.summary(),
                            "traffic": [(t.intra, t.inter) for t in s.traffic_history]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lightning_paro.demo", description=__doc__)
    ap.add_argument("--sharding", default="IIG", help="PaRO strategy, e.g. NIG, IIG, GGG (default IIG)")
    ap.add_argument("--devices", type=int, default=4, help="processes (default 4)")
    ap.add_argument("--group-size", type=int, default=2, help="ranks per group (default 2: 2 groups of 2)")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    ap.add_argument("--accumulate", type=int, default=2, help="micro-steps per optimizer step (default 2)")
    ap.add_argument("--train-bytes", type=int, default=600_000, help="bytes of stdlib source to train on")
    ap.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    cfg = GPTConfig()
    out = Path(args.out)
    train_files = stdlib_files(args.train_bytes)
    held_out = stdlib_files(100_000, skip=len(train_files))
    train = DataLoader(ByteChunks(train_files, cfg.seq_len), batch_size=8, shuffle=True)
    val = DataLoader(ByteChunks(held_out, cfg.seq_len), batch_size=16)
    model = GPT(cfg)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, max_steps=args.steps, accumulate_grad_batches=args.accumulate,
        strategy=PaROStrategy(sharding=args.sharding, group_size=args.group_size), gradient_clip_val=1.0,
        logger=L.pytorch.loggers.CSVLogger(out, name="logs"), log_every_n_steps=5, enable_checkpointing=False,
        limit_val_batches=20, val_check_interval=args.steps * args.accumulate, callbacks=[_Report()],
        default_root_dir=out,
    )
    t0 = time.perf_counter()
    trainer.fit(model, train, val)
    elapsed = time.perf_counter() - t0
    sharded = out / "checkpoint"
    trainer.save_checkpoint(sharded)  # sharded: every rank writes its part, once
    if trainer.global_rank != 0:
        return
    ckpt = convert_to_full(sharded, out / "gpt.ckpt")  # one file, loadable with GPT.load_from_checkpoint
    rep = model.report
    losses = model.step_losses
    k = max(1, len(losses) // 12)
    curve = [sum(losses[i:i + k]) / len(losses[i:i + k]) for i in range(0, len(losses), k)]
    intra = sum(t[0] for t in rep["traffic"]) / len(rep["traffic"])
    inter = sum(t[1] for t in rep["traffic"]) / len(rep["traffic"])
    summary = {
        "sharding": args.sharding, "processes": args.devices, "group_size": args.group_size,
        "parameters": sum(p.numel() for p in model.parameters()), "seconds": round(elapsed, 1),
        "loss_curve": [round(x, 3) for x in curve], "intra_bytes_per_step": intra, "inter_bytes_per_step": inter,
        "memory_rank0": rep["memory"], "val_bits_per_byte": float(trainer.callback_metrics.get("val_bits_per_byte", 0)),
        "checkpoint": str(sharded), "full_checkpoint": str(ckpt), "logs": str(Path(trainer.logger.log_dir)),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\n" + rep["summary"])
    print(f"\nloss curve (mean per {k} micro-steps): " + " ".join(f"{x:.2f}" for x in curve))
    print(f"held-out bits per byte: {summary['val_bits_per_byte']:.3f}")
    print(f"trained {summary['parameters']:,} parameters in {elapsed:.1f} s")
    print(f"outputs: {out}/ (summary.json, sharded checkpoint {sharded.name}/, consolidated {ckpt.name},"
          f" logs in {summary['logs']})")


if __name__ == "__main__":
    main()
