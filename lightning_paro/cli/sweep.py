"""Multirun sweeps (``-m key=a,b``): Hydra's basic sweeper expands the jobs; each job is a fresh
``python -m lightning_paro`` process without ``-m``.

Why a process per job rather than Hydra's in-process launcher (measured, see ``main.py``'s docstring): Lightning's
subprocess launcher starts a job's other ranks by re-running the command line, so under ``@hydra.main -m`` rank 1
got the whole sweep's command line and ran every job in one process, joined to the first job's process group; a
sweep whose jobs differ in world size or start method cannot work that way. A job started as its own command line
has neither problem, and its ranks re-run exactly that job.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, OverrideParseException

from lightning_paro.cli.compose import load_config
from lightning_paro.cli.schema import ConfigError


@dataclass(frozen=True)
class SweepJob:
    """One point of the sweep."""

    index: int
    """Position in the sweep (also the name of its output directory)."""
    overrides: tuple[str, ...]
    """The job's own overrides (the swept keys with one value each, and the fixed ones)."""
    swept: tuple[str, ...]
    """Just the swept overrides, for the report."""
    run_dir: str
    """The job's output directory: <run.dir>/<index>."""


def expand_sweep(overrides: Sequence[str]) -> list[tuple[list[str], list[str]]]:
    """Hydra's basic sweeper's jobs (the cartesian product of the sweep overrides): per job, (all its overrides, the
    swept ones)."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
        jobs = BasicSweeper.split_arguments(parsed, max_batch_size=None)[0]
    except (OverrideParseException, HydraException) as exc:
        raise ConfigError("", f"cannot expand the sweep: {str(exc).strip().splitlines()[0]}") from None
    swept = {o.get_key_element() for o in parsed if o.is_sweep_override()}
    return [(job, [o for o in job if o.split("=", 1)[0] in swept]) for job in jobs]


def plan_sweep(overrides: Sequence[str], config_dirs: Sequence[Path] = ()) -> list[SweepJob]:
    """Every job's overrides and output directory; each job's config is composed and checked before any runs."""
    jobs = []
    expanded = expand_sweep(overrides)
    for index, (job_overrides, swept) in enumerate(expanded):
        try:
            cfg = load_config(job_overrides, config_dirs)
        except ConfigError as err:
            job = f"job {index + 1} of {len(expanded)}" + (f" ({' '.join(swept)})" if swept else "")
            raise ConfigError(err.key, err.message, job=job) from None
        # the job's directory is given explicitly so its ranks (which re-run its command line) agree on it
        kept = [o for o in job_overrides if o.split("=", 1)[0].lstrip("+") != "run.dir"]
        run_dir = str(Path(cfg.run.dir) / str(index))
        jobs.append(SweepJob(index, tuple(kept + [f"run.dir={run_dir}"]), tuple(swept), run_dir))
    return jobs


def job_command(command: str, job: SweepJob, config_dirs: Sequence[Path] = ()) -> list[str]:
    extra = [arg for directory in config_dirs for arg in ("--config-dir", str(directory))]
    return [sys.executable, "-m", "lightning_paro", command, *extra, *job.overrides]


def _job_result(command: str, run_dir: str) -> dict:
    name = {"fit": "summary.json", "bench": "bench.json", "predict": "predict.json"}.get(command)
    path = Path(run_dir) / name if name else None
    if path is not None and path.is_file():
        return json.loads(path.read_text())
    return {}


def _headline(command: str, result: dict) -> str:
    if command == "bench" and result.get("tokens_per_s") is not None:
        return f"{result['tokens_per_s']:.0f} tokens/s"
    if command == "bench" and result.get("samples_per_s") is not None:
        return f"{result['samples_per_s']:.1f} samples/s" + (
            f", inter {result['inter_bytes_per_step'] / 1e6:.3f} MB/step" if "inter_bytes_per_step" in result else "")
    if command == "predict" and result.get("rows") is not None:
        return f"{result['rows']} rows predicted"
    if command == "fit" and result.get("loss_per_step_rank0"):
        text = f"final loss {result['loss_per_step_rank0'][-1]:.3f}"
        if "inter_bytes_per_step" in result:
            text += f", inter {result['inter_bytes_per_step'] / 1e6:.3f} MB/step"
        return text
    return ""


def run_sweep(command: str, overrides: Sequence[str], config_dirs: Sequence[Path] = ()) -> int:
    """Run the jobs one after another; print a table and write sweep.json next to the job directories."""
    jobs = plan_sweep(overrides, config_dirs)
    rows = []
    for job in jobs:
        label = " ".join(job.swept) or "(no swept keys)"
        print(f"[sweep] job {job.index + 1}/{len(jobs)}: {label} -> {job.run_dir}", flush=True)
        completed = subprocess.run(job_command(command, job, config_dirs))
        result = _job_result(command, job.run_dir)
        rows.append({"job": job.index, "overrides": list(job.swept), "run_dir": job.run_dir,
                     "exit_code": completed.returncode, "result": result})
    sweep_dir = Path(jobs[0].run_dir).parent if jobs else None
    if sweep_dir is not None:
        sweep_dir.mkdir(parents=True, exist_ok=True)
        (sweep_dir / "sweep.json").write_text(json.dumps({"command": command, "jobs": rows}, indent=2))
    print(f"\n[sweep] {command}: {len(rows)} jobs" + (f" (results in {sweep_dir / 'sweep.json'})" if sweep_dir else ""))
    for row in rows:
        status = "ok" if row["exit_code"] == 0 else f"FAILED (exit {row['exit_code']})"
        swept = " ".join(row["overrides"]) or "-"
        print(f"  {row['job']}: {swept:40s} {status:18s} {_headline(command, row['result'])}")
    return 0 if all(row["exit_code"] == 0 for row in rows) else 1
