"""The configuration schema: one frozen dataclass per config group, checked after Hydra composes the YAML tree.

Hydra composes ``conf/`` with the command-line overrides; the result is merged into these dataclasses (unknown keys
and wrong types are refused by OmegaConf) and then checked for values no type can express (a sharding that does not
exist, a group size that does not divide the world). Every refusal is a :class:`ConfigError` naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_paro.demo.model import GPTConfig


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
    """Three letters (N, I or G) for parameters, gradients and optimizer states; one of the 14 valid strategies."""
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
    """Checkpoints as one consolidated file (full) or a directory of per-rank shards (sharded, where supported)."""
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
class TrainerConfig:
    """Arguments of ``lightning.Trainer`` the commands pass through."""

    accelerator: str = "auto"
    """cpu, gpu, cuda or auto."""
    devices: Any = 1
    """Processes (devices) per node: an integer, or "auto"."""
    num_nodes: int = 1
    """Nodes; the world size is devices * num_nodes."""
    precision: str = "32-true"
    """32-true, bf16-mixed or bf16-true (PaRO refuses 16-mixed)."""
    max_steps: int = 60
    """Optimizer steps to train."""
    accumulate_grad_batches: int = 2
    """Micro-batches per optimizer step."""
    gradient_clip_val: Optional[float] = 1.0
    """Clip the gradient norm to this value; null: no clipping."""
    log_every_n_steps: int = 5
    """How often metrics go to the CSV logger."""
    limit_val_batches: Any = 20
    """Validation batches per rank at the end of training (0 skips validation)."""
    enable_progress_bar: bool = True
    """Show Lightning's progress bar."""
    deterministic: bool = False
    """Ask torch for deterministic kernels."""


@dataclass(frozen=True)
class GPTModelConfig(GPTConfig):
    """The demo's byte-level GPT (``lightning_paro.demo.GPT``): its ``GPTConfig`` fields, plus the family name."""

    name: str = "gpt"
    """The model family (only gpt in this version)."""
    trainable_blocks: Optional[int] = None
    """Train only the last this-many blocks and the final norm, the rest frozen (a PEFT-like run); null: all."""


@dataclass(frozen=True)
class StdlibDataConfig:
    """Python's standard-library source files as byte-level text: training files, then held-out files."""

    name: str = "stdlib"
    """The data set (only stdlib in this version)."""
    train_bytes: int = 600_000
    """About this many bytes of source files (in sorted order) to train on."""
    held_out_bytes: int = 100_000
    """About this many bytes of the following files for validation and for predict."""
    batch_size: int = 8
    """Training sequences per micro-batch per rank."""
    val_batch_size: int = 16
    """Validation sequences per batch per rank."""
    num_workers: int = 0
    """DataLoader worker processes."""


@dataclass(frozen=True)
class PredictConfig:
    """The predict command: score held-out files with a checkpoint; elastic batch prediction to Parquet."""

    checkpoint: Optional[str] = None
    """Weights checkpoint to load; null: weights.ckpt in run.dir (what fit writes)."""
    output_dir: Optional[str] = None
    """Where the per-file scores go; null: predictions/ in run.dir."""
    batch_size: int = 4
    """Files per batch."""
    max_bytes_per_file: int = 4096
    """Score at most this many leading bytes of each file (keeps batches a fixed shape)."""
    shard_size: Optional[int] = None
    """Files per shard of the elastic job (unit of leasing and commit); null: 16 batches."""
    format: str = "parquet"
    """Output format: parquet or jsonl."""
    ledger: Optional[str] = None
    """Shard ledger: SQLite path or postgresql:// URL; null: a SQLite file in output_dir."""
    lease_ttl_s: float = 60.0
    """Seconds a worker's lease lives without a heartbeat."""
    max_failed_rows: int = 0
    """Files that may fail (isolated as poison) before the job fails."""


@dataclass(frozen=True)
class BenchConfig:
    """The bench command: throughput of a few training steps with the configured strategy."""

    warmup_steps: int = 2
    """Optimizer steps run before timing starts."""
    steps: int = 5
    """Optimizer steps timed."""


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
    """Everything one command needs."""

    strategy: Any = field(default_factory=ParoStrategyConfig)
    """The distributed strategy (group strategy)."""
    model: GPTModelConfig = field(default_factory=GPTModelConfig)
    """The model (group model)."""
    data: StdlibDataConfig = field(default_factory=StdlibDataConfig)
    """The data (group data)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Trainer arguments (group trainer)."""
    predict: PredictConfig = field(default_factory=PredictConfig)
    """The predict command's settings (group predict)."""
    bench: BenchConfig = field(default_factory=BenchConfig)
    """The bench command's settings."""
    run: RunConfig = field(default_factory=RunConfig)
    """Output directory and seed."""
