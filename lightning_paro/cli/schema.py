"""The configuration schema, checked after Hydra composes the config tree.

Two kinds of node: the ``strategy`` node and the command settings (``predict``, ``bench``, ``run``) are frozen
dataclasses, merged with what Hydra composed (unknown keys and wrong types are refused by OmegaConf) and then checked
for values no type can express (a sharding that does not exist, a group size that does not divide the world); the
PaRO strategy node takes its defaults and its checks from the library's ``PaROOptions``. The
``model``, ``data``, ``callbacks`` and ``logger`` nodes are ``_target_`` nodes built with ``hydra.utils.instantiate``,
checked against the signature of the class they name, and ``trainer`` is a dict of ``lightning.Trainer`` arguments.
Every refusal is a :class:`ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterator, Optional

from lightning_paro.planner import AutoConfig, Link
from lightning_paro.predict.config import ElasticPredictConfig
from lightning_paro.strategy.options import OptionError, PaROOptions


class ConfigError(ValueError):
    """A configuration value that cannot work; ``key`` is its dotted name, the message says what to do."""

    def __init__(self, key: str, message: str, job: str = "") -> None:
        text = f"{key}: {message}" if key else message
        super().__init__(f"{job}: {text}" if job else text)
        self.key = key
        self.message = message
        self.job = job
        """The sweep job the error is in (``job 2 of 2 (strategy=ddp)``); empty outside a sweep."""


# ---------------------------------------------------------------------------------------------------- strategy
LIBRARY = PaROOptions()
"""PaROStrategy's own defaults (:class:`~lightning_paro.strategy.options.PaROOptions`): the strategy node's defaults,
every one of them (``strategy=paro`` is ``PaROStrategy()``; the ``paro_xxx`` configs pin a sharding)."""
AUTO = LIBRARY.auto_config
"""The defaults of ``sharding="auto"``'s options."""
_CLI_KEYS = {"timeout": "timeout_s"}
"""PaROOptions fields the strategy node names differently."""


@contextmanager
def strategy_errors() -> Iterator[None]:
    """An option the library refuses (:class:`OptionError`) as a ConfigError naming its key ``strategy.<key>``."""
    try:
        yield
    except OptionError as err:
        raise ConfigError(f"strategy.{_CLI_KEYS.get(err.option, err.option)}", str(err)) from None


@dataclass(frozen=True)
class ParoStrategyConfig:
    """``lightning_paro.PaROStrategy``: PaRO-DP sharding of parameters, gradients and optimizer states.

    Each key is an option of :class:`~lightning_paro.strategy.options.PaROOptions` (or of ``AutoConfig``, for
    ``sharding=auto``), which documents it, gives its default and checks it (:meth:`to_options`); only the form a
    command line can give differs, as noted. A key that the configuration would not read (an ``AutoConfig`` key
    with a fixed sharding, ``gather`` where parameters are not sharded, ...) is refused by name.
    """

    name: str = "paro"
    """Which strategy schema the node uses; set by the config file."""
    sharding: str = LIBRARY.sharding
    """Three letters N/I/G for parameters, gradients, optimizer states (one of the 14 valid strategies), or `auto`:
    probe the links at start-up and take the fastest strategy that fits (docs/auto.md). `strategy=paro_iig` (and the
    other 13) pins one."""
    group_size: Optional[int] = LIBRARY.group_size
    """Ranks per group (m); must divide `trainer.devices * trainer.num_nodes`; null: processes per node."""
    units: Any = LIBRARY.units
    """Blocks gathered and freed together: `auto` (the repeated blocks) or a list of dotted class names."""
    prefetch: int = LIBRARY.prefetch
    chunk_bytes: Optional[int] = LIBRARY.chunk_bytes
    memory_budget: float = AUTO.memory_budget
    """`sharding=auto`: share of a rank's memory (at most 1) or bytes (above 1) the chosen strategy may use."""
    micro_step_seconds: Optional[float] = AUTO.micro_step_seconds
    """`sharding=auto`: compute time of one micro-step if known, so the plan counts what hides behind it (otherwise it
    is measured on the first steps and used by the re-plan)."""
    replan_after_steps: int = AUTO.replan_after_steps
    """`sharding=auto`: after this many optimizer steps, plan again with the measured compute time and activation memory
    and switch strategy in place if worth it (0: plan once; see [auto.md](auto.md#re-planning-in-place))."""
    replan_margin: float = AUTO.replan_margin
    """`sharding=auto`: the predicted gain a switch needs (0.1: 10% faster), unless the strategy in use no longer
    fits."""
    trial_margin: float = AUTO.trial_margin
    """`sharding=auto`: when the re-plan keeps the strategy in use, try the fastest one predicted at most this much
    slower that differs in the gradient level only (NNG and NGG, say) for `replan_after_steps` steps and keep the faster
    measured, when the fit goes on at least as many steps after the trial (0: no trial; see
    [auto.md](auto.md#re-planning-in-place))."""
    first_plan: Optional[str] = AUTO.first_plan
    """`sharding=auto`: start with this strategy instead of the start-up plan's choice (the re-plan then judges it)."""
    link_cache: bool = AUTO.link_cache
    """`sharding=auto`: reuse the links an earlier job measured on the same hosts and groups (and the optimizer update's
    bandwidth) once the probe's large all-gather per link class, timed again, confirms them (within 2x); false: measure
    every time ([auto.md](auto.md#the-link-cache))."""
    strategies: Optional[list] = None
    """`sharding=auto`: the strategies to choose among, e.g. `[NNG,IIG,GGG]`; null: all 14."""
    intra_gbps: Optional[float] = None
    """`sharding=auto`: intra-group bandwidth per rank (Gbit/s); with `inter_gbps` it replaces the start-up probe."""
    inter_gbps: Optional[float] = None
    """`sharding=auto`: inter-group bandwidth per rank (Gbit/s)."""
    intra_overlap: float = Link(1.0).overlap
    """`sharding=auto` with given bandwidths: share of a transfer's time that hides behind compute (1: NVLink, NICs; 0:
    transfers that take the CPU cores the compute runs on); the probe measures them otherwise."""
    inter_overlap: float = Link(1.0).overlap
    """`sharding=auto` with given bandwidths: `intra_overlap` for the link between groups."""
    log_traffic: bool = LIBRARY.log_traffic
    state_dict_type: str = LIBRARY.state_dict_type
    """Checkpoints (`weights.ckpt`, `ModelCheckpoint`'s) as a directory of per-rank shards (`sharded`: any world size,
    group size or strategy resumes it) or one file (`full`: `torch.load` and `LightningModule.load_from_checkpoint` open
    it in one process). `predict` and `ckpt_path` read both; `lightning_paro.load_from_checkpoint(MyModule, path)` or
    `python -m lightning_paro.convert DIR FILE` read a sharded one where a file is expected."""
    gather: str = LIBRARY.gather
    """`validate`, `test`, `predict` and the module after `fit`: `full` gathers the whole model, `sharded` one unit at a
    time (the module stays sharded after fit; read it through a checkpoint), `auto` full when the whole model fits half
    the free memory (as `PaROStrategy(gather=...)`)."""
    start_method: str = LIBRARY.start_method
    process_group_backend: Optional[str] = LIBRARY.process_group_backend
    """`gloo` or `nccl`; null: the device's default."""
    timeout_s: float = LIBRARY.timeout.total_seconds()
    """Collective timeout in seconds."""
    param_dtype: Optional[str] = LIBRARY.param_dtype
    """`bf16`: gather parameters in bf16 during training (every all-gather before a unit's use, and the sync after the
    optimizer step), half their bytes; every rank computes with the same bf16-rounded copy and the optimizer shard stays
    the fp32 master. `fp32` or null: exact ([Communication dtypes](#communication-dtypes))."""
    reduce_dtype: Optional[str] = LIBRARY.reduce_dtype
    """`bf16`: reduce gradients in bf16 (every reduce-scatter and all-reduce sends and sums in bf16; the accumulators
    stay fp32), half their bytes. `fp32` or null: exact."""
    inter_quant: Optional[str] = LIBRARY.inter_quant
    """`int8`: every hop between groups goes block-quantized, about a quarter of fp32's bytes there; everything inside
    groups as before ([Quantized traffic between groups](#quantized-traffic-between-groups)). null: none."""
    error_feedback: bool = LIBRARY.error_feedback
    """With `inter_quant`: each rank carries what quantizing its gradients left out into its next reduction, so rounding
    errors cancel over steps (an fp32 buffer of 1/m of the trainable parameters per rank; in sharded checkpoints)."""

    def to_options(self) -> PaROOptions:
        """The library's options for this node, checked there; a value they refuse is a ConfigError naming its key
        (unit classes are imported here)."""
        if (self.intra_gbps is None) != (self.inter_gbps is None):
            raise ConfigError("strategy.inter_gbps" if self.inter_gbps is None else "strategy.intra_gbps",
                              "give both strategy.intra_gbps and strategy.inter_gbps to skip the link probe, or"
                              " neither")
        with strategy_errors():
            auto = AutoConfig(memory_budget=self.memory_budget, micro_step_seconds=self.micro_step_seconds,
                              intra=self._link("intra"), inter=self._link("inter"),
                              replan_after_steps=self.replan_after_steps, replan_margin=self.replan_margin,
                              trial_margin=self.trial_margin,
                              first_plan=self.first_plan, link_cache=self.link_cache,
                              strategies=tuple(self.strategies) if self.strategies is not None else None)
        changed = [key for key in AUTO_KEYS if getattr(self, key) != getattr(ParoStrategyConfig, key)]
        try:
            with strategy_errors():
                return PaROOptions(sharding=self.sharding, group_size=self.group_size,
                                   units=_unit_classes(self.units), prefetch=self.prefetch,
                                   chunk_bytes=self.chunk_bytes, log_traffic=self.log_traffic,
                                   # AutoConfig's keys are passed on when they say something (the defaults are
                                   # PaROStrategy()'s auto=None); PaROOptions refuses them with a fixed sharding
                                   auto=auto if changed else None,
                                   state_dict_type=self.state_dict_type, gather=self.gather,
                                   start_method=self.start_method, process_group_backend=self.process_group_backend,
                                   timeout=timedelta(seconds=self.timeout_s), param_dtype=self.param_dtype,
                                   reduce_dtype=self.reduce_dtype, inter_quant=self.inter_quant,
                                   error_feedback=self.error_feedback)
        except ConfigError as err:
            if err.key != "strategy.auto":
                raise
            key = changed[0]
            raise ConfigError(f"strategy.{key}", f"{getattr(self, key)!r} is an option of sharding=auto; with"
                                                 f" strategy.sharding={self.sharding} it would be ignored: drop it,"
                                                 " or choose strategy=paro (sharding=auto)") from None

    def _link(self, side: str) -> Optional[Link]:
        """The given link of one side (None: the probe measures it); Link checks the overlap even without one, and
        an overlap set without a bandwidth (the probe measures both) is refused."""
        gbps, overlap = getattr(self, f"{side}_gbps"), getattr(self, f"{side}_overlap")
        try:
            Link(math.inf, overlap=overlap)
        except ValueError as err:
            raise ConfigError(f"strategy.{side}_overlap", str(err)) from None
        if gbps is None and overlap != getattr(ParoStrategyConfig, f"{side}_overlap"):
            raise ConfigError(f"strategy.{side}_overlap", f"{overlap} goes with a given bandwidth; without"
                                                         f" strategy.{side}_gbps the probe measures the link, overlap"
                                                         " included, and would ignore it: drop it, or give"
                                                         " strategy.intra_gbps and strategy.inter_gbps")
        if gbps is None:
            return None
        try:
            return Link.gbit(gbps, overlap=overlap)
        except ValueError as err:
            raise ConfigError(f"strategy.{side}_gbps", f"{gbps} Gbit/s: {err}") from None


AUTO_KEYS = ("memory_budget", "micro_step_seconds", "replan_after_steps", "replan_margin", "trial_margin", "first_plan",
             "link_cache", "strategies", "intra_gbps", "inter_gbps", "intra_overlap", "inter_overlap")
"""The strategy node's keys that configure ``sharding=auto`` (``AutoConfig``): with a fixed sharding, any of them set
to another value than its default is an error."""


def _unit_classes(names: Any) -> Any:
    """strategy.units as PaROOptions.units: "auto", or the module classes the dotted names import."""
    if names == "auto":
        return "auto"
    if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
        raise ConfigError("strategy.units", f"{names!r} must be auto or a list of dotted module class names")
    classes = []
    for dotted in names:
        module_name, _, class_name = dotted.rpartition(".")
        try:
            classes.append(getattr(importlib.import_module(module_name), class_name))
        except (ImportError, AttributeError, ValueError):
            raise ConfigError("strategy.units", f"cannot import {dotted!r}; give dotted module class names") from None
    return classes


@dataclass(frozen=True)
class DDPStrategyConfig:
    """Lightning's ``DDPStrategy``: the unsharded baseline (PaRO's NNN with Lightning's own engine)."""

    name: str = "ddp"
    """Set by the config file."""
    start_method: str = "popen"
    """`popen`, `spawn`, `fork` or `forkserver`."""
    find_unused_parameters: bool = False
    """Let DDP tolerate parameters without gradients."""
    process_group_backend: Optional[str] = None
    """`gloo` or `nccl`."""
    timeout_s: float = 1800.0
    """Collective timeout in seconds."""


@dataclass(frozen=True)
class FSDP2StrategyConfig:
    """FSDP2 (``torch.distributed.fsdp.fully_shard``) through Lightning's ``ModelParallelStrategy``.

    ``fsdp2`` shards every block and the root over all ranks (like PaRO's GGG); ``hsdp`` shards inside groups of
    ``group_size`` ranks and replicates across groups (like PaRO's III).
    """

    name: str = "fsdp2"
    """Set by the config file."""
    group_size: Optional[int] = None
    """`hsdp` only: ranks per shard group; must divide the world size; null: processes per node."""
    reshard_after_forward: bool = True
    """Free gathered parameters after each block's forward."""
    process_group_backend: Optional[str] = None
    """`gloo` or `nccl`."""
    timeout_s: float = 1800.0
    """Collective timeout in seconds."""


UNREAD_KEYS: dict[str, frozenset[str]] = {"fsdp2": frozenset({"group_size"})}
"""Keys of a schema that a strategy sharing it does not read (``fsdp2`` shards over all ranks; ``hsdp`` reads
``group_size``)."""

STRATEGY_SCHEMAS: dict[str, type] = {
    "paro": ParoStrategyConfig,
    "ddp": DDPStrategyConfig,
    "fsdp2": FSDP2StrategyConfig,
    "hsdp": FSDP2StrategyConfig,
}
"""``strategy.name`` -> the dataclass that checks that node."""

BACKENDS = (None, "gloo", "nccl")
"""The backends the command line offers (PaROStrategy itself keeps any backend string as given)."""


# ---------------------------------------------------------------------------------------------------- the rest
ELASTIC = {f.name: f.default for f in dataclasses.fields(ElasticPredictConfig)}
"""ElasticPredict's own defaults (:class:`~lightning_paro.predict.config.ElasticPredictConfig`), which the predict
node's keys take."""


@dataclass(frozen=True)
class PredictConfig:
    """The predict command: ``lightning_paro.predict.ElasticPredict`` over the data's predict dataloader, with the
    weights of a checkpoint. Every key but checkpoint and output_dir is the option of the same name of
    ElasticPredict (:class:`~lightning_paro.predict.config.ElasticPredictConfig`, docs/predict.md), which documents
    it, gives its default and checks it."""

    checkpoint: Optional[str] = None
    """Checkpoint whose `state_dict` is loaded into the model; null: `<run.dir>/weights.ckpt` (a sharded checkpoint
    directory works too)."""
    output_dir: Optional[str] = None
    """Where the predictions go; null: `<run.dir>/predictions`."""
    format: str = ELASTIC["format"]
    shard_size: Optional[int] = ELASTIC["shard_size"]
    index_column: str = ELASTIC["index_column"]
    id_column: Optional[str] = ELASTIC["id_column"]
    ledger: Optional[str] = ELASTIC["ledger"]
    job_name: Optional[str] = ELASTIC["job_name"]
    lease_ttl_s: float = ELASTIC["lease_ttl_s"]
    heartbeat_interval_s: Optional[float] = ELASTIC["heartbeat_interval_s"]
    stall_timeout_s: float = ELASTIC["stall_timeout_s"]
    max_attempts: int = ELASTIC["max_attempts"]
    speculate_after_s: Optional[float] = ELASTIC["speculate_after_s"]
    poll_interval_s: float = ELASTIC["poll_interval_s"]
    fetch_threads: Optional[int] = ELASTIC["fetch_threads"]
    row_retries: int = ELASTIC["row_retries"]
    unit_retries: int = ELASTIC["unit_retries"]
    unit_retry_backoff_s: float = ELASTIC["unit_retry_backoff_s"]
    max_failed_rows: int = ELASTIC["max_failed_rows"]
    writer_queue_size: int = ELASTIC["writer_queue_size"]
    progress_interval_s: float = ELASTIC["progress_interval_s"]
    worker_name: Optional[str] = ELASTIC["worker_name"]

    def elastic_options(self) -> dict[str, Any]:
        """The keyword arguments of ElasticPredict besides the output directory."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("checkpoint", "output_dir")}


@dataclass(frozen=True)
class BenchConfig:
    """The bench command: throughput of a few training steps with the configured strategy."""

    warmup_steps: int = 2
    """Optimizer steps before timing starts."""
    steps: int = 5
    """Optimizer steps timed."""
    memory: bool = False
    """Fix glibc's mmap threshold so that the CPU peak memory follows the tensors alive (every large allocation is then
    mapped afresh, which costs time: leave it off to compare throughput)."""
    eval_batches: int = 0
    """After training, `validate` on the same Trainer for that many batches and report that stage's peak memory (needs
    validation data)."""


@dataclass(frozen=True)
class RunConfig:
    """Where a run writes and how it is seeded."""

    name: str = "default"
    """Name of the run."""
    dir: str = "runs/${run.name}"
    """Output directory, made absolute against the working directory."""
    seed: int = 0
    """Seed of the model's initialisation and the data order."""


@dataclass(frozen=True)
class Config:
    """Everything one command needs. The ``_target_`` nodes are plain dicts with their interpolations resolved."""

    strategy: Any = field(default_factory=ParoStrategyConfig)
    """The distributed strategy (group strategy)."""
    model: dict = field(default_factory=dict)
    """The LightningModule: a ``_target_`` node and its arguments (group model)."""
    data: Optional[dict] = None
    """The data: a ``_target_`` node (a LightningDataModule), a dict of train/val/test/predict ``_target_`` nodes
    (dataloaders), or null for the model's own ``*_dataloader`` hooks (group data)."""
    trainer: dict = field(default_factory=dict)
    """Keyword arguments of ``lightning.Trainer`` (group trainer)."""
    callbacks: dict = field(default_factory=dict)
    """Name -> ``_target_`` node of a Lightning callback (group callbacks)."""
    logger: dict = field(default_factory=dict)
    """Name -> ``_target_`` node of a Lightning logger (group logger); empty: no logger."""
    predict: PredictConfig = field(default_factory=PredictConfig)
    """The predict command's settings (group predict)."""
    bench: BenchConfig = field(default_factory=BenchConfig)
    """The bench command's settings."""
    run: RunConfig = field(default_factory=RunConfig)
    """Output directory and seed."""
    ckpt_path: Optional[str] = None
    """fit: the checkpoint to resume from (a file or a sharded directory), or ``last``: the newest ``last*.ckpt`` of
    the run's ModelCheckpoint directories; null: start afresh."""
    left_out: tuple[str, ...] = field(default=(), compare=False)
    """Keys of another strategy that config files set in the strategy node (an experiment written for PaRO, run with
    strategy=ddp), left out as ``key=value``; reported, not part of the config."""


TARGET_GROUPS = ("model", "data", "callbacks", "logger")
"""The top-level nodes built with ``hydra.utils.instantiate``."""
