"""From command-line overrides to a checked :class:`Config`: Hydra composes ``conf/``, the schema checks the result.

Hydra's compose API is used rather than ``@hydra.main``: the working directory stays where the user started (so the
processes Lightning re-launches with the same arguments see the same relative paths), nothing is written before a
command runs, and every composition error can be reported as one line naming the key.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Sequence

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_paro.cli.schema import (
    BACKENDS,
    START_METHODS,
    STRATEGY_SCHEMAS,
    BenchConfig,
    Config,
    ConfigError,
    GPTModelConfig,
    PredictConfig,
    RunConfig,
    StdlibDataConfig,
    TrainerConfig,
)
from lightning_paro.strategy.levels import VALID_STRATEGIES

CONFIG_DIR_ENV = "LIGHTNING_PARO_CONFIG_DIR"
"""Environment variable naming the config tree to use instead of the project's ``conf/``."""
CONFIG_NAME = "config"
LAUNCH_TIME_ENV = "LIGHTNING_PARO_LAUNCH_TIME"
"""Environment variable with the run's start time, shared by all processes Lightning starts for it."""

GROUP_SCHEMAS: dict[str, type] = {
    "model": GPTModelConfig,
    "data": StdlibDataConfig,
    "trainer": TrainerConfig,
    "predict": PredictConfig,
    "bench": BenchConfig,
    "run": RunConfig,
}
"""Top-level key -> its dataclass (``strategy`` is chosen by ``strategy.name``, see ``STRATEGY_SCHEMAS``)."""

PRECISIONS = ("32-true", "32", "bf16-mixed", "bf16-true", "16-mixed", "16-true", "64-true")


def default_config_dir() -> Path:
    """The config tree: ``$LIGHTNING_PARO_CONFIG_DIR`` if set, else ``conf/`` next to the package."""
    if os.environ.get(CONFIG_DIR_ENV):
        return Path(os.environ[CONFIG_DIR_ENV]).expanduser().resolve()
    return Path(__file__).resolve().parents[2] / "conf"


def compose_raw(overrides: Sequence[str], config_dir: Optional[Path] = None) -> DictConfig:
    """Hydra's composition of the config tree with ``overrides`` (unchecked); Hydra errors become ConfigError."""
    directory = Path(config_dir) if config_dir is not None else default_config_dir()
    if not (directory / f"{CONFIG_NAME}.yaml").is_file():
        raise ConfigError(
            "--config-dir",
            f"no {CONFIG_NAME}.yaml in {directory}; pass --config-dir DIR or set {CONFIG_DIR_ENV} to the conf/ tree",
        )
    try:
        raw = _compose(directory, overrides)
    except MissingConfigException as exc:
        raise _missing_config_error(exc) from None
    except OverrideParseException as exc:
        raise ConfigError("", f"cannot parse the override: {_first_line(str(exc))}") from None
    except ConfigCompositionException as exc:
        raise _composition_error(exc, directory, overrides) from None
    try:
        OmegaConf.resolve(raw)
    except OmegaConfBaseException as exc:
        key = str(getattr(exc, "full_key", "") or "")
        raise ConfigError(key, f"cannot resolve the interpolation: {_first_line(str(exc.msg or exc))}") from None
    return raw


def launch_time() -> datetime:
    """When this run was started: ``$LIGHTNING_PARO_LAUNCH_TIME`` (seconds since the epoch), set by the first process
    and inherited by the processes Lightning starts, so ``${now:...}`` in run.dir means the same time on every rank."""
    return datetime.fromtimestamp(float(os.environ.get(LAUNCH_TIME_ENV) or time.time()))


def _compose(directory: Path, overrides: Sequence[str]) -> DictConfig:
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(directory.resolve()), version_base="1.3"):
            # replaces Hydra's ${now:...}, which reads the clock in each process: re-launched ranks would disagree
            OmegaConf.register_new_resolver("now", lambda pattern: launch_time().strftime(pattern), replace=True)
            return compose(CONFIG_NAME, overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()


def load_config(overrides: Sequence[str], config_dir: Optional[Path] = None, cwd: Optional[Path] = None) -> Config:
    """The checked configuration for ``overrides``, with ``run.dir`` made absolute against ``cwd``."""
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0].strip()
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            # the compose API has no run directories, logging set-up or launcher plugins: such an override would be
            # accepted and then silently ignored
            raise ConfigError(key, "Hydra's own settings do not apply to this command line; outputs go to run.dir"
                                   " (e.g. run.dir=outputs/exp1) and sweeps use -m")
    raw = compose_raw(overrides, config_dir)
    cfg = to_config(raw)
    check_config(cfg)
    run_dir = Path(cfg.run.dir).expanduser()
    if not run_dir.is_absolute():
        run_dir = Path(cwd or os.getcwd()) / run_dir
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(run_dir.resolve())))


def to_config(raw: DictConfig) -> Config:
    """Merge each top-level node into its dataclass: unknown keys and wrong types become ConfigError."""
    known = {"strategy", *GROUP_SCHEMAS}
    for key in raw.keys():
        if key not in known:
            raise ConfigError(str(key), f"unknown top-level key; the keys are {', '.join(sorted(known))}")
    parts: dict[str, Any] = {}
    strategy_node = raw.get("strategy")
    name = strategy_node.get("name") if isinstance(strategy_node, DictConfig) else None
    if name not in STRATEGY_SCHEMAS:
        raise ConfigError(
            "strategy.name",
            f"{name!r} is not a strategy schema; use one of {', '.join(STRATEGY_SCHEMAS)} (normally set by"
            " choosing strategy=paro, strategy=ddp, strategy=fsdp2 or strategy=hsdp)",
        )
    parts["strategy"] = _typed("strategy", STRATEGY_SCHEMAS[name], strategy_node)
    for key, schema in GROUP_SCHEMAS.items():
        parts[key] = _typed(key, schema, raw.get(key))
    return Config(**parts)


def _typed(prefix: str, schema: type, node: Any) -> Any:
    if node is None:
        return schema()
    if not isinstance(node, DictConfig):
        raise ConfigError(prefix, f"must be a mapping of {schema.__name__} keys, got {node!r}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), node)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise _omegaconf_error(prefix, schema, exc) from None


# ---------------------------------------------------------------------------------------------------- checks
def world_size(trainer: TrainerConfig) -> Optional[int]:
    """devices * num_nodes when devices is a number (None for "auto": known only once Lightning looks)."""
    return trainer.devices * trainer.num_nodes if isinstance(trainer.devices, int) else None


def check_config(cfg: Config) -> None:
    """Values no type can express; raises ConfigError naming the first bad key."""
    t = cfg.trainer
    if isinstance(t.devices, bool) or not (
        (isinstance(t.devices, int) and t.devices >= 1) or t.devices == "auto"
    ):
        raise ConfigError("trainer.devices", f"{t.devices!r} is not a positive number of processes per node or auto")
    _positive("trainer.num_nodes", t.num_nodes)
    _positive("trainer.max_steps", t.max_steps)
    _positive("trainer.accumulate_grad_batches", t.accumulate_grad_batches)
    _positive("trainer.log_every_n_steps", t.log_every_n_steps)
    if t.precision not in PRECISIONS:
        raise ConfigError("trainer.precision", f"{t.precision!r} is not one of {', '.join(PRECISIONS)}")
    if t.gradient_clip_val is not None and t.gradient_clip_val <= 0:
        raise ConfigError("trainer.gradient_clip_val",
                          f"{t.gradient_clip_val} must be positive, or null for no clipping")
    _check_strategy(cfg)
    m = cfg.model
    for key in ("vocab", "seq_len", "dim", "heads", "layers"):
        _positive(f"model.{key}", getattr(m, key))
    if m.dim % m.heads:
        raise ConfigError("model.dim", f"{m.dim} is not divisible by model.heads={m.heads}")
    if m.vocab < 256:
        raise ConfigError("model.vocab", f"{m.vocab} is too small for byte-level text; use 256")
    if m.lr <= 0:
        raise ConfigError("model.lr", f"{m.lr} must be positive")
    if m.trainable_blocks is not None and not 0 <= m.trainable_blocks <= m.layers:
        raise ConfigError("model.trainable_blocks",
                          f"{m.trainable_blocks} must be between 0 and model.layers={m.layers}, or null to train all")
    d = cfg.data
    for key in ("train_bytes", "held_out_bytes", "batch_size", "val_batch_size"):
        _positive(f"data.{key}", getattr(d, key))
    if d.num_workers < 0:
        raise ConfigError("data.num_workers", f"{d.num_workers} must be 0 or more")
    p = cfg.predict
    _positive("predict.batch_size", p.batch_size)
    if p.max_bytes_per_file < 2:
        raise ConfigError("predict.max_bytes_per_file", f"{p.max_bytes_per_file} must be at least 2 (one prediction)")
    if p.shard_size is not None:
        _positive("predict.shard_size", p.shard_size)
    if p.format not in ("parquet", "jsonl"):
        raise ConfigError("predict.format", f"{p.format!r} is not parquet or jsonl")
    if p.lease_ttl_s <= 0:
        raise ConfigError("predict.lease_ttl_s", f"{p.lease_ttl_s} must be positive")
    if p.max_failed_rows < 0:
        raise ConfigError("predict.max_failed_rows", f"{p.max_failed_rows} must be 0 or more")
    _positive("bench.steps", cfg.bench.steps)
    if cfg.bench.warmup_steps < 0:
        raise ConfigError("bench.warmup_steps", f"{cfg.bench.warmup_steps} must be 0 or more")
    if not cfg.run.dir:
        raise ConfigError("run.dir", "must name an output directory")


def _check_strategy(cfg: Config) -> None:
    s, world = cfg.strategy, world_size(cfg.trainer)
    if getattr(s, "process_group_backend", None) not in BACKENDS:
        raise ConfigError("strategy.process_group_backend", f"{s.process_group_backend!r} is not gloo, nccl or null")
    if s.timeout_s <= 0:
        raise ConfigError("strategy.timeout_s", f"{s.timeout_s} must be positive")
    if hasattr(s, "start_method") and s.start_method not in START_METHODS:
        raise ConfigError("strategy.start_method", f"{s.start_method!r} is not one of {', '.join(START_METHODS)}")
    if s.name == "paro":
        if not isinstance(s.sharding, str) or (s.sharding.upper() not in VALID_STRATEGIES
                                               and not _strategy_accepts_sharding(s.sharding)):
            raise ConfigError(
                "strategy.sharding",
                f"{s.sharding!r} is not a PaRO strategy; use one of {', '.join(VALID_STRATEGIES)}"
                " (letters for parameters, gradients, optimizer states; optimizer states at least as sharded)",
            )
        if s.state_dict_type not in ("full", "sharded"):
            raise ConfigError("strategy.state_dict_type", f"{s.state_dict_type!r} is not full or sharded")
        if s.prefetch < 0:
            raise ConfigError("strategy.prefetch", f"{s.prefetch} must be 0 (no prefetch) or more")
        names = isinstance(s.units, list) and s.units and all(isinstance(u, str) for u in s.units)
        if not (s.units == "auto" or names):
            raise ConfigError("strategy.units", f"{s.units!r} must be auto or a list of dotted module class names")
        if cfg.trainer.precision == "16-mixed":
            raise ConfigError("trainer.precision", "16-mixed is refused by PaRO (per-shard inf checks); use bf16-mixed")
        if not s.memory_budget > 0:
            raise ConfigError("strategy.memory_budget",
                              f"{s.memory_budget} must be a share of memory in (0, 1] or a number of bytes above 1")
        if s.micro_step_seconds is not None and s.micro_step_seconds < 0:
            raise ConfigError("strategy.micro_step_seconds", f"{s.micro_step_seconds} must be 0 or more, or null")
        for key in ("intra_gbps", "inter_gbps"):
            value = getattr(s, key)
            if value is not None and not value > 0:
                raise ConfigError(f"strategy.{key}", f"{value} must be a positive bandwidth in Gbit/s, or null")
        for key in ("intra_overlap", "inter_overlap"):
            value = getattr(s, key)
            if not 0 <= value <= 1:
                raise ConfigError(f"strategy.{key}", f"{value} must be a share in [0, 1] of a transfer hidden behind"
                                  " compute (1 for GPUs with NVLink and NICs, 0 where transfers take the CPU)")
        if (s.intra_gbps is None) != (s.inter_gbps is None):
            raise ConfigError("strategy.inter_gbps" if s.inter_gbps is None else "strategy.intra_gbps",
                              "give both strategy.intra_gbps and strategy.inter_gbps to skip the link probe, or"
                              " neither")
    if getattr(s, "group_size", None) is not None:
        if isinstance(s.group_size, bool) or s.group_size < 1:
            raise ConfigError("strategy.group_size", f"{s.group_size} must be a positive number of ranks, or null")
        if world is not None and world % s.group_size:
            divisors = [str(k) for k in range(1, world + 1) if world % k == 0]
            raise ConfigError(
                "strategy.group_size",
                f"{s.group_size} does not divide the world size trainer.devices * trainer.num_nodes ="
                f" {cfg.trainer.devices} * {cfg.trainer.num_nodes} = {world}; use one of {', '.join(divisors)}",
            )


def _strategy_accepts_sharding(value: str) -> bool:
    """Whether PaROStrategy takes a sharding beyond the 14 letter codes (such as a planner's "auto")."""
    from lightning_paro import PaROStrategy

    try:
        PaROStrategy(sharding=value)  # only stores its arguments; nothing is started
    except (ValueError, TypeError):
        return False
    return True


def check_launch_environment(cfg: Config, environ: Optional[dict] = None) -> None:
    """Under torchrun the process layout is torchrun's: trainer.devices and num_nodes must agree with it."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in env or "LOCAL_WORLD_SIZE" not in env:
        return
    local, total = int(env["LOCAL_WORLD_SIZE"]), int(env.get("WORLD_SIZE", env["LOCAL_WORLD_SIZE"]))
    if cfg.trainer.devices != local:
        raise ConfigError(
            "trainer.devices",
            f"{cfg.trainer.devices!r} but torchrun started {local} processes per node (--nproc_per_node);"
            f" pass trainer.devices={local}",
        )
    if cfg.trainer.num_nodes * local != total:
        raise ConfigError(
            "trainer.num_nodes",
            f"{cfg.trainer.num_nodes} but torchrun's world is {total} processes, {local} per node;"
            f" pass trainer.num_nodes={total // local}",
        )


def _positive(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, f"{value!r} must be a positive integer")


# ---------------------------------------------------------------------------------------------------- error text
def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def _missing_config_error(exc: MissingConfigException) -> ConfigError:
    group, _, option = (exc.missing_cfg_file or "").rpartition("/")
    if group and exc.options:
        return ConfigError(group, f"no config {option!r} in group {group}; choose one of {', '.join(exc.options)}")
    return ConfigError(group, _first_line(str(exc)))


def _composition_error(exc: ConfigCompositionException, directory: Path, overrides: Sequence[str]) -> ConfigError:
    text = str(exc)
    ambiguous = re.match(r"Ambiguous value for argument '([^'=]+)=([^']*)'", text)
    if ambiguous:
        key, value = ambiguous.groups()
        return ConfigError(
            key,
            f"{value!r} has commas: to sweep over the values add -m (--multirun); for a list write {key}=[{value}],"
            f" for a string quote it: {key}='{value}'",
        )
    cannot = re.match(r"Could not override '([^']+)'", text)
    if cannot:
        key = cannot.group(1)
        return ConfigError(key, f"unknown key{_known_keys_hint(key, directory, overrides)}")
    cause = exc.__cause__
    if isinstance(cause, OmegaConfBaseException):
        return ConfigError(str(getattr(cause, "full_key", "") or ""), _first_line(str(cause.msg or cause)))
    return ConfigError("", _first_line(text))


def _known_keys_hint(key: str, directory: Path, overrides: Sequence[str]) -> str:
    """Which keys the node holding ``key`` does have (composed again without the override that failed)."""
    group = key.split(".")[0]
    if "." not in key:
        return f"; the top-level keys are {', '.join(sorted(['strategy', *GROUP_SCHEMAS]))}"
    schema = GROUP_SCHEMAS.get(group)
    if group == "strategy":
        rest = [o for o in overrides if o.lstrip("+~").split("=")[0].strip() != key]
        try:
            name = _compose(directory, rest).strategy.name
        except Exception:  # the hint is a courtesy; the error itself stands without it
            name = None
        schema = STRATEGY_SCHEMAS.get(name)
        group = f"strategy (strategy.name={name})"
    if schema is None:
        return ""
    return f" in {group}; its keys are {', '.join(f.name for f in dataclasses.fields(schema))}"


def _omegaconf_error(prefix: str, schema: type, exc: OmegaConfBaseException) -> ConfigError:
    key = str(getattr(exc, "full_key", "") or getattr(exc, "key", "") or "")
    full = f"{prefix}.{key}" if key else prefix
    message = _first_line(str(exc.msg if getattr(exc, "msg", None) else exc))
    if "not in" in message or isinstance(exc, (KeyError, AttributeError)):
        names = ", ".join(f.name for f in dataclasses.fields(schema))
        return ConfigError(full, f"unknown key in {prefix}; its keys are {names}")
    value = getattr(exc, "value", None)
    if value is not None:
        message = f"{value!r} is not valid here: {message}"
    return ConfigError(full, message)
