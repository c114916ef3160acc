"""Set-up memory of a GPT of about 106M parameters (425 MB of fp32 weights) under GGG on 4 CPU processes (2 groups of
2): built on CPU, built on the meta device (deferred initialisation), and built on the meta device and filled from a
full pretrained safetensors file (fine-tuning). The meta-built model then trains, validates, saves a sharded
checkpoint and resumes from it.

Per rank: the resident set's growth from just before the model is built (the start of ``configure_model``) to the end
of set-up (``on_fit_start``), and its high-water mark over the same stretch (glibc's mmap threshold fixed, so freed
tensors leave the resident set), beside the model's full parameter bytes, this rank's parameter shard and the
largest unit. The acceptance bound is 1.25 x shard + largest unit.

Writes bench/results/train/deferred_init.json and deferred_init.md (with the commit and the date).

Usage: ``python bench/train/deferred_init.py`` (about ten minutes on 2 cores).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "train"
WORLD, GROUP = 4, 2
SHAPE = dict(vocab=256, dim=768, heads=12, layers=15, seq_len=64)
"""About 106M parameters: 15 blocks of 7.1M (the units), a byte vocabulary."""
MiB = 2**20


def worker(mode: str, work: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import lightning as L
    import torch
    from meta_models import GPTModule, GPTNet
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_paro import PaROStrategy
    from lightning_paro.cli.peak_memory import fix_mmap_threshold, peak_bytes, reset_peak, resident_bytes

    fix_mmap_threshold()
    rank = int(os.environ["RANK"])
    if mode == "write":  # the "pretrained" full weights, one process
        if rank == 0:
            from safetensors.torch import save_file
            torch.manual_seed(1)
            net = GPTNet(**SHAPE)
            save_file({k: v.contiguous() for k, v in net.state_dict().items() if k != "head.weight"},
                      str(work / "pretrained.safetensors"))
        return
    cpu = torch.device("cpu")

    class Measured(GPTModule):
        def configure_model(self) -> None:
            if self.net is None:
                reset_peak(cpu)
                self.before = resident_bytes()
            super().configure_model()

    class AtSetupEnd(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            engine = trainer.strategy.engine
            shard = sum(f.p_local.numel() * f.p_local.element_size() for f in engine.flat_groups())
            units = [sum(f.full_bytes for f in u.flats) for u in engine.units]
            pl_module.figures = {
                "rank": rank, "growth_end_setup": resident_bytes() - pl_module.before,
                "growth_peak_setup": peak_bytes(cpu) - pl_module.before, "shard_bytes": shard,
                "largest_unit_bytes": max(units), "full_param_bytes": engine.full_param_bytes,
            }

    def data(n: int) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randint(0, SHAPE["vocab"], (n, SHAPE["seq_len"] + 1), generator=g)),
                          batch_size=1)

    meta = mode != "cpu"
    pretrained = str(work / "pretrained.safetensors") if mode == "pretrained" else None
    model = Measured(meta=meta, pretrained=pretrained, **SHAPE)
    steps = {"cpu": 1, "pretrained": 1, "meta": 2, "resume": 3}[mode]
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=PaROStrategy(sharding="GGG", group_size=GROUP),
                        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1,
                        callbacks=[AtSetupEnd()])
    trainer.fit(model, data(WORLD * 2), val_dataloaders=data(WORLD) if mode == "meta" else None,
                ckpt_path=work / "meta.ckpt" if mode == "resume" else None)
    figures = dict(model.figures, losses=model.losses)
    if mode == "meta":
        trainer.save_checkpoint(work / "meta.ckpt")
        figures["val_loss"] = float(trainer.callback_metrics["val_loss"])
    (work / f"{mode}.{rank}.json").write_text(json.dumps(figures))


def run(mode: str, work: Path, nprocs: int = WORLD) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}", f"--master-port={port}",
           __file__, "--worker", mode, str(work)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads((work / f"{mode}.{r}.json").read_text()) for r in range(nprocs)] if mode != "write" else []


def main() -> None:
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        run("write", work, nprocs=1)
        for mode in ("cpu", "meta", "resume", "pretrained"):
            rows[mode] = run(mode, work)
            for r in rows[mode]:
                bound = 1.25 * r["shard_bytes"] + r["largest_unit_bytes"]
                r["bound_bytes"] = bound
                print(f"{mode:10s} rank {r['rank']}: grows {r['growth_end_setup'] / MiB:7.1f} MiB to the end of set-up,"
                      f" peak {r['growth_peak_setup'] / MiB:7.1f} MiB; full parameters"
                      f" {r['full_param_bytes'] / MiB:6.1f} MiB, shard {r['shard_bytes'] / MiB:6.1f} MiB, largest unit"
                      f" {r['largest_unit_bytes'] / MiB:5.1f} MiB, bound {bound / MiB:6.1f} MiB", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "deferred_init.json").write_text(json.dumps({"commit": commit, "date": date, "shape": SHAPE,
                                                            "world": WORLD, "group_size": GROUP, "runs": rows},
                                                           indent=1))
    lines = [f"# Set-up memory: deferred initialisation (commit {commit}, {date})", "",
             f"GPT {SHAPE} under GGG, {WORLD} CPU processes in groups of {GROUP}. Growth of each rank's resident set"
             " from the start of `configure_model` to the end of set-up (and its peak over that stretch), MiB.", "",
             "| build | rank | growth at end of set-up | peak growth | full parameters | shard | largest unit |"
             " bound 1.25 x shard + unit | within |", "|---|---|---|---|---|---|---|---|---|"]
    for mode, rs in rows.items():
        for r in rs:
            within = "yes" if max(r["growth_end_setup"], r["growth_peak_setup"]) <= r["bound_bytes"] else "no"
            lines.append(f"| {mode} | {r['rank']} | {r['growth_end_setup'] / MiB:.1f} |"
                         f" {r['growth_peak_setup'] / MiB:.1f} | {r['full_param_bytes'] / MiB:.1f} |"
                         f" {r['shard_bytes'] / MiB:.1f} |"
                         f" {r['largest_unit_bytes'] / MiB:.1f} | {r['bound_bytes'] / MiB:.1f} | {within} |")
    meta0, resumed0 = rows["meta"][0], rows["resume"][0]
    lines += ["", f"The meta-built model trained 2 steps (losses {meta0['losses']}), validated (val_loss"
              f" {meta0['val_loss']:.4f}), saved a sharded checkpoint and resumed from it for step 3 (loss"
              f" {resumed0['losses']}); the CPU-built one's first loss: {rows['cpu'][0]['losses']}."]
    (RESULTS / "deferred_init.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], Path(sys.argv[3]))
    else:
        main()
