"""Checks of a composed :class:`Config` that no type can express: values, the ``_target_`` nodes against their
classes, the Trainer keys against ``L.Trainer``'s parameters, the strategy node against the library's options, and
the launch environment. Each failure is one :class:`ConfigError` naming its key."""

from __future__ import annotations

import inspect
import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

from lightning_paro.cli import targets
from lightning_paro.cli.schema import BACKENDS, Config, ConfigError, ParoStrategyConfig, strategy_errors
from lightning_paro.strategy.options import PaROOptions

TRAINER_MANAGED = {
    "strategy": "choose it with the strategy group (strategy=paro_nig, strategy=ddp, ...)",
    "callbacks": "add callbacks with the callbacks group (callbacks=checkpoint, +callbacks.NAME._target_=...)",
    "logger": "choose loggers with the logger group (logger=csv, logger=[csv,tensorboard], logger=none)",
    "default_root_dir": "set run.dir",
}
"""Trainer arguments the command line fills from other groups, and where to set them instead."""
DATA_LOADER_KEYS = ("train", "val", "test", "predict")


def _devices(trainer: dict) -> Any:
    return trainer.get("devices", "auto")


def world_size(trainer: dict) -> Optional[int]:
    """devices * num_nodes when devices is a number or a list of device indices (None for "auto": known only once
    Lightning looks)."""
    devices, nodes = _devices(trainer), trainer.get("num_nodes", 1)
    if isinstance(devices, bool) or not isinstance(nodes, int):
        return None
    if isinstance(devices, int):
        return devices * nodes
    if isinstance(devices, list):
        return len(devices) * nodes
    return None


def check_config(cfg: Config) -> None:
    """Values no type can express, and the ``_target_`` nodes against their classes; raises ConfigError naming the
    first bad key."""
    check_trainer(cfg.trainer)
    _check_strategy(cfg)
    check_targets(cfg)
    p = cfg.predict
    if p.shard_size is not None:
        _positive("predict.shard_size", p.shard_size)
    if p.format not in ("parquet", "jsonl"):
        raise ConfigError("predict.format", f"{p.format!r} is not parquet or jsonl")
    for key in ("lease_ttl_s", "stall_timeout_s", "poll_interval_s", "progress_interval_s"):
        if not getattr(p, key) > 0:
            raise ConfigError(f"predict.{key}", f"{getattr(p, key)} must be positive")
    for key in ("max_attempts", "writer_queue_size"):
        _positive(f"predict.{key}", getattr(p, key))
    if p.fetch_threads is not None:  # null: chosen as the workers read
        _positive("predict.fetch_threads", p.fetch_threads)
    for key in ("max_failed_rows", "row_retries"):
        if getattr(p, key) < 0:
            raise ConfigError(f"predict.{key}", f"{getattr(p, key)} must be 0 or more")
    _positive("bench.steps", cfg.bench.steps)
    if cfg.bench.warmup_steps < 0:
        raise ConfigError("bench.warmup_steps", f"{cfg.bench.warmup_steps} must be 0 or more")
    if cfg.bench.eval_batches < 0:
        raise ConfigError("bench.eval_batches", f"{cfg.bench.eval_batches} must be 0 (no evaluation) or more")
    if not cfg.run.dir:
        raise ConfigError("run.dir", "must name an output directory")
    resume_path(cfg)


LAST = "last"
"""``ckpt_path=last``: the run's newest ``last*.ckpt``."""


def checkpoint_dirs(cfg: Config) -> list[Path]:
    """Where the run's checkpoints are: the ``dirpath`` of every ModelCheckpoint among the callbacks, and
    ``run.dir/checkpoints`` (the ``checkpoint`` callbacks option's)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    found = []
    for node in cfg.callbacks.values():
        if not targets.is_target_node(node) or not node.get("dirpath"):
            continue
        target = targets.locate("callbacks", node["_target_"])
        if inspect.isclass(target) and issubclass(target, ModelCheckpoint):
            found.append(Path(node["dirpath"]).expanduser())
    found.append(Path(cfg.run.dir) / "checkpoints")
    return [d if d.is_absolute() else Path.cwd() / d for d in dict.fromkeys(found)]


def resume_path(cfg: Config) -> Optional[Path]:
    """The checkpoint ``fit`` resumes from (``ckpt_path``), absolute; None: none. A path that does not exist, or
    ``last`` with no last checkpoint in :func:`checkpoint_dirs`, is a ConfigError."""
    if cfg.ckpt_path is None:
        return None
    if cfg.ckpt_path == LAST:
        dirs = checkpoint_dirs(cfg)
        candidates = [p for d in dirs if d.is_dir() for p in d.glob("last*.ckpt")]
        if not candidates:
            raise ConfigError("ckpt_path", f"last: no last*.ckpt in {', '.join(str(d) for d in dirs)}; a fit with"
                                           " callbacks=checkpoint (ModelCheckpoint save_last) writes one there, or"
                                           " give the checkpoint's path")
        return max(candidates, key=lambda p: p.stat().st_mtime)
    path = Path(cfg.ckpt_path).expanduser()
    path = path if path.is_absolute() else Path.cwd() / path
    if not path.exists():
        raise ConfigError("ckpt_path", f"{path} does not exist; give a checkpoint file or sharded directory, last"
                                       " (the run's last checkpoint), or null to start afresh")
    return path


def trainer_parameters() -> dict[str, inspect.Parameter]:
    import lightning as L

    return dict(inspect.signature(L.Trainer.__init__).parameters)


def check_trainer(t: dict) -> None:
    """The trainer node: arguments of lightning.Trainer, and the values the strategies depend on."""
    known = trainer_parameters()
    for key in t:
        if key in TRAINER_MANAGED:
            raise ConfigError(f"trainer.{key}", f"is set by the command line; {TRAINER_MANAGED[key]}")
        if key not in known or key == "self":
            raise ConfigError(f"trainer.{key}", "is not an argument of lightning.Trainer"
                                                f"{targets.closest(key, [k for k in known if k != 'self'])}")
        values = t[key] if isinstance(t[key], list) else [t[key]]
        for index, value in enumerate(values):
            if targets.is_target_node(value):  # an object argument: a profiler, a plugin
                targets.check_node(f"trainer.{key}" + (f"[{index}]" if isinstance(t[key], list) else ""), value)
    devices = _devices(t)
    if isinstance(devices, bool) or not (
        (isinstance(devices, int) and devices >= 1) or devices in ("auto", -1)
        or (isinstance(devices, list) and devices and all(isinstance(d, int) for d in devices))
    ):
        raise ConfigError("trainer.devices",
                          f"{devices!r} is not a positive number of processes per node, a list of device indices or"
                          " auto")
    _positive("trainer.num_nodes", t.get("num_nodes", 1))
    for key in ("accumulate_grad_batches", "log_every_n_steps"):
        if key in t:
            _positive(f"trainer.{key}", t[key])
    steps = t.get("max_steps", -1)
    if isinstance(steps, bool) or not isinstance(steps, int) or not (steps == -1 or steps >= 1):
        raise ConfigError("trainer.max_steps", f"{steps!r} must be a positive number of optimizer steps, or -1")
    clip = t.get("gradient_clip_val")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip <= 0):
        raise ConfigError("trainer.gradient_clip_val", f"{clip!r} must be positive, or null for no clipping")


def check_targets(cfg: Config) -> None:
    """Every ``_target_`` node imports and is given only arguments its class takes."""
    import lightning as L
    from lightning.pytorch.loggers import Logger

    if not cfg.model:
        raise ConfigError("model", "no model: choose one (model=NAME, a config of group model, e.g. from your"
                                   " --config-dir) or give model._target_=package.module.MyLightningModule")
    targets.check_node("model", cfg.model, L.LightningModule, "a LightningModule")
    data = cfg.data
    if data is not None:
        if targets.is_target_node(data):
            targets.check_node("data", data, None, "a LightningDataModule")
        elif isinstance(data, dict):
            for key, node in data.items():
                if key not in DATA_LOADER_KEYS:
                    raise ConfigError(f"data.{key}", "data is a _target_ node (a LightningDataModule) or a mapping of"
                                                     f" {', '.join(DATA_LOADER_KEYS)} dataloader nodes")
                if node is not None:
                    targets.check_node(f"data.{key}", node, None, "a DataLoader")
    targets.check_nodes("callbacks", cfg.callbacks, L.Callback, "a Lightning Callback")
    targets.check_nodes("logger", cfg.logger, Logger, "a Lightning Logger")


def _check_strategy(cfg: Config) -> None:
    s, world = cfg.strategy, world_size(cfg.trainer)
    if s.process_group_backend not in BACKENDS:
        raise ConfigError("strategy.process_group_backend", f"{s.process_group_backend!r} is not gloo, nccl or null")
    if isinstance(s, ParoStrategyConfig):
        s.to_options()  # every PaRO option, checked by the library
        if str(cfg.trainer.get("precision")) == "16-mixed":
            raise ConfigError("trainer.precision", "16-mixed is refused by PaRO (per-shard inf checks); use bf16-mixed")
    else:  # the options DDP and FSDP2 share with PaRO follow its rules
        shared = {key: getattr(s, key) for key in ("group_size", "start_method") if hasattr(s, key)}
        with strategy_errors():
            PaROOptions(**shared, timeout=timedelta(seconds=s.timeout_s))
    group_size = getattr(s, "group_size", None)
    if s.name == "fsdp2" and group_size is not None:  # a config file's was left out (compose.py): this one was given
        raise ConfigError("strategy.group_size", "fsdp2 shards over all ranks and would ignore it; shard in groups"
                                                 " with strategy=hsdp, or drop it")
    if group_size is not None and world is not None and world % group_size:
        divisors = [str(k) for k in range(1, world + 1) if world % k == 0]
        raise ConfigError(
            "strategy.group_size",
            f"{group_size} does not divide the world size trainer.devices * trainer.num_nodes ="
            f" {_devices(cfg.trainer)} * {cfg.trainer.get('num_nodes', 1)} = {world}; use one of {', '.join(divisors)}",
        )


def check_launch_environment(cfg: Config, environ: Optional[dict] = None) -> None:
    """Under torchrun the process layout is torchrun's: trainer.devices and num_nodes must agree with it."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in env or "LOCAL_WORLD_SIZE" not in env:
        return
    local, total = int(env["LOCAL_WORLD_SIZE"]), int(env.get("WORLD_SIZE", env["LOCAL_WORLD_SIZE"]))
    devices, nodes = _devices(cfg.trainer), cfg.trainer.get("num_nodes", 1)
    if devices != local:
        raise ConfigError(
            "trainer.devices",
            f"{devices!r} but torchrun started {local} processes per node (--nproc_per_node);"
            f" pass trainer.devices={local}",
        )
    if nodes * local != total:
        raise ConfigError(
            "trainer.num_nodes",
            f"{nodes} but torchrun's world is {total} processes, {local} per node;"
            f" pass trainer.num_nodes={total // local}",
        )


def _positive(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, f"{value!r} must be a positive integer")
