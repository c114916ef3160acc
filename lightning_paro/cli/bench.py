"""The ``bench`` command: times the optimizer steps of the user's model under the chosen strategy and reports
throughput, traffic, peak memory and model-state bytes per rank (bench.json), so that ``bench -m`` compares strategies
on the user's own model and cluster. The FSDP2 and HSDP anchors it compares against are built in ``build.py``."""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import torch

import lightning as L
from lightning_paro.cli.build import build_data, build_model, build_trainer, strategy_label
from lightning_paro.cli.commands import BENCH_FILE, LossRecorder, processes_text, strategy_stats
from lightning_paro.cli.peak_memory import PeakMemory, fix_mmap_threshold
from lightning_paro.cli.schema import Config, ConfigError


class StepTimer(L.Callback):
    """Times optimizer steps after ``warmup`` of them and counts the samples they train on; at the end gathers every
    rank's loss, samples, peak RSS and model-state bytes, and on global rank 0 writes bench.json and prints one line.

    Samples are the batch size Lightning finds in each batch (the first tensor's first dimension); a module that
    sets ``tokens_per_sample`` (a sequence model) gets tokens per second too."""

    def __init__(self, cfg: Config, losses: LossRecorder, memory: Optional[PeakMemory] = None) -> None:
        self.cfg = cfg
        self.losses = losses
        self.memory = memory or PeakMemory()
        """Where the peak memory during training is read (it must run before this callback's on_train_end)."""
        self.warmup = cfg.bench.warmup_steps
        self.marks: dict[int, float] = {}
        self.batch_started = (0, 0.0)
        self.samples = 0
        """Samples of the timed micro-batches on this rank."""
        self.accumulating: list[float] = []
        """Durations of timed micro-batches that did not end an accumulation window: with DDP (no_sync) these do no
        communication, so they measure one micro-step's compute under the same load. The report gives rank 0's
        median and the mean over every rank: where ranks share cores, a rank waits for the others' compute in a few
        of its micro-batches, which the median leaves out and the step time does not."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.marks[0] = time.perf_counter()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.batch_started = (trainer.global_step, time.perf_counter())
        if trainer.global_step >= self.warmup:
            from lightning.pytorch.utilities.data import extract_batch_size

            self.samples += extract_batch_size(batch)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        now = time.perf_counter()
        self.marks.setdefault(trainer.global_step, now)
        step, started = self.batch_started
        if trainer.global_step == step and step >= self.warmup:  # no optimizer step in this micro-batch
            self.accumulating.append(now - started)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        per_step = self.losses.per_step()
        states = model_state_bytes(trainer.strategy, pl_module, trainer.optimizers)
        accumulating = statistics.fmean(self.accumulating) if self.accumulating else math.nan
        local = torch.tensor([per_step[-1] if per_step else math.nan, peak_rss_bytes(), sum(states.values()),
                              accumulating, self.samples, self.memory.train_peak or 0,
                              self.memory.setup_resident or 0, self.memory.process_resident or 0],
                             dtype=torch.float64)
        ranks = gather_rows(local, trainer.world_size)  # collective: every rank takes part
        if not trainer.is_global_zero:
            return
        last = trainer.global_step
        steps = last - self.warmup
        seconds = self.marks[last] - self.marks[self.warmup]
        samples = int(ranks[:, 4].sum())
        samples_per_step = samples / steps if steps > 0 else None
        tokens_per_sample = getattr(pl_module, "tokens_per_sample", None)
        tokens_per_step = (samples_per_step * tokens_per_sample
                           if samples_per_step is not None and isinstance(tokens_per_sample, int) else None)
        result = {
            "strategy": strategy_label(self.cfg), "model": self.cfg.model.get("_target_"),
            "world_size": trainer.world_size, "timed_steps": steps, "seconds": round(seconds, 4),
            "samples_per_step": _whole(samples_per_step),
            "samples_per_s": round(samples / seconds, 2) if seconds > 0 else None,
            "tokens_per_step": _whole(tokens_per_step),
            "tokens_per_s": round(tokens_per_step * steps / seconds, 1) if tokens_per_step and seconds > 0 else None,
            "step_seconds": round(seconds / steps, 4) if steps > 0 else None,
            "each_step_seconds": [round(self.marks[k + 1] - self.marks[k], 4) for k in range(self.warmup, last)
                                  if k in self.marks and k + 1 in self.marks],
            "accumulating_micro_step_s": (round(statistics.median(self.accumulating), 5) if self.accumulating
                                          else None),
            "accumulating_micro_step_mean_s": (round(float(ranks[:, 3].mean()), 5) if self.accumulating
                                               else None),
            "final_loss": float(ranks[:, 0].mean()),
            "peak_rss_bytes_max_rank": int(ranks[:, 1].max()),
            "memory_fixed_mmap_threshold": bool(self.cfg.bench.memory),
            "train_peak_bytes_max_rank": int(ranks[:, 5].max()),
            "train_peak_bytes_per_rank": [int(v) for v in ranks[:, 5]],
            "train_start_bytes_per_rank": [int(v) for v in ranks[:, 6]],
            "process_start_bytes_per_rank": [int(v) for v in ranks[:, 7]],
            "model_state_bytes_max_rank": int(ranks[:, 2].max()),
            "model_state_bytes_rank0": states,
            "parameters": sum(p.numel() for p in pl_module.parameters()),
            "trainable_parameters": sum(p.numel() for p in pl_module.parameters() if p.requires_grad),
            **strategy_stats(trainer.strategy),
        }
        Path(self.cfg.run.dir).mkdir(parents=True, exist_ok=True)
        (Path(self.cfg.run.dir) / BENCH_FILE).write_text(json.dumps(result, indent=2))
        traffic = (f", {result['intra_bytes_per_step'] / 1e6:.2f} MB intra + {result['inter_bytes_per_step'] / 1e6:.2f}"
                   " MB inter per step per rank" if "intra_bytes_per_step" in result else "")
        rate = (f"{result['tokens_per_s']} tokens/s" if result["tokens_per_s"] is not None
                else f"{result['samples_per_s']} samples/s")
        print(f"bench {result['strategy']} on {processes_text(trainer.world_size)}: {rate} over {steps} optimizer steps"
              f" ({result['samples_per_step']} samples each){traffic}; final loss {result['final_loss']:.5f}, model"
              f" states {result['model_state_bytes_max_rank'] / 2**20:.1f} MiB and peak RSS"
              f" {result['peak_rss_bytes_max_rank'] / 2**20:.0f} MiB on the largest rank", flush=True)


def _whole(value: Optional[float]) -> Any:
    if value is None:
        return None
    return int(value) if float(value).is_integer() else round(value, 2)


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
    """Train bench.warmup_steps + bench.steps optimizer steps and report the timed steps' throughput and peak memory;
    with bench.eval_batches, validate on that many batches afterwards and add that stage's peak memory. The callbacks
    and logger groups are left out (a checkpoint or a logger would be timed too)."""
    if cfg.bench.memory:
        fix_mmap_threshold()  # before anything large is allocated
    memory = PeakMemory()  # before the model: its process_resident is the framework alone
    model = build_model(cfg)
    data = build_data(cfg)
    losses = LossRecorder()
    trainer = build_trainer(cfg, callbacks=[memory, losses, StepTimer(cfg, losses, memory)], user_callbacks=False,
                            loggers=False, max_steps=cfg.bench.warmup_steps + cfg.bench.steps, validate=False)
    kwargs = data.fit_kwargs()
    val = kwargs.pop("val_dataloaders", None)
    evaluation = _validate_kwargs(kwargs, val) if cfg.bench.eval_batches else None  # refused before training
    trainer.fit(model, **kwargs)
    if evaluation is not None:
        trainer.limit_val_batches = cfg.bench.eval_batches  # the same Trainer, as a user validates after fit
        trainer.validate(model, **evaluation, verbose=False)
        peak = gather_rows(torch.tensor([float(memory.eval_peak or 0)], dtype=torch.float64), trainer.world_size)
        if trainer.is_global_zero:
            report = Path(cfg.run.dir) / BENCH_FILE
            result = json.loads(report.read_text())
            result["eval_peak_bytes_max_rank"] = int(peak[:, 0].max())
            result["eval_peak_bytes_per_rank"] = [int(v) for v in peak[:, 0]]
            report.write_text(json.dumps(result, indent=2))
            print(f"bench validation on {cfg.bench.eval_batches} batches: peak memory"
                  f" {result['eval_peak_bytes_max_rank'] / 2**20:.0f} MiB on the largest rank", flush=True)


def _validate_kwargs(fit_kwargs: dict[str, Any], val: Any) -> dict[str, Any]:
    if "datamodule" in fit_kwargs:
        return {"datamodule": fit_kwargs["datamodule"]}
    if val is None:
        raise ConfigError("bench.eval_batches", "there is no validation data (data.val) to evaluate on")
    return {"dataloaders": val}
