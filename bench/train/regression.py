"""The engine against an earlier commit of itself, side by side on the emulated cluster: tokens/s and peak memory of
the same fixed strategies, runs of the two commits alternated so a busy spell of the machine hits both alike.

The earlier commit runs from a git worktree of it (its working directory, which ``python -m`` searches first, with
its own ``conf/`` put inside its package, where the package looks first), the current one from this checkout; both through the package's ``bench`` command with the same overrides as
``run.py``'s sweep (``run_one``: the same GPT, one warm-up step, then ``--steps`` timed optimizer steps). Each row
reports the median of ``--passes`` runs per commit and the ratio current / earlier; peak memory is the largest rank's
resident set (``peak_rss_bytes_max_rank``) and the engine's model-state bytes. Results:
``bench/results/train/regression_<setting>.json`` with both commits and the date.

Usage (root): ``python bench/train/regression.py --baseline COMMIT [--setting 2x2-100m-a4] [--passes 3]
[--steps 4] [--rows NNG,NIG,...]``
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import RESULTS, ROOT, SETTINGS, WORK, run_one  # noqa: E402

SYSTEMS = {
    "NNG": ("paro_nng", ()),
    "NIG": ("paro_nig", ()),
    "IIG": ("paro_iig", ()),
    "GGG": ("paro_ggg", ()),
    "NIG bf16+int8": ("paro_nig", ("strategy.param_dtype=bf16", "strategy.reduce_dtype=bf16",
                                   "strategy.inter_quant=int8")),
}
"""The rows: a fixed strategy and its overrides."""


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def baseline_tree(commit: str) -> Path:
    """A worktree of ``commit`` whose package finds its own configs first (``lightning_paro/conf``)."""
    tree = WORK / "regression-baseline"
    if tree.exists():
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
        shutil.rmtree(tree, ignore_errors=True)
    git("worktree", "add", "--detach", str(tree), commit)
    shutil.copytree(tree / "conf", tree / "lightning_paro" / "conf")
    return tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", required=True, help="the earlier commit")
    ap.add_argument("--setting", default="2x2-100m-a4")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="timed optimizer steps per run")
    ap.add_argument("--rows", default=",".join(SYSTEMS), help="default: every row (" + ", ".join(SYSTEMS) + ")")
    args = ap.parse_args()
    rows_run = {row: SYSTEMS[row] for row in args.rows.split(",")}
    setting = dataclasses.replace(SETTINGS[args.setting], timed_steps=args.steps)
    current = git("rev-parse", "HEAD")
    baseline = git("rev-parse", args.baseline)
    tree = baseline_tree(baseline)
    runs: dict[str, dict[str, list[dict]]] = {row: {"baseline": [], "current": []} for row in rows_run}
    try:
        for k in range(args.passes):
            for row, (system, extra) in rows_run.items():
                for side in (("baseline", "current") if k % 2 == 0 else ("current", "baseline")):
                    result = run_one(system, setting, WORK / "regression" / side / system, extra,
                                     cwd=tree if side == "baseline" else ROOT)
                    runs[row][side].append({key: result.get(key) for key in (
                        "tokens_per_s", "peak_rss_bytes_max_rank", "model_state_bytes_max_rank", "final_loss",
                        "inter_bytes_per_step", "error")})
                    print(args.setting, row, side, json.dumps(runs[row][side][-1]), flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    rows = []
    for row, sides in runs.items():
        med = {side: {key: statistics.median(r[key] for r in rs if r.get(key) is not None)
                      for key in ("tokens_per_s", "peak_rss_bytes_max_rank", "model_state_bytes_max_rank")
                      if any(r.get(key) is not None for r in rs)}
               for side, rs in sides.items()}
        ratio = {key: med["current"][key] / med["baseline"][key] for key in med["current"]
                 if key in med["baseline"] and med["baseline"][key]}
        rows.append({"row": row, "median": med, "current_over_baseline": ratio, "runs": sides})
        print(f"{row:>14}: tokens/s {ratio.get('tokens_per_s', float('nan')):.3f}x, peak RSS"
              f" {ratio.get('peak_rss_bytes_max_rank', float('nan')):.3f}x, model state"
              f" {ratio.get('model_state_bytes_max_rank', float('nan')):.3f}x (current / {baseline[:7]})", flush=True)
    out = RESULTS / f"regression_{args.setting}.json"
    out.write_text(json.dumps({
        "setting": args.setting, "timed_steps": args.steps, "passes": args.passes, "current_commit": current,
        "baseline_commit": baseline, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} CPUs", "rows": rows}, indent=2))
    print("wrote", out.relative_to(ROOT))


if __name__ == "__main__":
    main()
