"""The ``fit``, ``predict`` and ``bench`` commands: thin functions over the builders and two reporting callbacks.

Reports are produced inside the training processes (in ``on_train_end`` on global rank 0), so they are the same
whichever way the processes were started: Lightning's subprocess launcher, spawn, or torchrun.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
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
    out = {
        "intra_bytes_per_step": sum(t.intra for t in history) / len(history),
        "inter_bytes_per_step": sum(t.inter for t in history) / len(history),
        "memory_bytes_rank0": dict(strategy.memory_report()),
    }
    plan = getattr(strategy, "auto_plan", None)
    if plan is not None:  # sharding="auto": what it measured and predicted, for checking the cost model
        c = plan.cluster
        out["auto"] = {
            "choice": plan.choice,
            "intra_bytes_per_s": c.intra.bandwidth, "intra_latency_s": c.intra.latency,
            "inter_bytes_per_s": c.inter.bandwidth, "inter_latency_s": c.inter.latency,
            "intra_overlap": c.intra.overlap, "inter_overlap": c.inter.overlap,
            "reduce_scatter_factor": c.reduce_scatter_factor, "hierarchical_factor": c.hierarchical_factor,
            "predicted_step_s": {k.strategy: k.prediction.step_seconds for k in plan.candidates},
        }
    return out


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
    """Times optimizer steps after ``warmup`` of them; at the end gathers every rank's loss, peak RSS and model-state
    bytes, and on global rank 0 writes bench.json and prints one line."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.warmup = cfg.bench.warmup_steps
        self.marks: dict[int, float] = {}
        self.batch_started = (0, 0.0)
        self.accumulating: list[float] = []
        """Durations of timed micro-batches that did not end an accumulation window: with DDP (no_sync) these do no
        communication, so they measure one micro-step's compute under the same load. The report gives rank 0's
        median and the mean over every rank: where ranks share cores, a rank waits for the others' compute in a few
        of its micro-batches, which the median leaves out and the step time does not."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.marks[0] = time.perf_counter()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.batch_started = (trainer.global_step, time.perf_counter())

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        now = time.perf_counter()
        self.marks.setdefault(trainer.global_step, now)
        step, started = self.batch_started
        if trainer.global_step == step and step >= self.warmup:  # no optimizer step in this micro-batch
            self.accumulating.append(now - started)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        per = self.cfg.trainer.accumulate_grad_batches
        micro = list(getattr(pl_module, "step_losses", []))[-per:]
        states = model_state_bytes(trainer.strategy, pl_module, trainer.optimizers)
        accumulating = statistics.fmean(self.accumulating) if self.accumulating else math.nan
        local = torch.tensor([sum(micro) / max(len(micro), 1), peak_rss_bytes(), sum(states.values()), accumulating],
                             dtype=torch.float64)
        ranks = gather_rows(local, trainer.world_size)  # collective: every rank takes part
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
            "step_seconds": round(seconds / steps, 4) if steps > 0 else None,
            "accumulating_micro_step_s": (round(statistics.median(self.accumulating), 5) if self.accumulating
                                          else None),
            "accumulating_micro_step_mean_s": (round(float(ranks[:, 3].mean()), 5) if self.accumulating
                                               else None),
            "final_loss": float(ranks[:, 0].mean()),
            "peak_rss_bytes_max_rank": int(ranks[:, 1].max()),
            "model_state_bytes_max_rank": int(ranks[:, 2].max()),
            "model_state_bytes_rank0": states,
            "parameters": sum(p.numel() for p in pl_module.parameters()),
            "trainable_parameters": sum(p.numel() for p in pl_module.parameters() if p.requires_grad),
            **_strategy_stats(trainer.strategy),
        }
        Path(c.run.dir).mkdir(parents=True, exist_ok=True)
        (Path(c.run.dir) / BENCH_FILE).write_text(json.dumps(result, indent=2))
        traffic = (f", {result['intra_bytes_per_step'] / 1e6:.2f} MB intra + {result['inter_bytes_per_step'] / 1e6:.2f}"
                   " MB inter per step per rank" if "intra_bytes_per_step" in result else "")
        print(f"bench {result['strategy']} on {_processes(trainer.world_size)}: {result['tokens_per_s']} tokens/s over"
              f" {steps} optimizer steps ({tokens_per_step} tokens each){traffic}; final loss"
              f" {result['final_loss']:.5f}, model states {result['model_state_bytes_max_rank'] / 2**20:.1f} MiB and"
              f" peak RSS {result['peak_rss_bytes_max_rank'] / 2**20:.0f} MiB on the largest rank", flush=True)


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def gather_rows(row: torch.Tensor, world_size: int) -> torch.Tensor:
    """``row`` of every rank stacked in rank order (a plain all-gather on the default group; works for any strategy
    that initialised torch.distributed, and for a single process)."""
    import torch.distributed as dist

    if world_size == 1 or not dist.is_initialized():
        return row[None]
    out = [torch.empty_like(row) for _ in range(world_size)]
    dist.all_gather(out, row)
    return torch.stack(out)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor (FSDP2) -> this rank's shard


def model_state_bytes(strategy: Any, module: torch.nn.Module, optimizers: list) -> dict[str, int]:
    """This rank's persistent bytes of parameters, gradients and optimizer states.

    PaRO reports its own buffers (exact, padding included). For other strategies the tensors are counted where they
    live: each parameter's local shard (FSDP2's DTensors), the gradients present now, the optimizer's state tensors.
    Buffers a framework keeps on the side (DDP's gradient buckets, FSDP2's gathered-parameter buffers) are not model
    states and are not counted; peak RSS shows them.
    """
    if hasattr(strategy, "memory_report"):
        report = strategy.memory_report()
        return {k: report[k] for k in ("params", "grads", "optim")}
    seen: set[int] = set()

    def size(t: Optional[torch.Tensor]) -> int:
        if t is None or id(t) in seen:
            return 0
        seen.add(id(t))
        local = _local(t)
        return local.numel() * local.element_size()

    params = list(module.parameters())
    out = {"params": sum(size(p) for p in params), "grads": sum(size(p.grad) for p in params), "optim": 0}
    for opt in optimizers:
        for state in opt.state.values():
            out["optim"] += sum(size(v) for v in state.values() if torch.is_tensor(v))
    return out


def bench(cfg: Config) -> None:
    """Train bench.warmup_steps + bench.steps optimizer steps and report the timed steps' tokens per second."""
    trainer = build_trainer(cfg, callbacks=[StepTimer(cfg)], max_steps=cfg.bench.warmup_steps + cfg.bench.steps,
                            validate=False)
    model = build_model(cfg)
    train, _ = train_loaders(cfg.data, cfg.model.seq_len)
    trainer.fit(model, train)


COMMANDS = {"fit": fit, "predict": predict, "bench": bench}
"""Command name -> function of the checked config."""
