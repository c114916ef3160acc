"""Objects from a checked config: the strategy, the Trainer, the model and the data. Plain functions, no side effects
beyond seeding (build_model)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional, Sequence

import lightning as L
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy

from lightning_paro import VALID_STRATEGIES, PaROStrategy
from lightning_paro.cli import targets
from lightning_paro.cli.checks import world_size
from lightning_paro.cli.progress import StepProgressBar
from lightning_paro.cli.schema import (
    Config,
    ConfigError,
    DDPStrategyConfig,
    FSDP2StrategyConfig,
    ParoStrategyConfig,
)


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy as pure data parallelism with FSDP2, for any LightningModule: unless the
    model sharded itself in ``configure_model`` (over :meth:`fsdp_mesh`), ``fully_shard`` is applied here to its
    repeated blocks (the units PaRO would pick) and then to the whole model. With ``group_size`` set it is HSDP:
    shards inside groups of that many ranks, replicas across groups."""

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

    def setup(self, trainer: L.Trainer) -> None:
        from lightning.pytorch.utilities.model_helpers import is_overridden
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        from lightning_paro.strategy.units import find_units

        module = self.lightning_module
        if not any(isinstance(p, DTensor) for p in module.parameters()):
            mesh = self.fsdp_mesh()
            for _, unit in find_units(module, "auto"):
                fully_shard(unit, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
            fully_shard(module, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        if is_overridden("configure_model", module):
            super().setup(trainer)
            return
        # ModelParallelStrategy refuses a model without its own configure_model hook, as the model is expected to
        # shard itself there; this one was sharded above, so the hook is made to look overridden while it checks
        module.configure_model = _nothing
        try:
            super().setup(trainer)
        finally:
            del module.configure_model


def _nothing() -> None:
    return None


def build_strategy(cfg: Config) -> Strategy:
    """The strategy object the ``strategy`` group describes."""
    s = cfg.strategy
    timeout = timedelta(seconds=s.timeout_s)
    if isinstance(s, ParoStrategyConfig):
        return PaROStrategy(**s.to_options().as_kwargs())
    if isinstance(s, DDPStrategyConfig):
        return DDPStrategy(start_method=s.start_method, find_unused_parameters=s.find_unused_parameters,
                           process_group_backend=s.process_group_backend, timeout=timeout)
    if isinstance(s, FSDP2StrategyConfig):
        world = world_size(cfg.trainer)
        if world is None:
            raise ConfigError("trainer.devices",
                              f"strategy={s.name} needs a number of devices, not {cfg.trainer.get('devices')!r}")
        devices = cfg.trainer.get("devices")
        per_node = len(devices) if isinstance(devices, list) else devices
        group = (s.group_size or per_node) if s.name == "hsdp" else None
        if group is not None and world % group:
            raise ConfigError("strategy.group_size", f"{group} does not divide the world size {world}")
        return FSDP2Strategy(world, group_size=group, reshard_after_forward=s.reshard_after_forward,
                             process_group_backend=s.process_group_backend, timeout=timeout)
    raise ConfigError("strategy.name", f"no strategy is built for {type(s).__name__}")


def build_trainer(cfg: Config, *, callbacks: Sequence[L.Callback] = (), user_callbacks: bool = True,
                  loggers: bool = True, max_steps: Optional[int] = None, validate: bool = True,
                  **overrides: Any) -> L.Trainer:
    """A Trainer with the ``trainer`` group's arguments as they are, the configured strategy, the ``callbacks`` and
    ``logger`` groups' objects (unless ``user_callbacks``/``loggers`` is False), ``callbacks`` of the command and
    ``run.dir`` as the root directory.

    With a progress bar, the command line's :class:`StepProgressBar` replaces Lightning's unless a progress bar is
    among the callbacks; ``enable_checkpointing`` follows whether a ModelCheckpoint is among them, unless set.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar

    kwargs: dict[str, Any] = {key: _built(f"trainer.{key}", value) for key, value in cfg.trainer.items()}
    chosen = targets.instantiate_nodes("callbacks", cfg.callbacks) if user_callbacks else []
    everything = [*chosen, *callbacks]
    if kwargs.get("enable_progress_bar", True) and not any(isinstance(c, ProgressBar) for c in everything):
        everything.append(StepProgressBar())
    kwargs.setdefault("enable_checkpointing", any(isinstance(c, ModelCheckpoint) for c in everything))
    logger_objects = targets.instantiate_nodes("logger", cfg.logger) if loggers else []
    kwargs.update(strategy=build_strategy(cfg), callbacks=everything, logger=logger_objects or False,
                  default_root_dir=cfg.run.dir)
    if max_steps is not None:
        kwargs["max_steps"] = max_steps
    if not validate:
        kwargs["limit_val_batches"] = 0
    kwargs.update(overrides)
    try:
        return L.Trainer(**kwargs)
    except (ValueError, TypeError, MisconfigurationException) as exc:
        # Raised while Lightning resolves accelerator, devices and strategy, before any process starts: these are
        # the trainer group's values not fitting this machine or each other (e.g. no GPU, a group size that does
        # not divide the devices "auto" found).
        raise ConfigError("trainer", str(exc).strip().splitlines()[0]) from None


def _built(key: str, value: Any) -> Any:
    """A trainer argument, with ``_target_`` nodes (a profiler, plugins) built."""
    if targets.is_target_node(value):
        return targets.instantiate(key, value)
    if isinstance(value, list):
        return [targets.instantiate(f"{key}[{i}]", v) if targets.is_target_node(v) else v for i, v in enumerate(value)]
    return value


def build_model(cfg: Config) -> L.LightningModule:
    """The ``model`` node's LightningModule, initialised from ``run.seed`` (every rank builds the same weights)."""
    L.seed_everything(cfg.run.seed, verbose=False)
    model = targets.instantiate("model", cfg.model)
    if not isinstance(model, L.LightningModule):
        raise ConfigError("model._target_", f"{cfg.model['_target_']} built a {type(model).__name__}, not a"
                                            " LightningModule")
    return model


@dataclass
class Data:
    """What the ``data`` node built: a LightningDataModule, dataloaders by stage, or nothing (the model's hooks)."""

    datamodule: Optional[L.LightningDataModule] = None
    """The datamodule, when the node built one."""
    loaders: dict[str, Any] = field(default_factory=dict)
    """train/val/test/predict -> dataloader, when the node built those."""

    def fit_kwargs(self) -> dict[str, Any]:
        if self.datamodule is not None:
            return {"datamodule": self.datamodule}
        if self.loaders:
            if "train" not in self.loaders:
                raise ConfigError("data.train", "fit needs a train dataloader (data.train._target_=...)")
            return {"train_dataloaders": self.loaders["train"], "val_dataloaders": self.loaders.get("val")}
        return {}

    def predict_kwargs(self) -> dict[str, Any]:
        if self.datamodule is not None:
            return {"datamodule": self.datamodule}
        if self.loaders:
            if "predict" not in self.loaders:
                raise ConfigError("data.predict", "predict needs a predict dataloader (data.predict._target_=...)")
            return {"dataloaders": self.loaders["predict"]}
        return {}


def build_data(cfg: Config) -> Data:
    """The ``data`` node's objects."""
    node = cfg.data
    if node is None:
        return Data()
    if targets.is_target_node(node):
        built = targets.instantiate("data", node)
        if isinstance(built, L.LightningDataModule):
            return Data(datamodule=built)
        return Data(loaders={"train": built})  # a single dataloader: the training data
    return Data(loaders={key: targets.instantiate(f"data.{key}", sub) for key, sub in node.items() if sub is not None})


def strategy_label(cfg: Config) -> str:
    """A short name for tables: ``paro IIG (m=2)``, ``ddp``, ``fsdp2``, ``hsdp (m=2)``."""
    s = cfg.strategy
    if isinstance(s, ParoStrategyConfig):
        sharding = s.sharding.upper() if s.sharding.upper() in VALID_STRATEGIES else s.sharding
        return f"paro {sharding}" + (f" (m={s.group_size})" if s.group_size else "")
    if s.name == "hsdp":
        return "hsdp" + (f" (m={s.group_size})" if s.group_size else "")
    return s.name
