"""``sharding="auto"`` on the settings registered in ``preregistered.json`` (settings it was not tuned on), by the
protocol written there before any run: auto's first run on a cold link cache (probe, plan and switches paid) is the
headline, its warm-cache run a second column, beside the three-line rule and the best fixed strategy; memory-bound
settings run under an enforced limit.

Results: ``bench/results/auto/preregistered/<setting>.json`` (every run as it came, with provenance), table:
:func:`table` (rendered into docs/auto.md by ``bench/results_tables.py``).

Usage (root; uses ``bench/cluster.py``): ``python bench/auto/prereg.py [--settings p1-...,p2-...] [--passes 1]
[--allow-changed-planner]``; ``--model-scale tiny`` (with ``--out``) runs the same protocol on a tiny model, a check
of the harness only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "bench" / "train"))
sys.path.insert(1, str(ROOT / "bench"))
from auto_report import auto_tokens_per_s  # noqa: E402
from choice import RULE  # noqa: E402
from provenance import stamp  # noqa: E402
from run import PARO, WORK, Setting, run_one  # noqa: E402

REGISTRY = HERE / "preregistered.json"
RESULTS = ROOT / "bench" / "results" / "auto" / "preregistered"
FIXED = [p[5:].upper() for p in PARO]
"""The 14 fixed strategies, by their letters."""
TOLERANCE = 0.05
UNLIMITED = 1 << 50
"""The calibration run's "limit": the watcher only measures."""


def registered() -> dict:
    return json.loads(REGISTRY.read_text())


def planner_state(reg: dict) -> dict:
    """Whether the planner is the frozen one: each recorded path's tree at HEAD and uncommitted changes in it."""
    out = {}
    for path, frozen in reg["planner"]["paths"].items():
        tree = subprocess.run(["git", "rev-parse", f"HEAD:{path}"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", path], cwd=ROOT, capture_output=True, text=True)
        out[path] = {"frozen": frozen, "head": tree.stdout.strip(), "uncommitted": bool(dirty.stdout.strip())}
    return out


def planner_is_frozen(state: dict) -> bool:
    return all(v["frozen"] == v["head"] and not v["uncommitted"] for v in state.values())


@dataclass(frozen=True)
class Registered:
    name: str
    setting: Setting
    model: list[str]
    budget_bytes_per_parameter: Optional[float]


def model_overrides(spec: dict) -> list[str]:
    m = spec["model"]
    return [f"model.dim={m['dim']}", f"model.layers={m['layers']}", f"model.heads={m['heads']}",
            f"model.seq_len={m['seq_len']}", f"data.batch_size={spec['batch_size']}"]


TINY = {"dim": 32, "layers": 2, "heads": 2, "seq_len": 32}


def parse(name: str, spec: dict, tiny: bool = False) -> Registered:
    if tiny:
        spec = {**spec, "model": TINY, "timed_steps": 2}
    s = Setting(spec["nodes"], spec["per_node"], spec["mbit"], spec["accumulation"], timed_steps=spec["timed_steps"])
    return Registered(name, s, model_overrides(spec) + ["bench.memory=true"], spec.get("budget_bytes_per_parameter"))


def parameters(model: dict) -> int:
    """The parameter count of the demo GPT with ``model``'s shape (built on the meta device)."""
    import torch

    from lightning_paro.demo import GPTTask

    with torch.device("meta"):
        built = GPTTask(dim=model["dim"], layers=model["layers"], heads=model["heads"], seq_len=model["seq_len"])
    return sum(p.numel() for p in built.parameters())


def rule_pick(fits: set[str], memory: dict[str, float]) -> Optional[str]:
    """The three-line rule on measured fits: the first of ``RULE`` that fits, else the least memory that fits."""
    for s in RULE:
        if s in fits:
            return s
    return min(fits, key=lambda s: (memory.get(s, float("inf")), s)) if fits else None


def score(data: dict) -> dict:
    """The setting's comparison from its stored runs (see the protocol)."""
    runs = data["runs"]
    fixed = {k: r for k, r in runs.items() if k in FIXED}
    fits = {k for k, r in fixed.items() if "error" not in r}
    exceeded = sorted(k for k, r in fixed.items() if r.get("error") == "memory limit exceeded")
    tps = {k: fixed[k]["tokens_per_s"] for k in fits}
    memory = {k: fixed[k].get("model_state_bytes_max_rank", float("inf")) for k in fits}
    best = max(tps, key=lambda k: (tps[k], k)) if tps else None
    out: dict = {"best_fixed": best, "best_tokens_per_s": tps.get(best), "exceeded_limit": exceeded,
                 "fits": sorted(fits)}
    rule = rule_pick(fits, memory)
    out["rule"] = rule
    out["rule_over_best"] = tps[rule] / tps[best] if rule and best else None
    for key in ("auto_cold", "auto_warm"):
        r = runs.get(key)
        if r is None or best is None:
            out[key] = None
            continue
        if "error" in r:
            out[key] = {"error": r["error"], "over_best": 0.0}
            continue
        paid = auto_tokens_per_s({**r, "timed_steps_from": 1})  # one warm-up step (run.py)
        auto = r.get("auto", {})
        out[key] = {"pick": auto.get("in_use") or r.get("auto_choice"), "plan_seconds": r.get("auto", {}).get("plan_seconds"),
                    "tokens_per_s_paid": paid, "over_best": paid / tps[best]}
    return out


def run_setting(reg: Registered, args: argparse.Namespace, out_dir: Path, state: dict) -> dict:
    path = out_dir / f"{reg.name}.json"
    data = json.loads(path.read_text()) if path.exists() else {"setting": reg.name, "runs": {}}
    runs = data["runs"]
    work = WORK / "prereg" / reg.name
    cache = WORK / "prereg-link-cache" / reg.name
    import os

    os.environ["LIGHTNING_PARO_CACHE_DIR"] = str(cache)
    budget_overrides: tuple[str, ...] = ()
    limit = 0
    s = reg.setting

    def save() -> None:
        data.update(planner=state, planner_frozen=planner_is_frozen(state), provenance=stamp())
        data["score"] = score(data)
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2))

    def one(system: str, key: str, extra: tuple[str, ...] = (), memory_limit: int = 0) -> dict:
        row = run_one(system, s, work / key, extra, worker=True, model=reg.model, timeout=args.timeout,
                      memory_limit=memory_limit)
        print(reg.name, key, {k: row.get(k) for k in ("tokens_per_s", "auto_choice", "error")}, flush=True)
        return row

    if reg.budget_bytes_per_parameter is not None:
        spec = registered()["settings"][reg.name]
        params = parameters(TINY if args.model_scale == "tiny" else spec["model"])
        budget = int(reg.budget_bytes_per_parameter * params)
        if "calibration_ggg" not in runs:
            # no limit (one far above anything), so that the watcher measures with the baseline the limit uses
            runs["calibration_ggg"] = one("paro_ggg", "calibration_ggg", memory_limit=UNLIMITED)
            save()
        cal = runs["calibration_ggg"]
        if "error" in cal:
            raise SystemExit(f"{reg.name}: the calibration run of GGG failed, so no limit can be set: {cal['error']}")
        allowance = max(cal["resident_growth_bytes_per_rank"]) - cal["model_state_bytes_max_rank"]
        limit = budget + allowance
        data["memory"] = {"parameters": params, "budget_bytes": budget, "allowance_bytes": allowance,
                          "enforced_limit_bytes": limit}
        budget_overrides = (f"strategy.memory_budget={budget}",)
    if "auto_cold" not in runs:
        shutil.rmtree(cache, ignore_errors=True)  # the first job on these hosts: the whole probe
        runs["auto_cold"] = one("paro", "auto_cold", budget_overrides, limit)
        save()
    for _ in range(max(1, args.passes)):
        for strategy in args.fixed.split(","):
            key = strategy
            if key in runs and args.passes <= 1:
                continue
            row = one(f"paro_{strategy.lower()}", key, (), limit)
            runs[key] = row if key not in runs or "error" in row else _median(runs[key], row)
            save()
        if "auto_warm" not in runs or args.passes > 1:
            row = one("paro", "auto_warm", budget_overrides, limit)
            runs["auto_warm"] = row if "auto_warm" not in runs or "error" in row else _median(runs["auto_warm"], row)
            save()
    return data


def _median(old: dict, new: dict) -> dict:
    sys.path.insert(0, str(ROOT / "bench" / "train"))
    from run import with_run

    return with_run(old if "error" not in old else None, new)


def table(out_dir: Path = RESULTS) -> str:
    """Markdown of the stored runs of every registered setting (what has not run says so)."""
    reg = registered()
    lines = ["| setting | best fixed (tokens/s) | auto, cold cache: pick, start-up s, / best | auto, warm cache: / best"
             " | the rule: pick, / best | exceeded the enforced limit | planner frozen |",
             "|---|---|---|---|---|---|---|"]
    counts = {"auto_cold": 0, "auto_warm": 0, "rule": 0}
    over_rule: dict[str, list[float]] = {"auto_cold": [], "auto_warm": []}
    failed: dict[str, list[str]] = {"auto_cold": [], "auto_warm": []}
    measured = incomplete = 0
    commits = set()
    for name in reg["settings"]:
        path = out_dir / f"{name}.json"
        if not path.exists():
            lines.append(f"| {name} | not run | | | | | |")
            continue
        data = json.loads(path.read_text())
        commits.add(data.get("provenance", {}).get("commit", "?")[:7])
        runs = data["runs"]
        fixed_run = sum(k in runs for k in FIXED)
        if fixed_run < len(FIXED) or "auto_cold" not in runs or "auto_warm" not in runs:
            # a best or a rule over part of the 14 would mislead: said, not scored or counted
            incomplete += 1
            ran = {k: "run" if k in runs else "not run" for k in ("auto_cold", "auto_warm")}
            lines.append(f"| {name} | incomplete: {fixed_run} of {len(FIXED)} fixed strategies run, auto cold"
                         f" {ran['auto_cold']}, auto warm {ran['auto_warm']} | | | | | |")
            continue
        sc = score(data)
        measured += 1
        f = lambda v: "—" if v is None else f"{v:.2f}"  # noqa: E731
        cold, warm = sc.get("auto_cold") or {}, sc.get("auto_warm") or {}
        for key, v in (("auto_cold", cold.get("over_best")), ("auto_warm", warm.get("over_best")),
                       ("rule", sc.get("rule_over_best"))):
            counts[key] += v is not None and v >= 1 - TOLERANCE
        for key, auto in (("auto_cold", cold), ("auto_warm", warm)):
            if "error" in auto:  # a miss: counted as one above, and no ratio to average
                failed[key].append(name)
            elif auto.get("over_best") is not None and sc.get("rule_over_best"):
                over_rule[key].append(auto["over_best"] / sc["rule_over_best"])
        # a run that stopped shows its error in place of its figures
        cold_cell = cold.get("error") or (f"{cold.get('pick') or '—'}, {f(cold.get('plan_seconds'))},"
                                          f" {f(cold.get('over_best'))}")
        lines.append(
            f"| {name} | {sc['best_fixed'] or '—'} ({f(sc['best_tokens_per_s'])})"
            f" | {cold_cell} | {warm.get('error') or f(warm.get('over_best'))} | {sc['rule'] or '—'},"
            f" {f(sc['rule_over_best'])}"
            f" | {', '.join(sc['exceeded_limit']) or 'none'} | {'yes' if data.get('planner_frozen') else 'NO'} |")
    if measured:
        lines += ["", f"Within {TOLERANCE:.0%} of the best fixed strategy, of {measured} settings measured: auto on a"
                      f" cold cache (headline) {counts['auto_cold']}, auto on a warm cache {counts['auto_warm']}, the"
                      f" rule {counts['rule']}. What auto gains over the rule (auto's tokens/s over the rule's"
                      f" pick's, geometric mean over those settings): cold cache {_gmean(over_rule['auto_cold'])},"
                      f" warm cache {_gmean(over_rule['auto_warm'])}.{_failures(failed)} Measured at commits:"
                      f" {', '.join(sorted(commits))}."]
    elif incomplete:
        lines += ["", "*No setting complete yet: the rows above say how far each has run; `python bench/auto/prereg.py`"
                      " resumes them.*"]
    else:
        lines += ["", "*Not measured yet: the settings and the protocol are registered in"
                      " `bench/auto/preregistered.json`; run `python -m bench.regenerate --only auto`.*"]
    return "\n".join(lines)


def _failures(failed: dict[str, list[str]]) -> str:
    """The settings where auto's run did not finish (over the enforced limit): misses, left out of the means."""
    said = [f"{label} in {', '.join(failed[key])}" for key, label in (("auto_cold", "cold"), ("auto_warm", "warm"))
            if failed[key]]
    if not said:
        return ""
    return (f" Runs of auto that stopped without a result ({'; '.join(said)}) are misses in the counts and left out"
            " of the means, which are over the settings where it finished.")


def _gmean(values: list[float]) -> str:
    if not values:
        return "—"
    return f"{statistics.geometric_mean(values):.2f}x (range {min(values):.2f}-{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    reg = registered()
    ap.add_argument("--settings", default=",".join(reg["settings"]))
    ap.add_argument("--passes", type=int, default=1)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds one run may take")
    ap.add_argument("--fixed", default=",".join(FIXED),
                    help="the fixed strategies to run (the protocol: all 14; fewer only to check the harness)")
    ap.add_argument("--allow-changed-planner", action="store_true",
                    help="run although the planner differs from the frozen one (stored as not counting)")
    ap.add_argument("--model-scale", choices=("registered", "tiny"), default="registered",
                    help="tiny: the protocol on a tiny model and 2 timed steps (a check of the harness; needs --out)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if (args.model_scale == "tiny" or args.fixed != ",".join(FIXED)) and args.out.resolve() == RESULTS.resolve():
        sys.exit("--model-scale tiny and --fixed check the harness: give --out a folder outside bench/results")
    state = planner_state(reg)
    if not planner_is_frozen(state) and not args.allow_changed_planner:
        sys.exit(f"the planner differs from the one frozen in {REGISTRY.name} ({json.dumps(state)}): these settings"
                 " measure the frozen planner; run at its commit, or pass --allow-changed-planner (not counted)")
    for name in args.settings.split(","):
        if name not in reg["settings"]:
            sys.exit(f"no registered setting {name!r}: {', '.join(reg['settings'])}")
        run_setting(parse(name, reg["settings"][name], args.model_scale == "tiny"), args, args.out, state)
    print(table(args.out))


if __name__ == "__main__":
    main()
