"""The ``fit``, ``predict`` and ``bench`` commands: thin functions over the builders and two reporting callbacks.

Reports are produced inside the training processes (in ``on_train_end`` on global rank 0), so they are the same
whichever way the processes were started: Lightning's subprocess launcher, spawn, or torchrun.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

import lightning as L
from lightning_paro.cli.build import build_model, build_trainer, strategy_label
from lightning_paro.cli.schema import Config, ConfigError
from lightning_paro.cli.task import CHECKPOINT_MODEL_KEY, FileBytes, GPTTask, split_files, train_loaders

WEIGHTS_FILE = "weights.ckpt"
SUMMARY_FILE = "summary.json"
BENCH_FILE = "bench.json"
PREDICT_FILE = "predict.json"
PREDICTIONS_DIR = "predictions"


def checkpoint_path(cfg: Config) -> Path:
    """Where fit writes the weights and predict reads them: predict.checkpoint, else weights.ckpt in run.dir."""
    if cfg.predict.checkpoint:
        path = Path(cfg.predict.checkpoint).expanduser()
        return path if path.is_absolute() else Path.cwd() / path
    return Path(cfg.run.dir) / WEIGHTS_FILE


def predictions_dir(cfg: Config) -> Path:
    """Where predict writes: predict.output_dir, else predictions/ in run.dir."""
    if cfg.predict.output_dir:
        path = Path(cfg.predict.output_dir).expanduser()
        return path if path.is_absolute() else Path.cwd() / path
    return Path(cfg.run.dir) / PREDICTIONS_DIR


def _processes(n: int) -> str:
    return f"{n} process" + ("" if n == 1 else "es")


def _strategy_stats(strategy: Any) -> dict[str, Any]:
    """Traffic per optimizer step and model-state memory of this rank (PaRO only; empty for other strategies)."""
    history = getattr(strategy, "traffic_history", None)
    if not history:
        return {}
    return {
        "intra_bytes_per_step": sum(t.intra for t in history) / len(history),
        "inter_bytes_per_step": sum(t.inter for t in history) / len(history),
        "memory_bytes_rank0": dict(strategy.memory_report()),
    }


# ---------------------------------------------------------------------------------------------------- fit
class FitReport(L.Callback):
    """On global rank 0 at the end of training: prints the strategy's summary and writes summary.json."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.started = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.started = time.perf_counter()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        micro = list(getattr(pl_module, "step_losses", []))
        per = self.cfg.trainer.accumulate_grad_batches
        step_losses = [sum(micro[i:i + per]) / len(micro[i:i + per]) for i in range(0, len(micro), per)]
        val = trainer.callback_metrics.get("val_bits_per_byte")
        summary = {
            "strategy": strategy_label(self.cfg),
            "world_size": trainer.world_size,
            "optimizer_steps": trainer.global_step,
            "seconds": round(time.perf_counter() - self.started, 2),
            "loss_per_step_rank0": step_losses,
            "val_bits_per_byte": float(val) if val is not None else None,
            "checkpoint": str(Path(self.cfg.run.dir) / WEIGHTS_FILE),
            "logs": trainer.logger.log_dir if trainer.logger is not None else None,
            **_strategy_stats(trainer.strategy),
        }
        run_dir = Path(self.cfg.run.dir)
        (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        if hasattr(trainer.strategy, "summary"):
            print("\n" + trainer.strategy.summary(), flush=True)
        first, last = (step_losses[0], step_losses[-1]) if step_losses else (float("nan"), float("nan"))
        print(f"\n{summary['strategy']} on {_processes(summary['world_size'])}: {trainer.global_step} optimizer"
              f" steps in {summary['seconds']} s, loss {first:.3f} -> {last:.3f} (rank 0)"
              + (f", held-out bits per byte {summary['val_bits_per_byte']:.3f}" if val is not None else ""), flush=True)


def fit(cfg: Config) -> None:
    """Train, save the weights to run.dir/weights.ckpt, report in run.dir/summary.json."""
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = build_trainer(cfg, callbacks=[FitReport(cfg)], logger=CSVLogger(str(run_dir), name="logs"))
    model = build_model(cfg)
    train, val = train_loaders(cfg.data, cfg.model.seq_len)
    trainer.fit(model, train, val)
    ckpt = run_dir / WEIGHTS_FILE
    trainer.save_checkpoint(ckpt, weights_only=True)  # collective under sharding strategies: every rank calls it
    if trainer.global_rank == 0:
        stale = run_dir / PREDICTIONS_DIR
        if stale.exists():  # scores of the previous weights would be read back as if they were of these
            shutil.rmtree(stale)
            print(f"removed {stale} (predictions of the previous weights)")
        print(f"checkpoint: {ckpt}\nsummary: {run_dir / SUMMARY_FILE}", flush=True)


# ---------------------------------------------------------------------------------------------------- predict
def read_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint written by fit as one dict: a single file, or a sharded directory (torch.distributed.checkpoint
    shards plus meta.pt, as PaROStrategy(state_dict_type="sharded") writes) consolidated in memory."""
    if path.is_file():
        return torch.load(path, map_location="cpu", weights_only=True)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(path), str(Path(tmp) / "full.pt"))
        checkpoint = torch.load(Path(tmp) / "full.pt", map_location="cpu", weights_only=True)
    meta = path / "meta.pt"
    if meta.is_file():
        checkpoint = {**torch.load(meta, map_location="cpu", weights_only=True), **checkpoint}
    return checkpoint


def load_weights(path: Path, cfg: Config) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint written by fit; refuses one trained with another model shape."""
    if not path.exists():
        raise ConfigError("predict.checkpoint", f"{path} does not exist; run fit with the same run.dir first, or"
                                                " set predict.checkpoint=PATH")
    checkpoint = read_checkpoint(path)
    trained = checkpoint.get(CHECKPOINT_MODEL_KEY) or {}
    # the learning rate does not change the weights' shapes; everything else must match to load them
    differ = [key for key, value in trained.items() if key != "lr" and getattr(cfg.model, key, None) != value]
    if differ:
        ours = " ".join(f"model.{key}={getattr(cfg.model, key, None)}" for key in differ)
        theirs = " ".join(f"model.{key}={trained[key]}" for key in differ)
        raise ConfigError(f"model.{differ[0]}", f"{ours} but {path} was trained with {theirs}; pass {theirs}")
    return checkpoint["state_dict"]


def _predict_device(cfg: Config) -> Any:
    """One device per worker: under torchrun (LOCAL_RANK set) each worker takes its own GPU, not all the first."""
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None and cfg.trainer.accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available():
        return [int(local_rank)]
    return 1


def predict(cfg: Config) -> Optional[dict]:
    """Score the held-out files with the fitted weights; per-file bits per byte go to Parquet via ElasticPredict.

    Each process is one elastic worker on one device: start more (torchrun, a scheduler, another shell) with the
    same config to share the job; the last one to finish writes the manifest.
    """
    from lightning_paro.predict import ElasticPredict, read_predictions

    ckpt, out = checkpoint_path(cfg), predictions_dir(cfg)
    model = GPTTask(cfg.model)
    model.load_state_dict(load_weights(ckpt, cfg))
    _, held_out = split_files(cfg.data)
    p = cfg.predict
    loader = DataLoader(FileBytes(held_out, cfg.model.seq_len, p.max_bytes_per_file), batch_size=p.batch_size,
                        num_workers=cfg.data.num_workers)
    out.mkdir(parents=True, exist_ok=True)
    elastic = ElasticPredict(output_dir=str(out), id_column="path", shard_size=p.shard_size, format=p.format,
                             ledger=p.ledger, lease_ttl_s=p.lease_ttl_s, max_failed_rows=p.max_failed_rows)
    trainer = L.Trainer(accelerator=cfg.trainer.accelerator, devices=_predict_device(cfg),
                        precision=cfg.trainer.precision, logger=False, callbacks=[elastic],
                        enable_progress_bar=cfg.trainer.enable_progress_bar, enable_model_summary=False,
                        enable_checkpointing=False)
    trainer.predict(model, dataloaders=loader)
    if elastic.manifest is None:  # another worker is still on the job; whoever finishes last writes the manifest
        print(f"this worker's shards are committed; the job in {out} completes with the other workers", flush=True)
        return None
    table = read_predictions(out).to_pylist()
    scores = sorted(table, key=lambda row: row["bits_per_byte"])
    mean = sum(r["bits_per_byte"] * r["bytes_scored"] for r in table) / max(1, sum(r["bytes_scored"] for r in table))
    result = {"files": len(table), "bits_per_byte": mean, "checkpoint": str(ckpt), "output_dir": str(out),
              "easiest": scores[0]["path"] if scores else None, "hardest": scores[-1]["path"] if scores else None}
    Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.run.dir) / PREDICT_FILE).write_text(json.dumps(result, indent=2))
    print(f"scored {len(table)} held-out files with {ckpt.name}: {mean:.3f} bits per byte"
          f" (easiest {result['easiest']}, hardest {result['hardest']})\npredictions: {out}"
          f" (read them with lightning_paro.predict.read_predictions)", flush=True)
    return result


# ---------------------------------------------------------------------------------------------------- bench
class StepTimer(L.Callback):
    """Times optimizer steps after ``warmup`` of them; on global rank 0 writes bench.json and prints one line."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.warmup = cfg.bench.warmup_steps
        self.marks: dict[int, float] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.marks[0] = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.marks.setdefault(trainer.global_step, time.perf_counter())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        last = trainer.global_step
        steps = last - self.warmup
        seconds = self.marks[last] - self.marks[self.warmup]
        c = self.cfg
        tokens_per_step = c.data.batch_size * c.model.seq_len * c.trainer.accumulate_grad_batches * trainer.world_size
        result = {
            "strategy": strategy_label(c), "world_size": trainer.world_size, "timed_steps": steps,
            "seconds": round(seconds, 4), "tokens_per_step": tokens_per_step,
            "tokens_per_s": round(tokens_per_step * steps / seconds, 1) if seconds > 0 else None,
            **_strategy_stats(trainer.strategy),
        }
        Path(c.run.dir).mkdir(parents=True, exist_ok=True)
        (Path(c.run.dir) / BENCH_FILE).write_text(json.dumps(result, indent=2))
        traffic = (f", {result['intra_bytes_per_step'] / 1e6:.2f} MB intra + {result['inter_bytes_per_step'] / 1e6:.2f}"
                   " MB inter per step per rank" if "intra_bytes_per_step" in result else "")
        print(f"bench {result['strategy']} on {_processes(trainer.world_size)}: {result['tokens_per_s']} tokens/s over"
              f" {steps} optimizer steps ({tokens_per_step} tokens each){traffic}", flush=True)


def bench(cfg: Config) -> None:
    """Train bench.warmup_steps + bench.steps optimizer steps and report the timed steps' tokens per second."""
    trainer = build_trainer(cfg, callbacks=[StepTimer(cfg)], max_steps=cfg.bench.warmup_steps + cfg.bench.steps,
                            validate=False)
    model = build_model(cfg)
    train, _ = train_loaders(cfg.data, cfg.model.seq_len)
    trainer.fit(model, train)


COMMANDS = {"fit": fit, "predict": predict, "bench": bench}
"""Command name -> function of the checked config."""
