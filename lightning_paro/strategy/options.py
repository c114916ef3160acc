"""The options of :class:`~lightning_paro.PaROStrategy`: each one's default and its validation, stated once.

:class:`PaROOptions` holds the library's defaults and refuses a value that cannot work with an :class:`OptionError`
naming the option and what to pass instead, and an option that would change nothing in the configuration given (the
options of ``sharding="auto"`` with a fixed sharding, ``gather`` or ``prefetch`` where the parameters are never
sharded, ...: :meth:`PaROOptions.check_applies`) the same way. ``PaROStrategy`` validates its arguments through it;
the command line's ``strategy`` node (``lightning_paro.cli.schema.ParoStrategyConfig``) takes every default from it
and reports its errors under ``strategy.<key>``. The options of ``sharding="auto"`` are
:class:`~lightning_paro.planner.AutoConfig`, which validates itself the same way; :class:`OptionError` lives in the
leaf module ``lightning_paro.options_base``, which both read.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_paro.comm.quantize import SCHEMES
from lightning_paro.options_base import OptionError, is_count
from lightning_paro.strategy.levels import VALID_STRATEGIES, Level, ShardingSpec
from lightning_paro.strategy.transitions import CommDtypes

if TYPE_CHECKING:
    from lightning_paro.planner.job import AutoConfig
    from lightning_paro.strategy.units import UnitPolicy

GatherMode = Literal["auto", "full", "sharded"]
GATHER_MODES: tuple[str, ...] = ("auto", "full", "sharded")
STATE_DICT_TYPES: tuple[str, ...] = ("sharded", "full")
START_METHODS: tuple[str, ...] = ("popen", "spawn", "fork", "forkserver")
"""How the processes start: Lightning's subprocess launcher (``popen``, as ``"ddp"``) or torch.multiprocessing."""
COMM_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
                                       "float32": torch.float32}
"""The dtypes parameters and gradients may travel in, by the names the options accept (or the torch dtypes)."""


def comm_dtype(option: str, value: Union[str, torch.dtype, None]) -> Optional[torch.dtype]:
    """``param_dtype`` or ``reduce_dtype`` as a torch dtype (None: the buffer's own)."""
    if value is None:
        return None
    if isinstance(value, torch.dtype) and value in COMM_DTYPES.values():
        return value
    if isinstance(value, str) and value.lower() in COMM_DTYPES:
        return COMM_DTYPES[value.lower()]
    raise OptionError(option, f"{option} must be 'bf16', 'fp32' (torch.bfloat16, torch.float32) or None (the"
                              f" parameters' own dtype), got {value!r}.")


@dataclass(frozen=True)
class GatherConfig:
    """When the strategy holds the whole model gathered on every rank (P = I or G; with P = N it always does)."""

    evaluation: GatherMode = "auto"
    """validate, test, predict: "full" gathers every unit once per stage, "sharded" one unit at a time as in training,
    "auto" in full when the full parameters fit ``memory_fraction`` of the free memory."""
    after_fit: GatherMode = "auto"
    """The module after fit: "full" hands it back with full parameters, "sharded" leaves them sharded (read the
    weights through a checkpoint or ``export_full_state_dict``), "auto" full when they fit."""
    memory_fraction: float = 0.5
    """"auto": the share of free device memory (CPU: the rank's share of available host memory) the full parameters
    may take."""

    def __post_init__(self) -> None:
        for name in ("evaluation", "after_fit"):
            if getattr(self, name) not in GATHER_MODES:
                raise OptionError("gather", f"GatherConfig.{name} must be 'auto', 'full' or 'sharded', got"
                                            f" {getattr(self, name)!r}.")
        if not 0 < self.memory_fraction <= 1:
            raise OptionError("gather", f"GatherConfig.memory_fraction must be in (0, 1], got"
                                        f" {self.memory_fraction!r}.")


@dataclass(frozen=True)
class PaROOptions:
    """The options of the PaRO strategy with the library's defaults, validated when created."""

    sharding: Union[str, ShardingSpec] = "auto"
    """Three letters (N, I or G) for parameters, gradients and optimizer states, one of the 14 valid strategies, or
    "auto": at set-up, measure the links and memory and take the fastest strategy that fits (the cost model's)."""
    group_size: Optional[int] = None
    """Ranks per group (m); must divide the world size. None: the processes per node."""
    units: UnitPolicy = "auto"
    """Submodules gathered and freed together: "auto" (the repeated blocks), module classes, or a predicate
    ``(name, module) -> bool``."""
    prefetch: int = 1
    """Units gathered ahead of the one computing (0: no prefetch)."""
    chunk_bytes: Optional[int] = None
    """Pipeline chunk of the HO-Ring collectives between groups, in bytes of the full buffer. None: 2 MiB; with
    sharding="auto", the chunk the cost model predicts fastest for the probed links."""
    log_traffic: bool = True
    """Log ``paro/intra_bytes`` and ``paro/inter_bytes`` per optimizer step to the Trainer's loggers."""
    auto: Optional[AutoConfig] = None
    """Options of sharding="auto" (memory budget, given links, compute time per micro-step); None: the defaults of
    :class:`~lightning_paro.planner.AutoConfig`."""
    state_dict_type: str = "sharded"
    """Checkpoints as directories of per-rank shards ("sharded": readable at another world size, group size or
    strategy) or one consolidated file ("full": ``torch.load``, ``LightningModule.load_from_checkpoint``, "ddp")."""
    gather: Union[GatherMode, GatherConfig] = "auto"
    """Whether evaluation and the module after fit hold the whole model gathered: a :class:`GatherConfig`, or
    "auto" (full when it fits the memory), "full" or "sharded" for both."""
    start_method: str = "popen"
    """How the processes start: "popen" (Lightning's subprocess launcher), "spawn", "fork" or "forkserver"."""
    process_group_backend: Optional[str] = None
    """Kept as given; None: the device's backend, with gloo beside it on an accelerator ("cuda:nccl,cpu:gloo")."""
    timeout: Optional[timedelta] = default_pg_timeout
    """How long a collective waits for its peers, in every group the strategy creates; None: torch's default."""
    param_dtype: Union[str, torch.dtype, None] = None
    """The dtype parameters are gathered in during training ("bf16" or "fp32"; FSDP2's ``param_dtype``): each
    all-gather, and the sync after the optimizer step, sends them in it and every rank computes with the same rounded
    copy; the optimizer shard stays the full-precision master. None: the parameters' own dtype (exact)."""
    reduce_dtype: Union[str, torch.dtype, None] = None
    """The dtype gradients are reduced in ("bf16" or "fp32"; FSDP2's ``reduce_dtype``): each reduce-scatter and
    all-reduce sends and sums them in it; the accumulators keep the gradients' dtype. None: the gradients' own."""
    inter_quant: Optional[str] = None
    """"int8": every hop between groups goes block-quantized (one fp32 scale per 256 int8 values, each contribution
    quantized once); what moves inside groups keeps full precision (or ``param_dtype``/``reduce_dtype``). A global
    collective then runs its two phases one after the other instead of as an HO-Ring pipeline. None: none."""
    error_feedback: bool = False
    """With inter_quant: each rank carries what quantizing its gradients for the hop between groups left out into its
    next reduction, so rounding errors cancel over steps instead of adding up (an fp32 buffer of 1/m of each flat
    gradient per rank, not checkpointed)."""

    def __post_init__(self) -> None:
        if not self.is_auto:
            try:
                ShardingSpec.parse(self.sharding)
            except ValueError:
                raise OptionError("sharding", f"{self.sharding!r} is not a PaRO strategy: three letters from N, I, G"
                                              " for parameters, gradients and optimizer states, the optimizer states"
                                              " at least as sharded as the other two. Valid strategies:"
                                              f" {', '.join(VALID_STRATEGIES)}; or 'auto' to let the strategy"
                                              " choose.") from None
        if self.group_size is not None and not is_count(self.group_size, 1):
            raise OptionError("group_size",
                              f"group_size must be a positive integer (ranks per group), got {self.group_size!r}.")
        if not is_count(self.prefetch, 0):
            raise OptionError("prefetch", f"prefetch must be 0 (no prefetch) or a positive number of units, got"
                                          f" {self.prefetch!r}.")
        if self.chunk_bytes is not None and not is_count(self.chunk_bytes, 1):
            raise OptionError("chunk_bytes", f"chunk_bytes must be a positive number of bytes, got {self.chunk_bytes!r}.")
        if self.state_dict_type not in STATE_DICT_TYPES:
            raise OptionError("state_dict_type",
                              f"state_dict_type must be 'sharded' or 'full', got {self.state_dict_type!r}.")
        if isinstance(self.gather, str) and self.gather not in GATHER_MODES:
            raise OptionError("gather", f"{self.gather!r} is not auto, full or sharded: gather must be 'auto', 'full',"
                                        " 'sharded' or a GatherConfig.")
        if not isinstance(self.gather, (str, GatherConfig)):
            raise TypeError(f"gather must be 'auto', 'full', 'sharded' or a GatherConfig, got {self.gather!r}.")
        if self.start_method not in START_METHODS:
            raise OptionError("start_method", f"Unknown start_method {self.start_method!r}: use 'popen', 'spawn',"
                                              " 'fork' or 'forkserver'.")
        if self.timeout is not None and not (isinstance(self.timeout, timedelta) and self.timeout > timedelta(0)):
            shown = f"{self.timeout.total_seconds():g} s" if isinstance(self.timeout, timedelta) else repr(self.timeout)
            raise OptionError("timeout", f"timeout must be positive (how long a collective waits for its peers: a"
                                         f" timedelta, or None for torch's default), got {shown}.")
        comm_dtype("param_dtype", self.param_dtype)
        comm_dtype("reduce_dtype", self.reduce_dtype)
        if self.inter_quant is not None and self.inter_quant not in SCHEMES:
            raise OptionError("inter_quant", f"inter_quant must be 'int8' (block-quantized traffic between groups) or"
                                             f" None, got {self.inter_quant!r}.")
        if not isinstance(self.error_feedback, bool):
            raise OptionError("error_feedback", f"error_feedback must be True or False, got {self.error_feedback!r}.")
        if self.error_feedback and self.inter_quant is None:
            raise OptionError("error_feedback", "error_feedback carries quantization errors over: it needs"
                                                " inter_quant='int8'.")
        self.check_applies()

    def check_applies(self) -> None:
        """Refuses an option given a value other than its default where the configuration never reads it, naming the
        option and the fix: nothing is ignored without a word. Under ``sharding="auto"`` every option may apply
        (the plan may pick any strategy)."""
        spec = self.spec
        if spec is None:
            return
        if self.auto is not None:
            raise OptionError("auto", f"auto (AutoConfig) configures sharding='auto' only; with sharding"
                                      f" {spec.name!r} it would be ignored: drop auto=, or pass sharding='auto' to"
                                      " let the strategy choose.")
        if spec.params == Level.N:
            if self.gather != PaROOptions.gather:
                raise OptionError("gather", f"gather applies where parameters are sharded (P = I or G); under"
                                            f" {spec.name} every rank holds the whole model already: drop gather=.")
            if self.prefetch != PaROOptions.prefetch:
                raise OptionError("prefetch", f"prefetch gathers sharded parameters ahead of use (P = I or G);"
                                              f" under {spec.name} nothing is gathered: drop prefetch=.")
        if spec.name == "NNN" and self.param_dtype is not None:
            raise OptionError("param_dtype", "param_dtype sets the dtype parameters travel in; under NNN no"
                                             " parameter is sent (nothing is sharded): drop param_dtype=.")

    @property
    def is_auto(self) -> bool:
        """Whether the strategy is chosen at set-up (``sharding="auto"``)."""
        return isinstance(self.sharding, str) and self.sharding.lower() == "auto"

    @property
    def spec(self) -> Optional[ShardingSpec]:
        """The strategy given; None for "auto"."""
        return None if self.is_auto else ShardingSpec.parse(self.sharding)

    @property
    def comm_dtypes(self) -> CommDtypes:
        """``param_dtype`` and ``reduce_dtype`` as the engine's
        :class:`~lightning_paro.strategy.transitions.CommDtypes`."""
        return CommDtypes(comm_dtype("param_dtype", self.param_dtype), comm_dtype("reduce_dtype", self.reduce_dtype),
                          self.inter_quant, self.error_feedback)

    @property
    def gather_config(self) -> GatherConfig:
        """``gather`` as a :class:`GatherConfig` (a mode names both stages)."""
        return self.gather if isinstance(self.gather, GatherConfig) else GatherConfig(self.gather, self.gather)

    @property
    def auto_config(self) -> AutoConfig:
        """``auto``, or the default :class:`~lightning_paro.planner.AutoConfig`."""
        from lightning_paro.planner.job import AutoConfig

        return self.auto if self.auto is not None else AutoConfig()

    def as_kwargs(self) -> dict[str, Any]:
        """The options as keyword arguments of ``PaROStrategy``."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
