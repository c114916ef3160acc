"""The configuration schema, checked after Hydra composes the config tree.

Two kinds of node: the ``strategy`` node and the command settings (``predict``, ``bench``, ``run``) are frozen
dataclasses, merged with what Hydra composed (unknown keys and wrong types are refused by OmegaConf) and then checked
for values no type can express (a sharding that does not exist, a group size that does not divide the world). The
``model``, ``data``, ``callbacks`` and ``logger`` nodes are ``_target_`` nodes built with ``hydra.utils.instantiate``,
checked against the signature of the class they name, and ``trainer`` is a dict of ``lightning.Trainer`` arguments.
Every refusal is a :class:`ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

class ConfigError(ValueError):
    """A configuration value that cannot work; ``key`` is its dotted name, the message says what to do."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key
        self.message = message


# ---------------------------------------------------------------------------------------------------- strategy
@dataclass(frozen=True)
class ParoStrategyConfig:
    """``lightning_paro.PaROStrategy``: PaRO-DP sharding of parameters, gradients and optimizer states."""

    name: str = "paro"
    """Which strategy schema this node uses (set by the config file; selects the strategy class)."""
    sharding: str = "IIG"
    """Three letters (N, I or G) for parameters, gradients and optimizer states (one of the 14 valid strategies), or
    auto. The command line defaults to IIG, which starts at once; PaROStrategy's own default is auto, which probes
    the links at start-up and picks one."""
    group_size: Optional[int] = None
    """Ranks per group (m); must divide trainer.devices * trainer.num_nodes. null: the processes per node."""
    units: Any = "auto"
    """Blocks gathered and freed together: "auto" (the repeated blocks) or a list of dotted module class names."""
    prefetch: int = 1
    """Units gathered ahead of the one computing (0: no prefetch)."""
    chunk_bytes: Optional[int] = None
    """Pipeline chunk of the HO-Ring collectives between groups, in bytes; null: 2 MiB (sharding=auto: sized by the
    cost model to the probed links)."""
    memory_budget: float = 0.7
    """sharding=auto: share of a rank's memory (at most 1) or bytes (above 1) the chosen strategy may use."""
    micro_step_seconds: Optional[float] = None
    """sharding=auto: compute time of one micro-step, if known (lets the plan count overlap); null: none assumed."""
    intra_gbps: Optional[float] = None
    """sharding=auto: intra-group bandwidth per rank in Gbit/s; null: measured at start-up (with inter_gbps)."""
    inter_gbps: Optional[float] = None
    """sharding=auto: inter-group bandwidth per rank in Gbit/s; null: measured at start-up (with intra_gbps)."""
    intra_overlap: float = 1.0
    """sharding=auto with given bandwidths: share of an intra-group transfer that hides behind compute (1: NVLink)."""
    inter_overlap: float = 1.0
    """sharding=auto with given bandwidths: share of an inter-group transfer that hides behind compute (1: a NIC)."""
    log_traffic: bool = True
    """Log paro/intra_bytes and paro/inter_bytes per optimizer step to the Trainer's loggers."""
    state_dict_type: str = "full"
    """Checkpoints as one consolidated file (full) or a directory of per-rank shards (sharded). The command line
    writes full files by default, which torch.load and LightningModule.load_from_checkpoint open in one process;
    PaROStrategy's own default is sharded."""
    gather: str = "auto"
    """Evaluation and the module after fit: full (gather the whole model), sharded (one unit at a time; the module
    stays sharded after fit) or auto (full when the whole model fits half the free memory)."""
    start_method: str = "popen"
    """How the processes start: popen (Lightning's subprocess launcher), spawn, fork or forkserver."""
    process_group_backend: Optional[str] = None
    """gloo or nccl; null: the device's default."""
    timeout_s: float = 1800.0
    """Collective timeout in seconds."""


@dataclass(frozen=True)
class DDPStrategyConfig:
    """Lightning's ``DDPStrategy``: the unsharded baseline (PaRO's NNN with Lightning's own engine)."""

    name: str = "ddp"
    """Which strategy schema this node uses (set by the config file; selects the strategy class)."""
    start_method: str = "popen"
    """How the processes start: popen (Lightning's subprocess launcher), spawn, fork or forkserver."""
    find_unused_parameters: bool = False
    """Let DDP tolerate parameters that get no gradient (costs a graph traversal per step)."""
    process_group_backend: Optional[str] = None
    """gloo or nccl; null: the device's default."""
    timeout_s: float = 1800.0
    """Collective timeout in seconds."""


@dataclass(frozen=True)
class FSDP2StrategyConfig:
    """FSDP2 (``torch.distributed.fsdp.fully_shard``) through Lightning's ``ModelParallelStrategy``.

    ``fsdp2`` shards every block and the root over all ranks (like PaRO's GGG); ``hsdp`` shards inside groups of
    ``group_size`` ranks and replicates across groups (like PaRO's III).
    """

    name: str = "fsdp2"
    """fsdp2 (full shard over all ranks) or hsdp (shard in groups, replicate across them); set by the config file."""
    group_size: Optional[int] = None
    """hsdp only: ranks per shard group; must divide the world size. null: the processes per node."""
    reshard_after_forward: bool = True
    """Free gathered parameters after each block's forward (gather again in backward)."""
    process_group_backend: Optional[str] = None
    """gloo or nccl; null: the device's default."""
    timeout_s: float = 1800.0
    """Collective timeout in seconds."""


STRATEGY_SCHEMAS: dict[str, type] = {
    "paro": ParoStrategyConfig,
    "ddp": DDPStrategyConfig,
    "fsdp2": FSDP2StrategyConfig,
    "hsdp": FSDP2StrategyConfig,
}
"""``strategy.name`` -> the dataclass that checks that node."""

START_METHODS = ("popen", "spawn", "fork", "forkserver")
BACKENDS = (None, "gloo", "nccl")


# ---------------------------------------------------------------------------------------------------- the rest
@dataclass(frozen=True)
class PredictConfig:
    """The predict command: ``lightning_paro.predict.ElasticPredict`` over the data's predict dataloader, with the
    weights of a checkpoint. Every key but checkpoint and output_dir is an option of ElasticPredict
    (``ElasticPredictConfig``, docs/predict.md)."""

    checkpoint: Optional[str] = None
    """Checkpoint whose weights (its state_dict) are loaded into the model; null: weights.ckpt in run.dir, what fit
    writes. A file or a sharded checkpoint directory."""
    output_dir: Optional[str] = None
    """Where the predictions go; null: predictions/ in run.dir."""
    format: str = "parquet"
    """Output format: parquet or jsonl."""
    shard_size: Optional[int] = None
    """Rows per shard (the unit of leasing, retry and commit); null: 16 batches."""
    index_column: str = "row_id"
    """Column holding each row's dataset index (always written)."""
    id_column: Optional[str] = None
    """Key of a per-sample id in dict samples to copy into the output; null: none."""
    ledger: Optional[str] = None
    """Shard ledger: SQLite path or postgresql:// URL; null: _ledger.sqlite in output_dir."""
    job_name: Optional[str] = None
    """Name of the job in the ledger; null: the output directory's absolute path."""
    lease_ttl_s: float = 60.0
    """Seconds a worker's lease lives without a heartbeat."""
    heartbeat_interval_s: Optional[float] = None
    """Seconds between lease renewals; null: a quarter of lease_ttl_s."""
    stall_timeout_s: float = 600.0
    """Stop renewing leases when no batch finished for this long, so a hung worker loses its shards."""
    max_attempts: int = 3
    """Leases of one shard that may end without a commit before it is split."""
    speculate_after_s: Optional[float] = 60.0
    """An idle worker duplicates a shard leased longer ago than this (tail stragglers); null: never."""
    poll_interval_s: float = 0.5
    """Seconds an idle worker waits between asking the ledger for work."""
    fetch_threads: int = 1
    """Rows of a batch read concurrently per DataLoader worker (raise for latency-bound storage)."""
    row_retries: int = 1
    """Retries of a failing row or batch before it is bisected and reported."""
    max_failed_rows: int = 0
    """Rows that may fail (isolated as poison) before the job fails."""
    writer_queue_size: int = 8
    """Batches that may wait for the background writer before predict_step blocks."""
    progress_interval_s: float = 10.0
    """Seconds between reads of the job's global progress (shown on the progress bar)."""
    worker_name: Optional[str] = None
    """This worker's name in the ledger; null: host, process id and a random suffix."""

    def elastic_options(self) -> dict[str, Any]:
        """The keyword arguments of ElasticPredict besides the output directory."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("checkpoint", "output_dir")}


@dataclass(frozen=True)
class BenchConfig:
    """The bench command: throughput of a few training steps with the configured strategy."""

    warmup_steps: int = 2
    """Optimizer steps run before timing starts."""
    steps: int = 5
    """Optimizer steps timed."""
    memory: bool = False
    """Measure peak memory faithfully on the CPU: fix glibc's mmap threshold, so freed tensors leave the resident
    set (every large allocation is then mapped afresh, which costs time: leave it off to compare throughput)."""
    eval_batches: int = 0
    """After training, validate on this many batches and report that stage's peak memory (0: no evaluation)."""


@dataclass(frozen=True)
class RunConfig:
    """Where a run writes and how it is seeded."""

    name: str = "default"
    """Name of the run; the default output directory is runs/<name>."""
    dir: str = "runs/${run.name}"
    """Output directory (made absolute against the working directory, so every rank agrees on it)."""
    seed: int = 0
    """Seed of model initialisation and data order."""


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


TARGET_GROUPS = ("model", "data", "callbacks", "logger")
"""The top-level nodes built with ``hydra.utils.instantiate``."""
