"""Objects from a checked config: the strategy, the Trainer, the model. Plain functions, no side effects."""

from __future__ import annotations

import importlib
from datetime import timedelta
from typing import Any, Optional, Sequence

import lightning as L
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy

from lightning_paro import VALID_STRATEGIES, PaROStrategy
from lightning_paro.strategy.auto import AutoConfig
from lightning_paro.strategy.cost_model import Link
from lightning_paro.cli.compose import world_size
from lightning_paro.cli.schema import (
    Config,
    ConfigError,
    DDPStrategyConfig,
    FSDP2StrategyConfig,
    ParoStrategyConfig,
)
from lightning_paro.cli.task import GPTTask


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy as pure data parallelism with FSDP2: the model shards itself over
    :meth:`fsdp_mesh` in ``configure_model``. With ``group_size`` set it is HSDP: shards inside groups of that many
    ranks, replicas across groups."""

    def __init__(self, world: int, group_size: Optional[int] = None, reshard_after_forward: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(data_parallel_size=world, tensor_parallel_size=1, save_distributed_checkpoint=False,
                         **kwargs)
        self.group_size = group_size
        self.reshard_after_forward = reshard_after_forward

    def fsdp_mesh(self):
        """The mesh to shard over: the data-parallel ranks, or (replicas, shard group) for HSDP."""
        if self.group_size is None:
            return self.device_mesh["data_parallel"]
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.root_device.type, (self.world_size // self.group_size, self.group_size),
                                mesh_dim_names=("replicate", "shard"))


def _units(names: Any) -> Any:
    if names == "auto":
        return "auto"
    classes = []
    for dotted in names:
        module_name, _, class_name = dotted.rpartition(".")
        try:
            classes.append(getattr(importlib.import_module(module_name), class_name))
        except (ImportError, AttributeError, ValueError):
            raise ConfigError("strategy.units", f"cannot import {dotted!r}; give dotted module class names") from None
    return classes


def build_strategy(cfg: Config) -> Strategy:
    """The strategy object the ``strategy`` group describes."""
    s = cfg.strategy
    timeout = timedelta(seconds=s.timeout_s)
    if isinstance(s, ParoStrategyConfig):
        sharding = s.sharding.upper() if s.sharding.upper() in VALID_STRATEGIES else s.sharding
        auto = AutoConfig(memory_budget=s.memory_budget, micro_step_seconds=s.micro_step_seconds,
                          intra=Link.gbit(s.intra_gbps, overlap=s.intra_overlap) if s.intra_gbps else None,
                          inter=Link.gbit(s.inter_gbps, overlap=s.inter_overlap) if s.inter_gbps else None)
        return PaROStrategy(sharding=sharding, group_size=s.group_size, units=_units(s.units), auto=auto,
                            prefetch=s.prefetch, chunk_bytes=s.chunk_bytes, log_traffic=s.log_traffic,
                            state_dict_type=s.state_dict_type, start_method=s.start_method,
                            process_group_backend=s.process_group_backend, timeout=timeout)
    if isinstance(s, DDPStrategyConfig):
        return DDPStrategy(start_method=s.start_method, find_unused_parameters=s.find_unused_parameters,
                           process_group_backend=s.process_group_backend, timeout=timeout)
    if isinstance(s, FSDP2StrategyConfig):
        world = world_size(cfg.trainer)
        if world is None:
            raise ConfigError("trainer.devices",
                              f"strategy={s.name} needs a number of devices, not {cfg.trainer.devices!r}")
        group = (s.group_size or cfg.trainer.devices) if s.name == "hsdp" else None
        if group is not None and world % group:
            raise ConfigError("strategy.group_size", f"{group} does not divide the world size {world}")
        return FSDP2Strategy(world, group_size=group, reshard_after_forward=s.reshard_after_forward,
                             process_group_backend=s.process_group_backend, timeout=timeout)
    raise ConfigError("strategy.name", f"no strategy is built for {type(s).__name__}")


def build_trainer(cfg: Config, *, callbacks: Sequence[L.Callback] = (), logger: Any = False,
                  max_steps: Optional[int] = None, validate: bool = True, **overrides: Any) -> L.Trainer:
    """A Trainer with the ``trainer`` group's arguments and the configured strategy.

    Validation (when ``validate`` and limit_val_batches allows it) runs once, after the last optimizer step:
    ``val_check_interval`` counts micro-batches across epochs, so short runs on small data still reach it.
    """
    t = cfg.trainer
    steps = max_steps if max_steps is not None else t.max_steps
    run_val = validate and t.limit_val_batches not in (0, 0.0)
    kwargs: dict[str, Any] = dict(
        accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, precision=t.precision,
        strategy=build_strategy(cfg), max_steps=steps, max_epochs=-1,
        accumulate_grad_batches=t.accumulate_grad_batches, gradient_clip_val=t.gradient_clip_val,
        log_every_n_steps=t.log_every_n_steps, enable_progress_bar=t.enable_progress_bar,
        deterministic=t.deterministic, logger=logger, callbacks=list(callbacks), enable_checkpointing=False,
        default_root_dir=cfg.run.dir, enable_model_summary=False,
        limit_val_batches=t.limit_val_batches if run_val else 0,
        num_sanity_val_steps=0,
    )
    if run_val:
        kwargs.update(val_check_interval=steps * t.accumulate_grad_batches, check_val_every_n_epoch=None)
    kwargs.update(overrides)
    try:
        return L.Trainer(**kwargs)
    except (ValueError, MisconfigurationException) as exc:
        # Raised while Lightning resolves accelerator, devices and strategy, before any process starts: these are
        # the trainer group's values not fitting this machine or each other (e.g. no GPU, a group size that does
        # not divide the devices "auto" found).
        raise ConfigError("trainer", str(exc).strip().splitlines()[0]) from None


def build_model(cfg: Config) -> GPTTask:
    """The model, initialised from ``run.seed`` (every rank builds the same weights)."""
    L.seed_everything(cfg.run.seed, verbose=False)
    return GPTTask(cfg.model)


def strategy_label(cfg: Config) -> str:
    """A short name for tables: ``paro IIG (m=2)``, ``ddp``, ``fsdp2``, ``hsdp (m=2)``."""
    s = cfg.strategy
    if isinstance(s, ParoStrategyConfig):
        sharding = s.sharding.upper() if s.sharding.upper() in VALID_STRATEGIES else s.sharding
        return f"paro {sharding}" + (f" (m={s.group_size})" if s.group_size else "")
    if s.name == "hsdp":
        return "hsdp" + (f" (m={s.group_size})" if s.group_size else "")
    return s.name
