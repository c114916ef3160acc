"""Summarise the training benchmark (bench/results/train/*.json): one markdown table per setting, the targets of the
issue checked against the measured numbers, written to bench/results/train/summary.md.

Per setting the report names the best PaRO strategy and compares it with Lightning's strategies twice: against every
baseline, and against the baselines whose per-rank model states fit the best PaRO strategy's (the same memory
budget). It also checks that every system ends at the same loss and how close ``sharding="auto"`` came to the best.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "train"
BASELINES = ("ddp", "fsdp2", "hsdp")
SYSTEMS = len(BASELINES) + 14 + 1
"""Systems in a complete setting: the baselines, the 14 PaRO strategies and sharding="auto"."""
MiB = 2**20


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def is_paro(system: str) -> bool:
    """One of the 14 fixed PaRO strategies (not the "paro" auto row)."""
    return system.startswith("paro_")


@dataclass(frozen=True)
class Verdict:
    """The issue's targets for one setting, computed from its rows."""

    best_paro: str
    best_paro_tps: float
    budget_bytes: int
    best_fitting_baseline: Optional[str]
    vs_fitting_baseline: Optional[float]
    best_baseline: str
    vs_best_baseline: float
    vs_fsdp2: Optional[float]
    auto_choice: Optional[str]
    auto_vs_best: Optional[float]
    """The auto run's tokens/s over the best fixed strategy's (two runs: includes run-to-run noise)."""
    choice_vs_best: Optional[float]
    """The chosen strategy's own fixed run over the best fixed one (the same runs: measures the choice only)."""
    max_loss_diff: float


def verdict(data: dict) -> Verdict:
    rows = {r["system"]: r for r in data["rows"] if "error" not in r}
    paro = {k: r for k, r in rows.items() if is_paro(k)}
    best = max(paro, key=lambda k: paro[k]["tokens_per_s"])
    tps = paro[best]["tokens_per_s"]
    budget = paro[best]["model_state_bytes_max_rank"]
    base = {k: rows[k] for k in BASELINES if k in rows}
    fitting = {k: r for k, r in base.items() if r["model_state_bytes_max_rank"] <= budget}
    best_fit = max(fitting, key=lambda k: fitting[k]["tokens_per_s"]) if fitting else None
    best_base = max(base, key=lambda k: base[k]["tokens_per_s"])
    auto = rows.get("paro")
    losses = [r["final_loss"] for r in rows.values()]
    return Verdict(
        best_paro=best, best_paro_tps=tps, budget_bytes=budget, best_fitting_baseline=best_fit,
        vs_fitting_baseline=tps / fitting[best_fit]["tokens_per_s"] if best_fit else None,
        best_baseline=best_base, vs_best_baseline=tps / base[best_base]["tokens_per_s"],
        vs_fsdp2=tps / base["fsdp2"]["tokens_per_s"] if "fsdp2" in base else None,
        auto_choice=auto.get("auto_choice") if auto else None,
        auto_vs_best=auto["tokens_per_s"] / tps if auto else None,
        choice_vs_best=(paro[f"paro_{auto['auto_choice'].lower()}"]["tokens_per_s"] / tps
                        if auto and auto.get("auto_choice") and f"paro_{auto['auto_choice'].lower()}" in paro
                        else None),
        max_loss_diff=max(losses) - min(losses),
    )


def title(data: dict) -> str:
    peft = (f", PEFT-like (only the last {data['trainable_blocks']} block trains)"
            if data.get("trainable_blocks") is not None else ", full training")
    done = sum("error" not in r for r in data["rows"])
    partial = f" (partial: {done} of {SYSTEMS} systems)" if done < SYSTEMS else ""
    return (f"{data['nodes']} nodes x {data['ranks_per_node']} ranks, {data['mbit']} Mbit/s per node,"
            f" accumulate_grad_batches={data['accumulation']}{peft}{partial}")


def _cell(value: Optional[float], fmt: str = "{:.1f}") -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


def table(data: dict) -> str:
    rows = [r for r in data["rows"] if "error" not in r]
    ref = {r["system"]: r["tokens_per_s"] for r in rows if r["system"] in BASELINES}
    repeated = any("runs" in r for r in rows)
    out = [f"### {title(data)}", "",
           *(["Systems ran several times, pass by pass; each row is its run of median tokens/s, and 'runs' lists"
              " them all.", ""] if repeated else []),
           "| system | tokens/s" + (" | runs" if repeated else "") + " | vs ddp | vs fsdp2 | step s"
           " | inter MB/step/rank | intra MB/step/rank | node0 NIC MiB/step | model states MiB/rank | peak RSS MiB"
           " | final loss |",
           "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if repeated else "")]
    for r in rows:
        name = r["system"] + (f" (auto: {r['auto_choice']})" if r.get("auto_choice") else "")
        name += " (failed while exiting, after its report)" if r.get("exit_error") else ""
        steps = r["timed_steps"] + 1  # one warm-up step; the NIC counters cover the whole run
        nic = r.get("nic_sent_mib_whole_run", {}).get("node0/eth0")
        tps = r["tokens_per_s"]
        out.append(
            f"| {name} | {tps:.1f}"
            + (" | " + ", ".join(f"{x['tokens_per_s']:.0f}" for x in r.get("runs", [r])) if repeated else "")
            + f" | {_cell(tps / ref['ddp'] if 'ddp' in ref else None, '{:.2f}x')}"
            f" | {_cell(tps / ref['fsdp2'] if 'fsdp2' in ref else None, '{:.2f}x')} | {r['step_seconds']:.2f}"
            f" | {_cell(r['inter_bytes_per_step'] / 1e6 if 'inter_bytes_per_step' in r else None)}"
            f" | {_cell(r['intra_bytes_per_step'] / 1e6 if 'intra_bytes_per_step' in r else None)}"
            f" | {_cell(nic / steps if nic is not None else None)}"
            f" | {r['model_state_bytes_max_rank'] / MiB:.1f} | {r['peak_rss_bytes_max_rank'] / MiB:.0f}"
            f" | {r['final_loss']:.5f} |")
    failed = [r["system"] for r in data["rows"] if "error" in r]
    if failed:
        out.append(f"\nfailed: {', '.join(failed)}")
    return "\n".join(out)


def targets(named: list[tuple[str, dict]]) -> str:
    out = ["### Targets", "",
           "Best PaRO strategy against Lightning's baselines: all of them, and those whose per-rank model states fit"
           " the best PaRO strategy's (target at accumulate_grad_batches=4: >= 1.19x the best fitting baseline and"
           " >= 1.5x FSDP2). `auto` against the best measured PaRO strategy (target >= 0.95): the chosen strategy's"
           " own run over the best (the choice), and the auto run over the best (adds run-to-run noise).", "",
           "| setting | best PaRO (tokens/s) | its model states MiB | best fitting baseline | vs it | vs best baseline"
           " | vs fsdp2 | auto chose | its run / best | auto run / best | loss spread |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, data in named:
        if not any(is_paro(r["system"]) and "error" not in r for r in data["rows"]):
            continue  # nothing to compare yet
        v = verdict(data)
        out.append(
            f"| {name} | {v.best_paro[5:].upper()} ({v.best_paro_tps:.0f}) | {v.budget_bytes / MiB:.1f}"
            f" | {v.best_fitting_baseline or 'none fits'} | {_cell(v.vs_fitting_baseline, '{:.2f}x')}"
            f" | {v.vs_best_baseline:.2f}x ({v.best_baseline}) | {_cell(v.vs_fsdp2, '{:.2f}x')}"
            f" | {v.auto_choice or '—'} | {_cell(v.choice_vs_best, '{:.2f}')} | {_cell(v.auto_vs_best, '{:.2f}')}"
            f" | {v.max_loss_diff:.1e} |")
    return "\n".join(out)


def main() -> None:
    named = [(p.stem, load(p)) for p in sorted(RESULTS.glob("*.json"))]
    named = [(n, d) for n, d in named if any("error" not in r for r in d.get("rows", []))]
    text = "\n\n".join([targets(named), *(table(d) for _, d in named)])
    (RESULTS / "summary.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
