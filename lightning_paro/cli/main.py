"""``lightning-paro fit|predict|bench [KEY=VALUE ...] [-m] [--cfg] [--config-dir DIR]`` (or
``python -m lightning_paro ...``)."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from lightning_paro.cli.checks import check_launch_environment
from lightning_paro.cli.compose import LAUNCH_TIME_ENV, load_config, package_config_dir, user_config_dirs
from lightning_paro.cli.schema import ConfigError

PROG = "lightning-paro"
COMMAND_HELP = {
    "fit": "train the model on the data, save run.dir/weights.ckpt, print the strategy's traffic and memory summary",
    "predict": "run the data's predict dataloader through that checkpoint with elastic batch prediction, to Parquet",
    "bench": "samples (tokens) per second of a few training steps with the configured strategy",
}
USAGE = f"usage: {PROG} {{{','.join(COMMAND_HELP)}}} [KEY=VALUE ...] [-m|--multirun] [--cfg] [--config-dir DIR]"


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
    """--cfg: print the composed config and exit."""
    config_dirs: tuple[Path, ...] = ()
    """--config-dir (repeatable): directories of the user's configs, added to the search path after the package's."""
    help: bool = False
    """-h/--help."""


def parse_args(argv: Sequence[str]) -> Invocation:
    """Split the command line; anything that is not a flag is a Hydra override."""
    command, overrides, flags = None, [], {}
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-h", "--help"):
            flags["help"] = True
        elif arg in ("-m", "--multirun"):
            flags["multirun"] = True
        elif arg in ("--cfg", "-c"):
            flags["print_config"] = True
            if i + 1 < len(args) and args[i + 1] == "job":  # Hydra's spelling, `--cfg job`, is accepted too
                i += 1
        elif arg == "--config-dir" or arg.startswith("--config-dir="):
            if "=" in arg:
                value = arg.split("=", 1)[1]
            elif i + 1 < len(args):
                i += 1
                value = args[i]
            else:
                raise ConfigError("--config-dir", "needs a directory")
            flags["config_dirs"] = (*flags.get("config_dirs", ()), Path(value).expanduser().resolve())
        elif arg.startswith("-"):
            raise ConfigError(arg, f"unknown option; {USAGE}")
        elif command is None and "=" not in arg:
            if arg not in COMMAND_HELP:
                raise ConfigError("command", f"{arg!r} is not a command; use one of {', '.join(COMMAND_HELP)}")
            command = arg
        else:
            overrides.append(arg)
        i += 1
    if command is None and not flags.get("help"):
        raise ConfigError("command", f"missing; use one of {', '.join(COMMAND_HELP)} ({USAGE})")
    return Invocation(command, tuple(overrides), **flags)


def help_text(config_dirs: Sequence[Path] = ()) -> str:
    lines = [USAGE, "", "commands:"]
    lines += [f"  {name:8s} {text}" for name, text in COMMAND_HELP.items()]
    try:
        directories = [package_config_dir(), *user_config_dirs(config_dirs)]
    except ConfigError:
        directories = [package_config_dir()]
    options: dict[str, set[str]] = {}
    for directory in directories:
        for group in (p for p in directory.iterdir() if p.is_dir()) if directory.is_dir() else []:
            found = {p.stem for p in group.glob("*.yaml")}
            if found:
                options.setdefault(group.name, set()).update(found)
    lines += ["", "config groups (" + ", ".join(str(d) for d in directories) + "):"]
    lines += [f"  {group + '=':12s} {', '.join(sorted(names))}" for group, names in sorted(options.items())]
    lines += [
        "",
        "examples:",
        f"  {PROG} fit strategy=paro_iig strategy.group_size=2 trainer=cpu4",
        f"  {PROG} fit --config-dir ./configs model=mine data=mine trainer.devices=2 callbacks=checkpoint",
        f"  {PROG} predict                     # run.dir/weights.ckpt over the data's predict_dataloader",
        f"  {PROG} bench -m strategy=paro_nig,paro_ggg,ddp,fsdp2 trainer=cpu4",
        f"  {PROG} fit --cfg job               # print the composed config",
        "strategy=paro is PaROStrategy() with its defaults (sharding=auto); strategy=paro_iig pins IIG",
        "every key: docs/config.md",
    ]
    return "\n".join(lines)


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
