"""The ``fit`` and ``predict`` commands (``bench`` is in ``bench.py``): thin functions over the builders and a few
reporting callbacks.

Reports are produced inside the training processes (in ``on_train_end`` on global rank 0), so they are the same
whichever way the processes were started: Lightning's subprocess launcher, spawn, or torchrun. Nothing here knows
the model: losses come from what ``training_step`` returns, batch sizes from the batches.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import OmegaConf

import lightning as L
from lightning_paro.cli.build import build_data, build_model, build_trainer, strategy_label
from lightning_paro.cli.checks import resume_path
from lightning_paro.cli.schema import Config, ConfigError
from lightning_paro.strategy.checkpoint import read_full

WEIGHTS_FILE = "weights.ckpt"
SUMMARY_FILE = "summary.json"
CONFIG_FILE = "config.yaml"
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


def config_yaml(cfg: Config) -> str:
    """The composed config as YAML (what fit saves beside its checkpoint, and --cfg prints), with the password of a
    ledger URL left out."""
    import dataclasses

    from lightning_paro.predict.db import redact_url

    plain = dataclasses.asdict(cfg)
    del plain["left_out"]  # a report of the composition, not a setting
    if plain["predict"].get("ledger"):
        plain["predict"]["ledger"] = redact_url(plain["predict"]["ledger"])
    return OmegaConf.to_yaml(OmegaConf.create(plain))


class LossRecorder(L.Callback):
    """Every micro-batch's training loss (as training_step returned it), grouped by the optimizer step it is part of.

    Under automatic optimization Lightning hands callbacks the loss divided by accumulate_grad_batches; it is scaled
    back, so a step's value is the mean of its micro-batch losses whatever the accumulation.
    """

    def __init__(self) -> None:
        self.micro: list[tuple[int, float]] = []
        """(optimizer step index, loss) per micro-batch, on this rank."""
        self._step = 0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if not torch.is_tensor(loss):
            return  # training_step returned None (a skipped batch) or no loss
        scale = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
        self.micro.append((self._step, float(loss.detach()) * scale))

    def per_step(self) -> list[float]:
        """Mean loss of each optimizer step, in order."""
        steps: dict[int, list[float]] = {}
        for step, value in self.micro:
            steps.setdefault(step, []).append(value)
        return [sum(v) / len(v) for _, v in sorted(steps.items())]


def processes_text(n: int) -> str:
    """"1 process", "4 processes"."""
    return f"{n} process" + ("" if n == 1 else "es")


def strategy_stats(strategy: Any) -> dict[str, Any]:
    """Traffic per optimizer step and model-state memory of this rank (PaRO only; empty for other strategies)."""
    history = getattr(strategy, "traffic_history", None)
    if not history:
        return {}
    out = {
        "intra_bytes_per_step": sum(t.intra for t in history) / len(history),
        "inter_bytes_per_step": sum(t.inter for t in history) / len(history),
        "memory_bytes_rank0": dict(strategy.memory_report()),
        "gathered_peak_bytes_rank0": strategy.engine.gather_meter.peak if strategy.engine is not None else None,
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
            "predicted_memory_bytes": {k.strategy: k.prediction.memory.total for k in plan.candidates},
            "fits": {k.strategy: k.fits for k in plan.candidates},
            "budget_bytes": plan.budget_bytes,
            "in_use": strategy.sharding.name if strategy.sharding is not None else None,
            "plan_seconds": getattr(strategy, "auto_plan_seconds", 0.0),
            "micro_step_seconds": plan.compute.micro_step_seconds,
            "update_bytes_per_s": plan.compute.memory_bandwidth,
            "activation_bytes": plan.workload.activation_bytes,
            "notes": list(plan.notes),
            "switches": [{"step": s.step, "from": s.from_strategy, "to": s.to_strategy, "reason": s.reason,
                          "seconds": s.seconds} for s in getattr(strategy, "auto_switches", [])],
            "replans": list(getattr(strategy, "auto_replans", [])),
        }
    return out


# ---------------------------------------------------------------------------------------------------- fit
def _metrics(trainer: L.Trainer, prefix: str) -> dict[str, float]:
    return {k: float(v) for k, v in sorted(trainer.callback_metrics.items())
            if k.startswith(prefix) and torch.is_tensor(v) and v.numel() == 1}


class FitReport(L.Callback):
    """On global rank 0 at the end of training: prints the strategy's summary and writes summary.json."""

    def __init__(self, cfg: Config, losses: LossRecorder) -> None:
        self.cfg = cfg
        self.losses = losses
        self.started = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.started = time.perf_counter()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        step_losses = self.losses.per_step()
        validation = _metrics(trainer, "val")
        history = getattr(trainer.strategy, "traffic_history", None) or []
        summary = {
            "strategy": strategy_label(self.cfg),
            "model": self.cfg.model.get("_target_"),
            "world_size": trainer.world_size,
            "optimizer_steps": trainer.global_step,
            "seconds": round(time.perf_counter() - self.started, 2),
            "loss_per_step_rank0": step_losses,
            "validation": validation,
            "checkpoint": str(Path(self.cfg.run.dir) / WEIGHTS_FILE),
            "logs": trainer.logger.log_dir if trainer.logger is not None else None,
            **strategy_stats(trainer.strategy),
        }
        if history:
            summary["traffic_per_step_rank0"] = {"intra": [t.intra for t in history],
                                                 "inter": [t.inter for t in history]}
        run_dir = Path(self.cfg.run.dir)
        (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        if hasattr(trainer.strategy, "summary"):
            print("\n" + trainer.strategy.summary(), flush=True)
        first, last = (step_losses[0], step_losses[-1]) if step_losses else (float("nan"), float("nan"))
        shown = "".join(f", {k} {v:.3f}" for k, v in validation.items())
        print(f"\n{summary['strategy']} on {processes_text(summary['world_size'])}: {trainer.global_step} optimizer"
              f" steps in {summary['seconds']} s, loss {first:.3f} -> {last:.3f} (rank 0){shown}", flush=True)


def fit(cfg: Config) -> None:
    """Train (resumed from ``ckpt_path`` when set), save the weights to run.dir/weights.ckpt (a file or a sharded
    directory, as strategy.state_dict_type says) and the composed config to run.dir/config.yaml, report in
    run.dir/summary.json."""
    run_dir = Path(cfg.run.dir)
    model = build_model(cfg)
    data = build_data(cfg)
    losses = LossRecorder()
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = build_trainer(cfg, callbacks=[losses, FitReport(cfg, losses)])
    if trainer.global_rank == 0:
        (run_dir / CONFIG_FILE).write_text(config_yaml(cfg))
    resume = resume_path(cfg)
    trainer.fit(model, ckpt_path=str(resume) if resume is not None else None, **data.fit_kwargs())
    ckpt = run_dir / WEIGHTS_FILE
    trainer.save_checkpoint(ckpt, weights_only=True)  # collective under sharding strategies: every rank calls it
    if trainer.global_rank == 0:
        stale = run_dir / PREDICTIONS_DIR
        if stale.exists():  # scores of the previous weights would be read back as if they were of these
            shutil.rmtree(stale)
            print(f"removed {stale} (predictions of the previous weights)")
        sharded = (f" (a sharded directory; one file for load_from_checkpoint: python -m lightning_paro.convert"
                   f" {ckpt} {ckpt.with_name('weights_full.ckpt')})" if ckpt.is_dir() else "")
        print(f"checkpoint: {ckpt}{sharded}\nsummary: {run_dir / SUMMARY_FILE}", flush=True)


# ---------------------------------------------------------------------------------------------------- predict
def read_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint written by fit as one dict: a single file, or a sharded directory (as
    ``PaROStrategy(state_dict_type="sharded")`` writes) consolidated in memory."""
    if path.is_file():
        return torch.load(path, map_location="cpu", weights_only=True)
    return read_full(path)


def _trained_model_node(path: Path) -> Optional[dict]:
    """The model node a checkpoint was trained with, from the config.yaml fit wrote beside it (or one level up, for
    ModelCheckpoint's checkpoints/ directory)."""
    for directory in (path.parent, path.parent.parent):
        saved = directory / CONFIG_FILE
        if saved.is_file():
            node = OmegaConf.to_container(OmegaConf.load(saved)).get("model")
            return node if isinstance(node, dict) else None
    return None


def load_weights(model: torch.nn.Module, path: Path, cfg: Config) -> None:
    """Loads the weights (the state_dict) of a checkpoint into ``model``; a checkpoint of another model or shape is
    refused in one line, naming the model keys it was trained with when fit's config.yaml is beside it."""
    if not path.exists():
        raise ConfigError("predict.checkpoint", f"{path} does not exist; run fit with the same run.dir first, or"
                                                " set predict.checkpoint=PATH")
    checkpoint = read_checkpoint(path)
    state = checkpoint.get("state_dict")
    if not isinstance(state, dict):
        raise ConfigError("predict.checkpoint", f"{path} has no state_dict: not a Lightning checkpoint")
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        trained = _trained_model_node(path) or {}
        differ = [k for k, v in trained.items() if cfg.model.get(k) != v]
        if differ:
            ours = " ".join(f"model.{k}={cfg.model.get(k)}" for k in differ)
            theirs = " ".join(f"model.{k}={trained[k]}" for k in differ)
            raise ConfigError(f"model.{differ[0]}", f"{ours} but {path} was trained with {theirs}; pass {theirs}"
                              ) from None
        reason = " ".join(str(exc).split())[:300]
        raise ConfigError("predict.checkpoint", f"{path} does not fit model ({cfg.model.get('_target_')}):"
                                                f" {reason}") from None


def _predict_device(cfg: Config) -> Any:
    """One device per worker: under torchrun (LOCAL_RANK set) each worker takes its own GPU, not all the first."""
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None and cfg.trainer.get("accelerator", "auto") in ("auto", "gpu", "cuda") and torch.cuda.is_available():
        return [int(local_rank)]
    return 1


def predict(cfg: Config) -> Optional[dict]:
    """Predict the data's predict dataloader with the checkpoint's weights; ElasticPredict writes the rows
    predict_step returns to Parquet (or JSONL) in predict.output_dir.

    Each process is one elastic worker on one device: start more (torchrun, a scheduler, another shell) with the
    same config to share the job; the last one to finish writes the manifest.
    """
    from lightning_paro.predict import ElasticPredict, read_predictions

    ckpt, out = checkpoint_path(cfg), predictions_dir(cfg)
    model = build_model(cfg)
    load_weights(model, ckpt, cfg)
    data = build_data(cfg)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    elastic = ElasticPredict(output_dir=str(out), **cfg.predict.elastic_options())
    t = cfg.trainer
    trainer = L.Trainer(accelerator=t.get("accelerator", "auto"), devices=_predict_device(cfg),
                        precision=t.get("precision", "32-true"), logger=False, callbacks=[elastic],
                        enable_progress_bar=t.get("enable_progress_bar", True), enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=cfg.run.dir)
    trainer.predict(model, return_predictions=False, **data.predict_kwargs())
    if elastic.manifest is None:  # another worker is still on the job; whoever finishes last writes the manifest
        print(f"this worker's shards are committed; the job in {out} completes with the other workers", flush=True)
        return None
    table = read_predictions(out)
    result = {"rows": table.num_rows, "rows_failed": elastic.manifest["rows_failed"],
              "columns": table.column_names, "checkpoint": str(ckpt), "output_dir": str(out),
              "format": cfg.predict.format, "batches_this_worker": elastic.batches_run,
              "seconds_this_worker": round(time.perf_counter() - started, 2)}
    Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.run.dir) / PREDICT_FILE).write_text(json.dumps(result, indent=2))
    print(f"predicted {table.num_rows} rows with {ckpt.name} ({', '.join(table.column_names)})\npredictions: {out}"
          + (" (Parquet: pandas.read_parquet(dir), pyarrow.dataset.dataset(dir), DuckDB read_parquet('dir/*.parquet'),"
             " or lightning_paro.predict.read_predictions(dir) in input order)" if cfg.predict.format == "parquet"
             else ""), flush=True)
    return result
