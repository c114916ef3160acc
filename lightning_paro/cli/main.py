"""``lightning-paro fit|predict|bench [KEY=VALUE ...] [-m] [--cfg job] [--config-dir DIR]`` (or
``python -m lightning_paro ...``).

The command line is read by Hydra's own argument parser (``get_args_parser``, the one ``@hydra.main`` uses), so its
flags mean what they mean in any Hydra app; the first word that is no override picks the command. The config is then
composed with Hydra's compose API (``compose.py``) and each sweep job started as its own process (``sweep.py``)
rather than through ``@hydra.main``, for three reasons measured on hydra-core 1.3.8 and Lightning 2.6:

- multirun: under ``@hydra.main -m +x=1,2`` with a 2-process CPU DDP Trainer, Lightning's launcher
  (``_hydra_subprocess_cmd``) started rank 1 with the whole sweep's command line (``-m +x=1,2`` plus a
  ``hydra.run.dir`` that multirun ignores); that one rank-1 process then ran job 0 and job 1 in turn, joined to the
  process group of job 0 (same process id, no second launch). It only worked because both jobs had the same world
  size; a sweep over ``trainer.devices`` or start methods would hang. ``sweep.py`` starts each job as its own
  command line, whose ranks re-run just that job;
- ``--cfg job`` under ``@hydra.main`` prints the raw composed config: a ``predict.ledger`` password would be printed,
  which ``commands.config_yaml`` masks;
- a composition error under ``@hydra.main`` is Hydra's several lines and exit code 1; here every config error is one
  line naming the key and its fix, exit code 2.

``--shell-completion`` (``-sc install=bash``) is Hydra's completion plugin over the same search path. What stays
hand-written is what Hydra does not do: the command word, the checks of the composed config (``checks.py``,
``targets.py``), the help's list of groups, and starting a process per sweep job.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import hydra
from hydra._internal.utils import get_args_parser

from lightning_paro.cli.checks import check_launch_environment
from lightning_paro.cli.compose import (
    CONFIG_NAME,
    LAUNCH_TIME_ENV,
    PACKAGE_CONFIG_MODULE,
    group_options,
    load_config,
    package_config_dir,
    user_config_dirs,
)
from lightning_paro.cli.schema import ConfigError

PROG = "lightning-paro"
COMMAND_HELP = {
    "fit": "train the model on the data, save run.dir/weights.ckpt, print the strategy's traffic and memory summary",
    "predict": "run the data's predict dataloader through that checkpoint with elastic batch prediction, to Parquet",
    "bench": "samples (tokens) per second of a few training steps with the configured strategy",
}
USAGE = f"usage: {PROG} {{{','.join(COMMAND_HELP)}}} [KEY=VALUE ...] [-m|--multirun] [--cfg job] [--config-dir DIR]"
UNSUPPORTED = {"hydra_help": "--hydra-help", "package": "--package", "run": "--run", "config_path": "--config-path",
               "config_name": "--config-name", "experimental_rerun": "--experimental-rerun", "info": "--info"}
"""Flags of Hydra's parser that act on ``@hydra.main``'s run, which this command line does not use (see above)."""


@dataclass(frozen=True)
class Invocation:
    """A parsed command line."""

    command: Optional[str]
    """fit, predict or bench (None with --help)."""
    overrides: tuple[str, ...]
    """Hydra overrides, in order."""
    multirun: bool = False
    """-m/--multirun: run one job per combination of the comma-separated values."""
    print_config: bool = False
    """--cfg job (or all): print the composed config and exit."""
    config_dirs: tuple[Path, ...] = ()
    """--config-dir: a directory of the user's configs, added to the search path after the package's."""
    help: bool = False
    """-h/--help."""
    shell_completion: bool = False
    """-sc/--shell-completion: Hydra's shell completion (install=bash, uninstall=bash, query=bash; zsh, fish)."""


def _refuse(message: str) -> None:
    named = re.match(r"argument ([-\w]+)|unrecognized arguments: (\S+)", message)
    raise ConfigError(next((g for g in named.groups() if g), "") if named else "", f"{message}; {USAGE}")


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lightning-paro")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "(not installed)"


def parse_args(argv: Sequence[str]) -> Invocation:
    """Hydra's argument parser over the command line; the first word that is no override is the command."""
    parser = get_args_parser()
    parser.prog, parser.error = PROG, _refuse  # one line naming the flag instead of argparse's usage and exit
    for action in parser._actions:  # --version names this package (Hydra's parser names Hydra)
        if isinstance(action, argparse._VersionAction):
            action.version = f"{PROG} {_package_version()} (Hydra {hydra.__version__})"
    args = parser.parse_intermixed_args(list(argv))
    if sum(a in ("--config-dir", "-cd") or a.startswith(("--config-dir=", "-cd=")) for a in argv) > 1:
        raise ConfigError("--config-dir", "give it once (Hydra's parser keeps the last); add more directories with"
                                          " hydra.searchpath=[file://A,file://B] or LIGHTNING_PARO_CONFIG_DIR")
    given = [flag for attr, flag in UNSUPPORTED.items() if getattr(args, attr)]
    if given or args.cfg == "hydra" or args.resolve:
        flag = given[0] if given else "--cfg" if args.cfg == "hydra" else "--resolve"
        raise ConfigError(flag, "Hydra's own run settings do not apply to this command line (outputs go to run.dir,"
                                f" the config printed by --cfg job is resolved); {USAGE}")
    overrides = list(args.overrides)
    words = [o for o in overrides if "=" not in o and not o.startswith(("~", "+"))]
    command = words[0] if words else None
    if command is not None:
        overrides.remove(command)
        if command not in COMMAND_HELP:
            raise ConfigError("command", f"{command!r} is not a command; use one of {', '.join(COMMAND_HELP)}")
    elif not (args.help or args.shell_completion):
        raise ConfigError("command", f"missing; use one of {', '.join(COMMAND_HELP)} ({USAGE})")
    config_dirs = (Path(args.config_dir).expanduser().resolve(),) if args.config_dir else ()
    return Invocation(command, tuple(overrides), multirun=args.multirun, print_config=args.cfg is not None,
                      config_dirs=config_dirs, help=args.help, shell_completion=args.shell_completion)


def help_text(config_dirs: Sequence[Path] = ()) -> str:
    lines = [USAGE, "", "commands:"]
    lines += [f"  {name:8s} {text}" for name, text in COMMAND_HELP.items()]
    try:
        directories, options = [package_config_dir(), *user_config_dirs(config_dirs)], group_options(config_dirs)
    except ConfigError:
        directories, options = [package_config_dir()], group_options()
    lines += ["", "config groups (" + ", ".join(str(d) for d in directories) + ", and schema.py's dataclasses):"]
    lines += [f"  {group + '=':12s} {', '.join(names)}" for group, names in options.items()]
    lines += [
        "",
        "examples:",
        f"  {PROG} fit strategy=paro_iig strategy.group_size=2 trainer=cpu4",
        f"  {PROG} fit --config-dir ./configs model=mine data=mine trainer.devices=2 callbacks=checkpoint",
        f"  {PROG} predict                     # run.dir/weights.ckpt over the data's predict_dataloader",
        f"  {PROG} bench -m strategy=paro_nig,paro_ggg,ddp,fsdp2 trainer=cpu4",
        f"  {PROG} fit --cfg job               # print the composed config",
        "strategy=paro is PaROStrategy() with its defaults (sharding=auto); strategy=paro_iig pins IIG",
        "flags are Hydra's (-m, --cfg job, --config-dir); every key: docs/config.md",
    ]
    return "\n".join(lines)


def shell_completion(invocation: Invocation) -> None:
    """Hydra's completion plugins over this command line's search path (the package's tree, the stored nodes, the
    user's directories): ``eval "$(lightning-paro -sc install=bash)"``, then tab completes groups, options and keys.
    The command word is taken out of the line Hydra completes, which it would read as an override."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.global_hydra import GlobalHydra

    line = os.environ.get("COMP_LINE")
    if line is not None:
        os.environ["COMP_LINE"] = re.sub(rf"^(\s*\S+\s+)(?:{'|'.join(COMMAND_HELP)})(?:\s+|$)", r"\1", line, count=1)
    search_path = create_config_search_path(f"pkg://{PACKAGE_CONFIG_MODULE}")
    for directory in user_config_dirs(invocation.config_dirs):
        search_path.append("lightning-paro", f"file://{directory}")
    GlobalHydra.instance().clear()
    try:
        Hydra.create_main_hydra2(task_name=PROG, config_search_path=search_path).shell_completion(
            config_name=CONFIG_NAME, overrides=list(invocation.overrides))
    except ValueError as err:
        raise ConfigError("--shell-completion", f"{str(err).splitlines()[0]} (install=bash, uninstall=bash or"
                                                " query=bash; zsh and fish too)") from None
    finally:
        GlobalHydra.instance().clear()


def _launching_process() -> bool:
    """Whether this is the process a user started (not a rank Lightning or torchrun started beside it)."""
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def run(invocation: Invocation) -> int:
    """Execute a parsed command line; returns the exit code."""
    if invocation.help:
        print(help_text(invocation.config_dirs))
        return 0
    if invocation.shell_completion:
        shell_completion(invocation)
        return 0
    assert invocation.command is not None
    # the processes Lightning starts for this run inherit it: ${now:...} resolves alike in all of them
    os.environ.setdefault(LAUNCH_TIME_ENV, repr(time.time()))
    if invocation.multirun:
        if _under_torchrun():
            raise ConfigError("-m", "a sweep starts its own processes per job; under torchrun run one job per"
                                    " torchrun call (drop -m and give each job's values)")
        from lightning_paro.cli.sweep import run_sweep

        return run_sweep(invocation.command, invocation.overrides, invocation.config_dirs)
    cfg = load_config(invocation.overrides, invocation.config_dirs)
    if invocation.command != "fit" and cfg.ckpt_path is not None:
        raise ConfigError("ckpt_path", f"resumes fit only; {invocation.command} does not read it"
                                       + (" (predict reads predict.checkpoint)" if invocation.command == "predict"
                                          else "") + ": drop it")
    if cfg.left_out and _launching_process():
        print(f"{PROG}: note: strategy={cfg.strategy.name} has no {', '.join(cfg.left_out)} (set by a config file"
              " for another strategy): left out", flush=True)
    if invocation.print_config:
        from lightning_paro.cli.commands import config_yaml

        print(config_yaml(cfg), end="")
        return 0
    if invocation.command in ("fit", "bench"):
        check_launch_environment(cfg)
    from lightning_paro import compat
    from lightning_paro.cli import bench, commands

    compat.check_private_apis()

    run_command = {"fit": commands.fit, "predict": commands.predict, "bench": bench.bench}[invocation.command]
    run_command(cfg)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``lightning-paro`` and ``python -m lightning_paro``; exit code 2 and one line on a config
    error."""
    from lightning_paro.compat import IncompatibleVersionError

    # `_target_` classes import from the working directory, as they do under `python -m lightning_paro` (the console
    # script's own directory is on the path instead); processes Lightning starts inherit the path
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return run(parse_args(sys.argv[1:] if argv is None else argv))
    except (ConfigError, IncompatibleVersionError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 2
