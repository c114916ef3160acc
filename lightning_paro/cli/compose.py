"""From command-line overrides to a checked :class:`Config`: Hydra composes the config tree, the schema types it
and ``checks.py`` checks what no type can express.

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
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from hydra import compose, initialize_config_dir, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from lightning_paro.cli import targets
from lightning_paro.cli.checks import check_config, trainer_parameters
from lightning_paro.cli.schema import (
    STRATEGY_SCHEMAS,
    TARGET_GROUPS,
    UNREAD_KEYS,
    BenchConfig,
    Config,
    ConfigError,
    DDPStrategyConfig,
    FSDP2StrategyConfig,
    ParoStrategyConfig,
    PredictConfig,
    RunConfig,
)
from lightning_paro.strategy.levels import VALID_STRATEGIES

PACKAGE_CONFIG_MODULE = "lightning_paro.conf"
"""The package holding the config tree (``conf/`` in the repository, mapped into the wheel)."""
CONFIG_DIR_ENV = "LIGHTNING_PARO_CONFIG_DIR"
"""Environment variable naming config directories to add to the search path (separated by the path separator)."""
CONFIG_NAME = "config"
LAUNCH_TIME_ENV = "LIGHTNING_PARO_LAUNCH_TIME"
"""Environment variable with the run's start time, shared by all processes Lightning starts for it."""

SETTINGS_SCHEMAS: dict[str, type] = {"predict": PredictConfig, "bench": BenchConfig, "run": RunConfig}
"""Top-level key -> its dataclass (``strategy`` is chosen by ``strategy.name``, see ``STRATEGY_SCHEMAS``)."""
TOP_LEVEL_KEYS = ("strategy", *TARGET_GROUPS, "trainer", *SETTINGS_SCHEMAS, "ckpt_path")


# ---------------------------------------------------------------------------------------------------- stored nodes
def register_configs() -> None:
    """The config nodes whose keys a schema dataclass types, stored in Hydra's ConfigStore from those dataclasses, so
    that their defaults are written once: ``strategy=paro`` (``PaROStrategy()``'s defaults, from ``PaROOptions``),
    ``strategy=paro_<xyz>`` for each of the 14 shardings (one rule: the paro node with that sharding),
    ``strategy=ddp|fsdp2|hsdp``, ``predict=elastic`` and the root's ``bench``, ``run`` and ``ckpt_path``
    (``settings``, first in config.yaml's defaults list)."""
    store = ConfigStore.instance()
    paro = dataclasses.asdict(ParoStrategyConfig())
    store.store(group="strategy", name="paro", node=paro)
    for sharding in VALID_STRATEGIES:
        store.store(group="strategy", name=f"paro_{sharding.lower()}", node={**paro, "sharding": sharding})
    store.store(group="strategy", name="ddp", node=dataclasses.asdict(DDPStrategyConfig()))
    store.store(group="strategy", name="fsdp2", node=dataclasses.asdict(FSDP2StrategyConfig()))
    store.store(group="strategy", name="hsdp", node=dataclasses.asdict(FSDP2StrategyConfig(name="hsdp")))
    store.store(group="predict", name="elastic", node=dataclasses.asdict(PredictConfig()))
    settings = {key: dataclasses.asdict(schema()) for key, schema in SETTINGS_SCHEMAS.items() if key != "predict"}
    store.store(name="settings", node={**settings, "ckpt_path": Config.__dataclass_fields__["ckpt_path"].default})


register_configs()


def group_options(config_dirs: Sequence[Path] = ()) -> dict[str, list[str]]:
    """Each config group's options: the package's files, the stored nodes and the user's directories' files."""
    options: dict[str, set[str]] = {}
    for directory in [package_config_dir(), *user_config_dirs(config_dirs)]:
        for group in (p for p in directory.iterdir() if p.is_dir()):
            options.setdefault(group.name, set()).update(p.stem for p in group.glob("*.yaml"))
    for group, names in _stored_options().items():
        options.setdefault(group, set()).update(names)
    return {group: sorted(names) for group, names in sorted(options.items()) if names}


def _stored_options() -> dict[str, list[str]]:
    store = ConfigStore.instance()
    groups = [name for name in store.list("") if not name.endswith(".yaml") and name != "hydra"]
    return {group: [name.removesuffix(".yaml") for name in store.list(group)] for group in groups}



# ---------------------------------------------------------------------------------------------------- search path
def package_config_dir() -> Path:
    """The package's config tree: the installed ``lightning_paro.conf``, or ``conf/`` beside the package in a source
    checkout that is not installed."""
    spec = importlib.util.find_spec(PACKAGE_CONFIG_MODULE)
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))).resolve()
    return Path(__file__).resolve().parents[2] / "conf"


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
            if twin.is_file() or path.stem in _stored_options().get(path.parent.name, ()):
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
    cfg = to_config(compose_raw(overrides, config_dirs, cwd), overrides)
    check_config(cfg)
    return cfg


def to_config(raw: DictConfig, overrides: Sequence[str] = ()) -> Config:
    """Each top-level node into its place: dataclasses for the settings (unknown keys and wrong types become
    ConfigError), plain dicts for the ``_target_`` groups and the trainer. ``overrides``: the command line's, which
    tell the strategy keys a user gave from those config files set (:func:`_keys_of_other_strategies`)."""
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
    left_out = _keys_of_other_strategies(strategy_node, name, overrides)
    parts["strategy"] = _typed("strategy", STRATEGY_SCHEMAS[name], strategy_node)
    parts["left_out"] = left_out
    ckpt_path = raw.get("ckpt_path")
    if ckpt_path is not None and not (isinstance(ckpt_path, str) and ckpt_path.strip()):
        raise ConfigError("ckpt_path", f"{ckpt_path!r} must be a checkpoint path, last, or null")
    parts["ckpt_path"] = ckpt_path
    for key, schema in SETTINGS_SCHEMAS.items():
        parts[key] = _typed(key, schema, raw.get(key))
    parts["model"] = _plain("model", raw.get("model"), default={})
    parts["data"] = _plain("data", raw.get("data"), default=None)
    parts["trainer"] = _plain("trainer", raw.get("trainer"), default={})
    parts["callbacks"] = _plain("callbacks", raw.get("callbacks"), default={})
    parts["logger"] = _plain("logger", raw.get("logger"), default={})
    return Config(**parts)


def _keys_of_other_strategies(node: DictConfig, name: str, overrides: Sequence[str]) -> tuple[str, ...]:
    """The rule that lets one experiment run under every strategy (``bench -m experiment=X strategy=paro_iig,ddp``):
    a key of the strategy node that the chosen strategy ``name`` does not read but another strategy does
    (``group_size`` under ``ddp`` or ``fsdp2``) is meaningful only under that other strategy. Set by a config file,
    it is taken out of ``node`` and, unless null, returned as ``strategy.key=value`` (the command reports it); given
    on the command line, it stays, and the schema (or ``checks.py``) refuses it by name."""
    own = {f.name for f in dataclasses.fields(STRATEGY_SCHEMAS[name])} - UNREAD_KEYS.get(name, frozenset())
    others = {f.name for other in STRATEGY_SCHEMAS.values() for f in dataclasses.fields(other)} - own
    given = {o.lstrip("+~").split("=", 1)[0].strip() for o in overrides}
    values = OmegaConf.to_container(node, resolve=True)
    left_out = []
    for key in [str(k) for k in node.keys()]:
        if key in others and f"strategy.{key}" not in given:
            if values[key] is not None:
                left_out.append(f"strategy.{key}={values[key]}")
            with open_dict(node):
                del node[key]
    return tuple(left_out)


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
        return [k for k in trainer_parameters() if k != "self"]
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
