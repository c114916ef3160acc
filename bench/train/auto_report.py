"""Score ``sharding="auto"`` on the training benchmark's settings by the criterion of ``choice.py``.

For every setting of ``run.py``'s ``CHOICE_SETTINGS`` with results (``bench/results/train/choice/<setting>.json``,
written by ``run.py --set choice``):

* the fixed PaRO strategies' measured tokens/s (each row the run of median tokens/s);
* which of them fit the setting's memory budget: every one without a budget; with one, those whose memory, as the
  plan of ``auto``'s median run predicts it with the activations that run measured, is within the budget. Beside
  it the table shows each strategy's measured footprint (its model-state bytes and gathered-parameter peak from its
  own run, plus the measured activations), which must agree;
* ``auto``'s pick (the strategy in use at the end of its run) and its own tokens/s, two ways: over the timed window
  like every other system (a switch made inside it is in it), and with its start-up plan (probes) and any switch
  made before the window added to the window's time, so the probe, the plan and every switch are paid for within
  the benchmark's short run (a real job pays them once over many more steps), and the number of optimizer steps
  after which a run of ``auto`` with its probe and plan paid is within 5% of the best (``steps_to_pay_back``).

Then ``auto``, "always NNG", "always the lowest-memory strategy that fits" and the best fitting strategy (an oracle)
are scored, and the results set is checked to be one where the choice matters. Writes
``bench/results/train/choice/auto.md`` and ``auto.json``.

Usage: ``python bench/train/auto_report.py [--settings a,b,...]``
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from choice import (  # noqa: E402
    SettingResult,
    always,
    best_fitting,
    choice_matters,
    lowest_memory_that_fits,
    score,
    three_line_rule,
)
from run import CHOICE_RESULTS as RESULTS  # noqa: E402  (puts bench/ on the path too)
from provenance import stamp  # noqa: E402
from run import CHOICE_SETTINGS, REPLAN_SETTINGS, RUN_RESULTS, RUN_SETTINGS  # noqa: E402


def auto_tokens_per_s(row: dict) -> float:
    """``auto``'s tokens/s over the timed steps, with its start-up plan and any switch made before the window
    counted in the time (a switch inside the window is in it already)."""
    auto = row.get("auto", {})
    outside = sum(s["seconds"] for s in auto.get("switches", []) if s["step"] <= row["timed_steps_from"])
    seconds = row["seconds"] + auto.get("plan_seconds", 0.0) + outside
    return row["tokens_per_step"] * row["timed_steps"] / seconds


def steps_to_pay_back(best_tokens_per_s: float, auto_tokens_per_s: float, tokens_per_step: float,
                      start_seconds: float, within: float = 0.05) -> float:
    """Optimizer steps after which a run of ``auto`` (``start_seconds`` of probe and plan, then steps at its own
    measured rate) is within ``within`` of the best strategy's tokens/s: N steps take N s_a + P against N s_b, and
    N s_b / (N s_a + P) >= 1 - within from N = (1 - within) P / (s_b - (1 - within) s_a) on; inf if never."""
    s_a, s_b = tokens_per_step / auto_tokens_per_s, tokens_per_step / best_tokens_per_s
    gap = s_b - (1 - within) * s_a
    return (1 - within) * start_seconds / gap if gap > 0 else float("inf")


def upper_median(values: list[float]) -> float:
    """The median of ``values``, the upper of the two middle ones for an even count (a run that happened)."""
    return sorted(values)[len(values) // 2]


def links_source(run: dict) -> str:
    """Where a run of ``auto`` got its links: "cache" (stored by an earlier run, checked), "probe" or "given"."""
    first = (run.get("auto", {}).get("notes") or [""])[0]
    return "cache" if first.startswith("links from the link cache") else "given" if first.startswith(
        "links given") else "probe"


def load(name: str) -> tuple[SettingResult, dict] | None:
    path = RESULTS / f"{name}.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    rows = {r["system"]: r for r in data["rows"] if "error" not in r}
    auto = rows.get("paro")
    if auto is None or "auto" not in auto:
        return None
    tokens = {s[len("paro_"):].upper(): float(r["tokens_per_s"]) for s, r in rows.items()
              if s.startswith("paro_") and r.get("tokens_per_s")}
    warmup = 1
    runs = []
    for run in auto.get("runs", [auto]):
        run = {**run, "timed_steps_from": warmup}
        runs.append((float(run["tokens_per_s"]), auto_tokens_per_s(run), run))
    runs.sort(key=lambda x: x[0])
    own, _, median_run = runs[len(runs) // 2]
    paid = upper_median([r[1] for r in runs])
    plan = median_run["auto"]
    predicted = plan.get("predicted_memory_bytes", {})
    budget = data.get("memory_budget")
    fits = set(tokens) if budget is None else {s for s in tokens if predicted.get(s, float("inf")) <= budget}
    activations = plan.get("activation_bytes") or 0.0
    measured = {}
    for s, r in rows.items():
        if s.startswith("paro_") and r.get("model_state_bytes_max_rank") is not None:
            measured[s[len("paro_"):].upper()] = (r["model_state_bytes_max_rank"] + (r.get("gathered_peak_bytes_rank0")
                                                                                     or 0) + activations)
    setting = SettingResult(name, tokens, frozenset(fits), {s: predicted.get(s, float("inf")) for s in tokens})
    extra = {"auto_tokens_per_s": own, "auto_tokens_per_s_paid": paid,
             "auto_pick": plan.get("in_use") or plan.get("choice"),
             "tokens_per_step": median_run["tokens_per_step"],
             "auto_runs": [round(t, 1) for t, _, _ in runs], "auto_runs_paid": [round(t, 1) for _, t, _ in runs],
             "auto_picks": [r["auto"].get("in_use") for _, _, r in runs],
             "switches": [r["auto"].get("switches", []) for _, _, r in runs], "budget": budget,
             "measured_footprint": measured, "predicted_memory": predicted, "activations": activations,
             "plan_seconds": [round(r["auto"].get("plan_seconds", 0.0), 2) for _, _, r in runs],
             "links_source": [links_source(r) for _, _, r in runs],
             "window_seconds": [round(r["seconds"], 1) for _, _, r in runs]}
    return setting, extra


def replan_check(name: str) -> list[str]:
    """The re-planning check (``run.py``'s REPLAN_SETTINGS): per run of ``auto`` started on a forced first plan, the
    switch, and its tokens/s after the step that switched against the best strategy's own tokens/s over the window."""
    path = RESULTS / f"{name}.json"
    if not path.exists():
        return []
    rows = {r["system"]: r for r in json.loads(path.read_text())["rows"] if "error" not in r}
    forced = [k for k in rows if "@" in k]
    fixed = {k: r for k, r in rows.items() if k.startswith("paro_")}
    if not forced or not fixed:
        return []
    best_name, best = max(fixed.items(), key=lambda kv: kv[1]["tokens_per_s"])
    out = [f"Re-planning check ({name}): {best_name} {best['tokens_per_s']:.1f} tokens/s (runs"
           f" {', '.join(str(r['tokens_per_s']) for r in best.get('runs', [best]))})", ""]
    for system in forced:
        for run in rows[system].get("runs", [rows[system]]):
            switches = run["auto"].get("switches", [])
            if not switches:
                out.append(f"- {system}: no switch, {run['tokens_per_s']:.1f} tokens/s")
                continue
            step = switches[-1]["step"]
            after = run["each_step_seconds"][step - 1:]  # the window starts after step 1: index k times step k + 2
            rate = run["tokens_per_step"] * len(after) / sum(after)
            paid = auto_tokens_per_s({**run, "timed_steps_from": 1})
            out.append(f"- {system}: switched {switches[-1]['from']} -> {switches[-1]['to']} after step {step} in"
                       f" {switches[-1]['seconds']:.2f} s; {rate:.1f} tokens/s over the {len(after)} steps after it"
                       f" ({rate / best['tokens_per_s']:.2f}x {best_name}); {run['tokens_per_s']:.1f} over the whole"
                       f" window of {len(run['each_step_seconds'])} steps ({run['tokens_per_s'] / best['tokens_per_s']:.2f}x);"
                       f" {paid:.1f} with the probe and plan ({run['auto'].get('plan_seconds', 0.0):.1f} s) and the"
                       f" switch paid ({paid / best['tokens_per_s']:.2f}x)")
    return out


def run_set(fits: dict[str, frozenset]) -> tuple[list[str], dict]:
    """The run set (``run.py --set run``): per setting, auto's runs with their start-up paid against the best fixed
    strategy measured in the same passes (median runs), the first run of auto (empty link cache: the whole probe)
    and the later ones (links from the cache) apart; ``fits``: the choice set's fitting strategies per setting."""
    lines = ["| setting | steps timed | best fixed (tokens/s) | auto: picks | auto: start-up (s; links from) |"
             " auto / best, start-up paid: each run | median | first run (whole probe) |", "|---|---|---|---|---|---|---|---|"]
    out, within, within_cold, within_first_three, counted = {}, [], [], [], 0
    for name, setting in RUN_SETTINGS.items():
        path = RUN_RESULTS / f"{name}.json"
        if not path.exists():
            continue
        rows = {r["system"]: r for r in json.loads(path.read_text())["rows"] if "error" not in r}
        fixed_rows = {k[len("paro_"):].upper(): r for k, r in rows.items()
                      if k.startswith("paro_") and r.get("tokens_per_s")}
        fixed = {k: float(r["tokens_per_s"]) for k, r in fixed_rows.items()}
        auto = rows.get("paro")
        if not fixed or auto is None:
            continue
        counted += 1
        best = max(fixed, key=fixed.get)
        runs = auto.get("runs", [auto])
        paid_tokens_per_s = [auto_tokens_per_s({**r, "timed_steps_from": 1}) for r in runs]
        paid = [t / fixed[best] for t in paid_tokens_per_s]
        sources = [links_source(r) for r in runs]
        picks = [r["auto"].get("in_use") for r in runs]
        median = upper_median(paid)
        cold = [p for p, w in zip(paid, sources) if w == "probe"]
        fitting = all(p in fits.get(name, {p}) for p in picks)
        # the setting as its first three runs of each system alone read (runs added later move the medians)
        first_best = max(upper_median([x["tokens_per_s"] for x in r.get("runs", [r])[:3]]) for r in fixed_rows.values())
        if upper_median([t / first_best for t in paid_tokens_per_s[:3]]) >= 0.95 and fitting:
            within_first_three.append(name)
        if median >= 0.95 and fitting:
            within.append(name)
        if cold and cold[0] >= 0.95 and fitting:
            within_cold.append(name)
        out[name] = {"timed_steps": setting.timed_steps, "fixed_tokens_per_s": fixed, "best": best,
                     "auto_picks": picks, "plan_seconds": [round(r["auto"].get("plan_seconds", 0.0), 2) for r in runs],
                     "links_source": sources, "auto_over_best_paid": [round(p, 3) for p in paid],
                     "median": round(median, 3), "first_run_whole_probe": round(cold[0], 3) if cold else None}
        paths = [" > ".join([s[0]["from"], *(w["to"] for w in s)]) if s else str(p)
                 for p, s in zip(picks, (r["auto"].get("switches", []) for r in runs))]
        lines.append(f"| {name} | {setting.timed_steps} | {', '.join(f'{k} {v:.0f}' for k, v in fixed.items())} |"
                     f" {', '.join(paths)} |"
                     f" {', '.join(f'{t} ({w})' for t, w in zip(out[name]['plan_seconds'], sources))} |"
                     f" {', '.join(f'{p:.2f}' for p in paid)} | {median:.2f} |"
                     f" {f'{cold[0]:.2f}' if cold else '-'} |")
    if not counted:
        return [], {}

    def misses(within: list[str]) -> str:
        missed = sorted(set(out) - set(within))
        return f"{', '.join(missed)} missed" if missed else "no misses"

    lines += ["", f"- auto, start-up paid (median of its runs; the first with the whole probe, the others with links"
                  f" from the cache): within 5% of the best fixed strategy in {len(within)} of {counted} settings"
                  f" ({misses(within)}).",
              f"- auto's first run of each setting alone (the whole probe): within 5% in {len(within_cold)} of"
              f" {counted} ({misses(within_cold)})."]
    if any(len(v["auto_over_best_paid"]) > 3 for v in out.values()):
        lines.append(f"- the first three runs of each system alone (medians of 3): within 5% in"
                     f" {len(within_first_three)} of {counted}"
                     f" ({misses(within_first_three)}).")
    return lines, {"settings": out, "within_5pct": within, "within_5pct_first_run": within_cold,
                   "within_5pct_first_three_runs": within_first_three}


def report(settings: tuple[str, ...] = tuple(CHOICE_SETTINGS)) -> tuple[str, dict]:
    """The report's markdown and its JSON, from the stored results of ``settings`` (nothing is written)."""
    loaded = {n: load(n) for n in settings}
    results = [v[0] for v in loaded.values() if v]
    extras = {n: v[1] for n, v in loaded.items() if v}
    pick = lambda s: extras[s.name]["auto_pick"]  # noqa: E731
    pickers = {"auto": pick, "auto, its probe, plan and switches paid in the window": pick,
               "always NNG": always("NNG"),
               "the rule: NNG if it fits, else IIG, else IGG": three_line_rule,
               "always the lowest-memory strategy that fits": lowest_memory_that_fits,
               "the best fitting strategy (oracle)": best_fitting}
    scores = {}
    for label, picker in pickers.items():
        own = None
        if label == "auto":
            own = {n: e["auto_tokens_per_s"] for n, e in extras.items()}
        elif label.startswith("auto"):
            own = {n: e["auto_tokens_per_s_paid"] for n, e in extras.items()}
        scores[label] = score(results, picker, own_tokens_per_s=own)
    lines = ["| setting | budget | fitting (measured tokens/s) | best | auto's picks | auto tokens/s (runs) | auto / best |"
             " probe and plan (s; links from) | auto / best, probe paid | steps until within 5%, probe paid |"
             " always NNG / best |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in results:
        e = extras[s.name]
        fitting = ", ".join(f"{k} {s.tokens_per_s[k]:.0f}" for k in sorted(s.fits, key=lambda k: -s.tokens_per_s[k]))
        budget = f"{e['budget'] / 1e6:.0f} MB" if e["budget"] else "-"
        nng = f"{s.tokens_per_s['NNG'] / s.tokens_per_s[s.best]:.2f}" if "NNG" in s.fits else "does not fit"
        start = upper_median(e["plan_seconds"])
        payback = steps_to_pay_back(s.tokens_per_s[s.best], e["auto_tokens_per_s"], e["tokens_per_step"], start)
        e["steps_until_within_5pct"] = payback if payback != float("inf") else None
        lines.append(f"| {s.name} | {budget} | {fitting} | {s.best} | {', '.join(map(str, e['auto_picks']))} |"
                     f" {e['auto_tokens_per_s']:.1f} ({', '.join(map(str, e['auto_runs']))}) |"
                     f" {e['auto_tokens_per_s'] / s.tokens_per_s[s.best]:.2f} |"
                     f" {', '.join(f'{t} ({w})' for t, w in zip(e['plan_seconds'], e['links_source']))} |"
                     f" {e['auto_tokens_per_s_paid'] / s.tokens_per_s[s.best]:.2f} |"
                     f" {math.ceil(payback) if payback != float('inf') else 'never'} |"
                     f" {nng} |")
    lines += ["", f"The choice matters in this set: {'yes' if choice_matters(results) else 'no'} ({len(results)}"
              f" settings; best other than NNG in {sum(s.best != 'NNG' for s in results)}:"
              f" {', '.join(sorted({s.best for s in results if s.best != 'NNG'}))}).", ""]
    for label, sc in scores.items():
        lines.append(f"- {label}: {'passes' if sc.passed else 'fails'}: {sc.reason}"
                     + (f" Misses: {', '.join(sc.misses)}." if sc.misses else ""))
    footprint = ["", "| setting | strategy | predicted memory (MB) | measured: model states + gathered peak +"
                     " activations (MB) | fits |", "|---|---|---|---|---|"]
    for s in results:
        e = extras[s.name]
        if not e["budget"]:
            continue
        for k in sorted(s.tokens_per_s):
            m = e["measured_footprint"].get(k)
            footprint.append(f"| {s.name} | {k} | {e['predicted_memory'].get(k, float('nan')) / 1e6:.1f} |"
                             f" {m / 1e6:.1f} | {'yes' if k in s.fits else 'no'} |" if m is not None else "")
    checks = [line for name in REPLAN_SETTINGS for line in replan_check(name)]
    run_lines, run_json = run_set({s.name: s.fits for s in results})
    run_part = ["", "Run set (bench/results/train/run/): auto over runs of about 40 s, its probe, plan and switches"
                    " paid, against the best fixed strategy run in the same passes.", "", *run_lines
                ] if run_lines else []
    text = "\n".join(lines + footprint + ([""] + checks if checks else []) + run_part)
    return text, {
        "settings": {s.name: {"tokens_per_s": dict(s.tokens_per_s), "fits": sorted(s.fits), "best": s.best,
                              **extras[s.name]} for s in results},
        "scores": {k: {"passed": v.passed, "reason": v.reason, "picks": dict(v.picks), "misses": list(v.misses)}
                   for k, v in scores.items()},
        "choice_matters": choice_matters(results), "run_set": run_json}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", default=",".join(CHOICE_SETTINGS))
    args = ap.parse_args()
    text, data = report(tuple(args.settings.split(",")))
    (RESULTS / "auto.md").write_text(text + "\n")
    (RESULTS / "auto.json").write_text(json.dumps({**data, "provenance": stamp()}, indent=2))
    print(text)


if __name__ == "__main__":
    main()
