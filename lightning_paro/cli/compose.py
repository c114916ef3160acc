"""From command-line overrides to a checked :class:`Config`: Hydra composes the config tree, the schema checks it.

The package's own tree (``conf/`` in the repository, installed as the package ``lightning_paro.conf``) is Hydra's
primary config, found as ``pkg://lightning_paro.conf``; the user's directories (``--config-dir DIR``,
``$LIGHTNING_PARO_CONFIG_DIR``, ``hydra.searchpath=[...]``) are added to the search path after it, as Hydra's own
``--config-dir`` does, so they add options to the groups (``model=mine``, ``experiment=exp1``).

Hydra's compose API is used rather than ``@hydra.main``: the working directory stays where the user started (so the
processes Lightning re-launches with the same arguments see the same relative paths), nothing is written before a
command runs, and every composition error can be reported as one line naming the key.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
import re
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from hydra import compose, initialize_config_dir, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from lightning_paro.cli import targets
from lightning_paro.cli.schema import (
    BACKENDS,
    STRATEGY_SCHEMAS,
    TARGET_GROUPS,
    BenchConfig,
    Config,
    ConfigError,
    ParoStrategyConfig,
    PredictConfig,
    RunConfig,
    strategy_errors,
)
from lightning_paro.strategy.options import PaROOptions

PACKAGE_CONFIG_MODULE = "lightning_paro.conf"
"""The package holding the config tree (``conf/`` in the repository, mapped into the wheel)."""
CONFIG_DIR_ENV = "LIGHTNING_PARO_CONFIG_DIR"
"""Environment variable naming config directories to add to the search path (separated by the path separator)."""
CONFIG_NAME = "config"
LAUNCH_TIME_ENV = "LIGHTNING_PARO_LAUNCH_TIME"
"""Environment variable with the run's start time, shared by all processes Lightning starts for it."""

SETTINGS_SCHEMAS: dict[str, type] = {"predict": PredictConfig, "bench": BenchConfig, "run": RunConfig}
"""Top-level key -> its dataclass (``strategy`` is chosen by ``strategy.name``, see ``STRATEGY_SCHEMAS``)."""
TOP_LEVEL_KEYS = ("strategy", *TARGET_GROUPS, "trainer", *SETTINGS_SCHEMAS)

TRAINER_MANAGED = {
    "strategy": "choose it with the strategy group (strategy=paro_nig, strategy=ddp, ...)",
    "callbacks": "add callbacks with the callbacks group (callbacks=checkpoint, +callbacks.NAME._target_=...)",
    "logger": "choose loggers with the logger group (logger=csv, logger=[csv,tensorboard], logger=none)",
    "default_root_dir": "set run.dir",
}
"""Trainer arguments the command line fills from other groups, and where to set them instead."""
DATA_LOADER_KEYS = ("train", "val", "test", "predict")


# ---------------------------------------------------------------------------------------------------- search path
def package_config_dir() -> Path:
    """The package's config tree: the installed ``lightning_paro.conf``, or ``conf/`` beside the package in a source
    checkout that is not installed."""
    spec = importlib.util.find_spec(PACKAGE_CONFIG_MODULE)
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))).resolve()
    return Path(__file__).resolve().parents[2] / "conf"


def default_config_dir() -> Path:
    """The package's config tree (an alias kept for callers of earlier versions)."""
    return package_config_dir()


def user_config_dirs(config_dirs: Iterable[Path] = ()) -> list[Path]:
    """``--config-dir`` directories, then those of ``$LIGHTNING_PARO_CONFIG_DIR``, absolute; each must exist."""
    listed = [Path(d) for d in config_dirs]
    listed += [Path(d) for d in os.environ.get(CONFIG_DIR_ENV, "").split(os.pathsep) if d]
    out = []
    for directory in listed:
        directory = directory.expanduser().resolve()
        if not directory.is_dir():
            raise ConfigError("--config-dir", f"{directory} is not a directory")
        if directory not in out and directory != package_config_dir():
            out.append(directory)
    return out


def _search_path(config_dirs: Sequence[Path], overrides: Sequence[str],
                 cwd: Optional[Path] = None) -> tuple[list[str], list[str]]:
    """(the search path entries to add, the overrides without ``hydra.searchpath``); relative ``file://`` entries
    are relative to ``cwd`` (default: the working directory)."""
    entries = [f"file://{d}" for d in user_config_dirs(config_dirs)]
    rest = []
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0].strip()
        if key != "hydra.searchpath":
            rest.append(override)
            continue
        try:
            value = OverridesParser.create().parse_override(override).value()
        except OverrideParseException as exc:
            raise ConfigError("hydra.searchpath", f"cannot parse it: {_first_line(str(exc))}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError("hydra.searchpath", "must be a list, e.g. hydra.searchpath=[file://./configs]")
        for entry in value:
            if entry.startswith("file://"):
                path = Path(entry[len("file://"):]).expanduser()
                if not path.is_absolute():
                    path = Path(cwd or os.getcwd()) / path  # relative to where the command started, as run.dir
                if not path.is_dir():
                    raise ConfigError("hydra.searchpath", f"{path} is not a directory")
                entry = f"file://{path.resolve()}"
            elif not entry.startswith("pkg://"):
                raise ConfigError("hydra.searchpath", f"{entry!r} must start with file:// or pkg://")
            if entry not in entries:
                entries.append(entry)
    return entries, rest


def _check_shadowing(entries: Sequence[str]) -> None:
    """A user's file named like one of the package's is never read (the package's tree comes first): refuse it."""
    package = package_config_dir()
    for entry in entries:
        if not entry.startswith("file://"):
            continue
        directory = Path(entry[len("file://"):])
        if (directory / f"{CONFIG_NAME}.yaml").is_file():
            raise ConfigError(
                "--config-dir",
                f"{directory / CONFIG_NAME}.yaml would be ignored: the package's root config comes first. Put a run's"
                " settings in an experiment (experiment/NAME.yaml starting with `# @package _global_`) and pick it"
                " with experiment=NAME",
            )
        for path in sorted(directory.glob("*/*.yaml")):
            twin = package / path.parent.name / path.name
            if twin.is_file():
                raise ConfigError(
                    "--config-dir",
                    f"{path} has the name of the package's {path.parent.name}={path.stem}, which takes precedence;"
                    " give yours another name",
                )


# ---------------------------------------------------------------------------------------------------- composition
def compose_raw(overrides: Sequence[str], config_dirs: Sequence[Path] = (), cwd: Optional[Path] = None) -> DictConfig:
    """Hydra's composition of the config tree with ``overrides``, interpolations resolved and ``run.dir`` absolute
    against ``cwd`` (unchecked); Hydra errors become ConfigError."""
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0].strip()
        if (key == "hydra" or key.startswith(("hydra.", "hydra/"))) and key != "hydra.searchpath":
            # the compose API has no run directories, logging set-up or launcher plugins: such an override would be
            # accepted and then silently ignored
            raise ConfigError(key, "Hydra's own settings do not apply to this command line; outputs go to run.dir"
                                   " (e.g. run.dir=outputs/exp1), sweeps use -m, config directories --config-dir or"
                                   " hydra.searchpath")
    entries, rest = _search_path(config_dirs, overrides, cwd)
    _check_shadowing(entries)
    if entries:
        rest.append("hydra.searchpath=[" + ",".join(_quote(e) for e in entries) + "]")
    try:
        raw = _compose(rest)
    except MissingConfigException as exc:
        raise _missing_config_error(exc) from None
    except OverrideParseException as exc:
        raise ConfigError("", f"cannot parse the override: {_first_line(str(exc))}") from None
    except ConfigCompositionException as exc:
        raise _composition_error(exc, rest) from None
    try:
        run_dir = raw.run.dir if isinstance(raw.get("run"), DictConfig) else None
        if isinstance(run_dir, str) and run_dir:
            path = Path(run_dir).expanduser()
            if not path.is_absolute():
                path = Path(cwd or os.getcwd()) / path
            # before the rest resolves: ${run.dir} in a callback or logger node gets the absolute path too
            raw.run.dir = str(path.resolve())
        OmegaConf.resolve(raw)
    except OmegaConfBaseException as exc:
        key = str(getattr(exc, "full_key", "") or "") or _unresolvable_key(raw, "")
        hint = ""
        if key.split(".")[0] in ("data", "callbacks", "logger") and "model." in str(exc):
            hint = (f"; {key.split('.')[0]} refers to a key of the model that this model has not: choose a"
                    f" {key.split('.')[0]} config that fits it, or remove the group with ~{key.split('.')[0]}")
        raise ConfigError(key, f"cannot resolve the interpolation: {_first_line(str(exc.msg or exc))}{hint}") from None
    return raw


def _unresolvable_key(node: Any, prefix: str) -> str:
    """The dotted key of the first value of ``node`` whose interpolation fails (OmegaConf does not always say)."""
    items = node.items_ex(resolve=False) if isinstance(node, DictConfig) else enumerate(node)
    for key, _ in list(items):
        name = f"{prefix}{key}" if isinstance(node, DictConfig) else f"{prefix.rstrip('.')}[{key}]"
        try:
            value = node[key]
        except OmegaConfBaseException:
            return name
        if isinstance(value, (DictConfig, ListConfig)):
            found = _unresolvable_key(value, f"{name}.")
            if found:
                return found
    return ""


def _quote(entry: str) -> str:
    return "'" + entry.replace("\\", "\\\\").replace("'", "\\'") + "'"


def launch_time() -> datetime:
    """When this run was started: ``$LIGHTNING_PARO_LAUNCH_TIME`` (seconds since the epoch), set by the first process
    and inherited by the processes Lightning starts, so ``${now:...}`` in run.dir means the same time on every rank."""
    return datetime.fromtimestamp(float(os.environ.get(LAUNCH_TIME_ENV) or time.time()))


def _multiply(*values: Any) -> Optional[int]:
    """``${mul:a,b}``; null when a value is not an integer (the key it came from is then refused by name)."""
    product = 1
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int):
            return None
        product *= value
    return product


def _compose(overrides: Sequence[str]) -> DictConfig:
    GlobalHydra.instance().clear()
    if importlib.util.find_spec(PACKAGE_CONFIG_MODULE) is not None:
        init = initialize_config_module(config_module=PACKAGE_CONFIG_MODULE, version_base="1.3")
    else:
        init = initialize_config_dir(config_dir=str(package_config_dir()), version_base="1.3")
    try:
        with init:
            # after Hydra's initialisation, which registers its own ${now:...}: that one reads the clock in each
            # process, so ranks Lightning re-launches later would disagree
            OmegaConf.register_new_resolver("now", lambda pattern: launch_time().strftime(pattern), replace=True)
            # ${mul:a,b}: trainer.val_check_interval as micro-batches from max_steps and accumulate_grad_batches
            OmegaConf.register_new_resolver("mul", _multiply, replace=True)
            return compose(CONFIG_NAME, overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()


def load_config(overrides: Sequence[str], config_dirs: Sequence[Path] = (), cwd: Optional[Path] = None) -> Config:
    """The checked configuration for ``overrides``, with ``run.dir`` made absolute against ``cwd``."""
    cfg = to_config(compose_raw(overrides, config_dirs, cwd))
    check_config(cfg)
    return cfg


def to_config(raw: DictConfig) -> Config:
    """Each top-level node into its place: dataclasses for the settings (unknown keys and wrong types become
    ConfigError), plain dicts for the ``_target_`` groups and the trainer."""
    for key in raw.keys():
        if key not in TOP_LEVEL_KEYS:
            hint = (" (an experiment file must start with `# @package _global_`)" if key == "experiment"
                    else targets.closest(str(key), TOP_LEVEL_KEYS))
            raise ConfigError(str(key), f"unknown top-level key; the keys are {', '.join(TOP_LEVEL_KEYS)}{hint}")
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
    for key, schema in SETTINGS_SCHEMAS.items():
        parts[key] = _typed(key, schema, raw.get(key))
    parts["model"] = _plain("model", raw.get("model"), default={})
    parts["data"] = _plain("data", raw.get("data"), default=None)
    parts["trainer"] = _plain("trainer", raw.get("trainer"), default={})
    parts["callbacks"] = _plain("callbacks", raw.get("callbacks"), default={})
    parts["logger"] = _plain("logger", raw.get("logger"), default={})
    return Config(**parts)


def _plain(key: str, node: Any, default: Any) -> Any:
    if node is None:
        return default
    if not isinstance(node, DictConfig):
        raise ConfigError(key, f"must be a mapping, got {node!r}")
    try:
        return OmegaConf.to_container(node, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as exc:
        missing = f"{key}.{exc.full_key}" if exc.full_key and not str(exc.full_key).startswith(key) else str(
            exc.full_key or key)
        raise ConfigError(missing, f"has no value (???); pass {missing}=VALUE") from None


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
    for key in ("max_attempts", "fetch_threads", "writer_queue_size"):
        _positive(f"predict.{key}", getattr(p, key))
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


def _trainer_parameters() -> dict[str, inspect.Parameter]:
    import lightning as L

    return dict(inspect.signature(L.Trainer.__init__).parameters)


def check_trainer(t: dict) -> None:
    """The trainer node: arguments of lightning.Trainer, and the values the strategies depend on."""
    known = _trainer_parameters()
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


# ---------------------------------------------------------------------------------------------------- error text
def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def _missing_config_error(exc: MissingConfigException) -> ConfigError:
    group, _, option = (exc.missing_cfg_file or "").rpartition("/")
    if group and exc.options:
        return ConfigError(group, f"no config {option!r} in group {group}; choose one of {', '.join(exc.options)}"
                                  f"{targets.closest(option, exc.options)}")
    if group:
        return ConfigError(group, f"no config {option!r} in group {group}, which has no options here; put"
                                  f" {group}/{option}.yaml in a directory passed with --config-dir")
    return ConfigError(group, _first_line(str(exc)))


def _composition_error(exc: ConfigCompositionException, overrides: Sequence[str]) -> ConfigError:
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
        return ConfigError(key, f"unknown key{_known_keys_hint(key, overrides)}")
    cause = exc.__cause__
    if isinstance(cause, OmegaConfBaseException):
        return ConfigError(str(getattr(cause, "full_key", "") or ""), _first_line(str(cause.msg or cause)))
    return ConfigError("", _first_line(text))


def _known_keys_hint(key: str, overrides: Sequence[str]) -> str:
    """Which keys the node holding ``key`` does have (composed again without the override that failed)."""
    group = key.split(".")[0]
    if "." not in key:
        return f"; the top-level keys are {', '.join(TOP_LEVEL_KEYS)}{targets.closest(key, TOP_LEVEL_KEYS)}"
    if group in ("model", "data", "trainer", "callbacks", "logger"):
        # free-form nodes: the key may be a typo, or right and only absent from the config file so far
        parent, _, leaf = key.rpartition(".")
        adding = f"add it with +{key}=VALUE"
        names = _argument_names(parent, overrides, key)
        if names is None:
            return f"; to give {parent} an argument its config has no key for, {adding}"
        if leaf in names:
            return f"; {parent} takes {leaf} but its config has no key for it: {adding}"
        listed = "" if parent == "trainer" else f"its arguments are {', '.join(names)}; "
        return f"{targets.closest(leaf, names)} ({listed}to pass one the config lacks, {adding})"
    schema = SETTINGS_SCHEMAS.get(group)
    if group == "strategy":
        rest = [o for o in overrides if o.lstrip("+~").split("=")[0].strip() != key]
        try:
            name = _compose(rest).strategy.name
        except Exception:  # the hint is a courtesy; the error itself stands without it
            name = None
        schema = STRATEGY_SCHEMAS.get(name)
        group = f"strategy (strategy.name={name})"
    if schema is None:
        return ""
    names = [f.name for f in dataclasses.fields(schema)]
    return f" in {group}; its keys are {', '.join(names)}{targets.closest(key.rpartition('.')[2], names)}"


def _argument_names(parent: str, overrides: Sequence[str], failed: str) -> Optional[list[str]]:
    """The argument names of the class the node ``parent`` builds (of lightning.Trainer for ``trainer``), composed
    again without the override that failed; None when that cannot be told."""
    if parent == "trainer":
        return [k for k in _trainer_parameters() if k != "self"]
    rest = [o for o in overrides if o.lstrip("+~").split("=")[0].strip() != failed]
    try:
        node = OmegaConf.select(_compose(rest), parent)
        target = targets.locate(parent, node["_target_"])
        return [p.name for p in inspect.signature(target).parameters.values()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    except Exception:  # the hint is a courtesy; the error itself stands without it
        return None


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
