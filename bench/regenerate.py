"""One command that re-runs every results-producing benchmark at its stated settings and then renders every results
table of README.md and docs/*.md from the stored files (``bench/results_tables.py``).

Steps (``STEPS``; ``--only`` picks some, in this order): train (the sweep), memory, compression (the anchors beside
PaRO's options, and the older communication-variant runs), accuracy, auto (the choice set, the run set, the
paper-scale predictions and the registered settings), collectives, predict. Each step's commands replace the stored
results of the code measured now (``--fresh`` where a script would otherwise join new runs to stored ones). Every
results file a step writes records its provenance (commit, date, machine): the scripts stamp what they write, and
any file written during a step without a stamp gets this run's.

A benchmark of another area adds its step with :func:`step` (a module listed in ``STEP_MODULES``, imported on first
use, may register steps too).

Usage (root, from the repository root): ``python -m bench.regenerate [--only train,memory,...] [--render-only]
[--dry-run]``. The whole set takes many hours on a 2-core machine; ``--dry-run`` prints the commands.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "bench") not in sys.path:
    sys.path.insert(0, str(ROOT / "bench"))
import provenance  # noqa: E402
import results_tables  # noqa: E402

PY = sys.executable
STEP_MODULES: tuple[str, ...] = ()
"""Modules that register more steps with :func:`step` when imported."""


@dataclass(frozen=True)
class Step:
    name: str
    commands: tuple[tuple[str, ...], ...]
    """Command lines run in order from the repository root."""
    results: tuple[str, ...] = field(default=())
    """Globs under bench/results/ the step writes (stamped with provenance where a script did not)."""
    root: bool = False
    """Whether the step needs root (the emulated cluster's network namespaces)."""


STEPS: dict[str, Step] = {}


def step(name: str, *commands: tuple[str, ...], results: tuple[str, ...] = (), root: bool = False) -> Step:
    if name in STEPS:
        raise ValueError(f"two steps named {name!r}")
    STEPS[name] = Step(name, tuple(commands), results, root)
    return STEPS[name]


def _train(*args: str) -> tuple[str, ...]:
    return (PY, "bench/train/run.py", *args)


step("train",
     _train("--set", "sweep", "--fresh", "--more", "3"),
     (PY, "bench/train/report.py"), (PY, "bench/train/validate.py"), (PY, "bench/train/plot.py"),
     results=("train/2x2-*.json", "train/4x2-*.json", "train/cost_model.json"), root=True)
step("memory", (PY, "bench/train/memory.py", "--runs", "3"), results=("train/memory.json",), root=True)
step("compression",
     _train("--set", "compression", "--fresh", "--more", "3"),
     *[(PY, "bench/train/comm.py", "--setting", s, "--passes", "3")
       for s in ("2x2-100m-a1", "2x2-100m-a4", "4x2-100m-a1", "4x2-100m-a4")],
     results=("train/compression/*.json", "train/comm_*.json"), root=True)
step("accuracy", (PY, "bench/train/accuracy.py", "--seeds", "3", "--steps", "1000", "--every", "100", "--redo"),
     results=("train/accuracy.json",))
step("auto",
     _train("--set", "choice", "--fresh", "--more", "3"),
     _train("--set", "run", "--fresh", "--more", "5"),
     (PY, "bench/train/auto_report.py"),
     (PY, "bench/auto/paper_scale.py", "--json", "bench/results/auto/paper_scale.json", "--plot",
      "bench/results/auto/paper_scale.png"),
     (PY, "bench/auto/prereg.py"),
     results=("train/choice/*.json", "train/run/*.json", "auto/*.json", "auto/preregistered/*.json"), root=True)
step("collectives",
     (PY, "bench/collectives.py", "--with-comm"),
     *[(PY, "bench/collectives.py", "--scenario", s, "--sizes", "64", "--collectives", "all_reduce", "--reps", "5",
        "--out", "bench/results/collectives/targets", "--tag", f"-run{i}")
       for s in ("2x2-node-contiguous-1g", "4x2-node-round-robin-1g", "4x2-rank-contiguous-1g") for i in (1, 2, 3)],
     results=("collectives/*.json", "collectives/targets/*.json"), root=True)
step("predict", ("bash", "bench/predict/run.sh"), results=("predict/*.json",), root=True)


def steps() -> dict[str, Step]:
    for module in STEP_MODULES:
        importlib.import_module(module)
    return STEPS


def stamp_written(s: Step, since: float) -> list[Path]:
    """Give every results file of ``s`` written after ``since`` without provenance this run's; returns them."""
    stamped = []
    for pattern in s.results:
        for path in sorted((ROOT / "bench" / "results").glob(pattern)):
            if path.stat().st_mtime < since:
                continue
            data = json.loads(path.read_text())
            if not provenance.missing(data):
                continue
            path.write_text(json.dumps(provenance.with_stamp(data), indent=2))
            stamped.append(path)
    return stamped


def run_step(s: Step, dry_run: bool = False) -> None:
    import os

    if s.root and os.geteuid() != 0 and not dry_run:
        raise SystemExit(f"step {s.name} runs on the emulated cluster, which needs root (network namespaces)")
    started = time.time()
    for cmd in s.commands:
        print("$", " ".join(cmd), flush=True)
        if dry_run:
            continue
        done = subprocess.run(cmd, cwd=ROOT)
        if done.returncode != 0:
            raise SystemExit(f"step {s.name}: {' '.join(cmd)} exited with {done.returncode}; the tables were not"
                             " rendered (fix it and rerun with --only " + s.name + ")")
    if not dry_run:
        for path in stamp_written(s, started):
            print("stamped", path.relative_to(ROOT))


def main(argv: list[str] | None = None) -> None:
    all_steps = steps()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(all_steps), help=f"steps, of: {', '.join(all_steps)}")
    ap.add_argument("--render-only", action="store_true", help="only render the tables from the stored results")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing, render nothing")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in all_steps]
    if unknown:
        raise SystemExit(f"no step {', '.join(unknown)}: the steps are {', '.join(all_steps)}")
    if not args.render_only:
        for name in names:
            run_step(all_steps[name], args.dry_run)
    if args.dry_run:
        return
    for path in results_tables.update():
        print("rendered", path.relative_to(ROOT))


if __name__ == "__main__":
    main()
