"""Peak memory per rank of every training system on the same model: during training and during evaluation, beside
the design's model-state formula and the planner's prediction.

Each system trains the same GPT (about 21M parameters, 84 MB of fp32 weights) on 4 CPU processes of this machine
(2 groups of 2 for PaRO and HSDP) through the package's own ``bench`` command with ``bench.memory=true`` (glibc's
mmap threshold fixed, so freed tensors leave the resident set) and ``bench.eval_batches``: the training peak is the
resident high-water mark from the start of training to its end, read before the strategy's teardown; the evaluation
peak that of a ``validate`` on the same Trainer after fit, with the strategy's default evaluation mode. Memory does
not depend on the links, so no emulated network is needed. Systems run pass by pass, ``--runs`` times each; a row
is the median of each figure over its runs.

Writes bench/results/train/memory.json and memory.md.

Usage: ``python bench/train/memory.py [--systems ddp,fsdp2,...] [--runs 3]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from provenance import stamp  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "train"
SYSTEMS = ["ddp", "fsdp2", "hsdp", "paro_nnn", "paro_nng", "paro_ing", "paro_iig", "paro_ngg", "paro_ggg",
           "paro_ggg+sharded_eval"]
"""Systems by their strategy config; ``+sharded_eval`` evaluates with units gathered one at a time
(``strategy.gather=sharded``) instead of the default, which gathers the whole model when it fits."""
WORLD, GROUP = 4, 2
MODEL = ["model.dim=384", "model.layers=12", "model.heads=6", "model.seq_len=64", "data.batch_size=8"]
"""About 21M parameters (84 MB in fp32) in 12 blocks of 1.8M: each unit holds 8% of the model."""
ACCUMULATION = 2
MiB = 2**20


def run_one(system: str, out: Path) -> dict:
    name, _, variant = system.partition("+")
    group = [f"strategy.group_size={GROUP}"] if name.startswith("paro") or name == "hsdp" else []
    if variant == "sharded_eval":
        group.append("strategy.gather=sharded")
    cmd = [sys.executable, "-m", "lightning_paro", "bench", f"strategy={name}", *group, "trainer=cpu4",
           f"trainer.devices={WORLD}", f"trainer.accumulate_grad_batches={ACCUMULATION}",
           "trainer.enable_progress_bar=false", "bench.warmup_steps=1", "bench.steps=2", "bench.memory=true",
           "bench.eval_batches=2", f"run.dir={out}", *MODEL]
    report = out / "bench.json"
    report.unlink(missing_ok=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    if not report.exists() or "eval_peak_bytes_max_rank" not in (data := json.loads(report.read_text())):
        return {"system": system, "error": (proc.stdout[-1500:] + proc.stderr[-1500:]).strip()}
    return {"system": system, **{k: data[k] for k in (
        "train_peak_bytes_max_rank", "eval_peak_bytes_max_rank", "train_peak_bytes_per_rank",
        "process_start_bytes_per_rank", "model_state_bytes_max_rank", "parameters", "final_loss")}}


FORMULA_OF = {"ddp": "NNN", "fsdp2": "GGG", "hsdp": "III"}
"""The PaRO strategy whose model states a Lightning strategy holds."""


def predicted(system: str) -> dict:
    """The design's model states (any system) and the planner's memory model, states plus transients (PaRO)."""
    from lightning_paro.cli.build import build_model
    from lightning_paro.cli.compose import load_config
    from lightning_paro.planner import GBIT, Cluster, Link, workload_from_module
    from lightning_paro.planner.cost_model import memory
    from lightning_paro.strategy.levels import ShardingSpec

    name = system.partition("+")[0]
    spec = FORMULA_OF.get(name) or name.removeprefix("paro_").upper()
    cfg = load_config(MODEL)
    module = build_model(cfg)
    workload = workload_from_module(module, [module.configure_optimizers()], "auto", ACCUMULATION,
                                    cfg.data["batch_size"] * cfg.model["seq_len"])
    link = Link(bandwidth=GBIT)
    cluster = Cluster(world_size=WORLD, group_size=GROUP, intra=link, inter=link, device_memory=2**40)
    predicted_memory = memory(ShardingSpec.parse(spec), workload, cluster)
    out = {"formula_states_bytes": predicted_memory.model_states}
    if name.startswith("paro_"):
        out["planner_transient_bytes"] = predicted_memory.transient
    return out


def median_row(runs: list[dict]) -> dict:
    """A system's runs as one row: the median of each figure. The memory a rank's model takes is its peak above its
    own resident set at the start of the process (the interpreter and the framework), the largest over the ranks."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    for r in ok:
        r["train_peak_above_start_bytes"] = max(p - s for p, s in zip(r["train_peak_bytes_per_rank"],
                                                                    r["process_start_bytes_per_rank"]))
    row = {"system": ok[0]["system"], "model_state_bytes_max_rank": ok[0]["model_state_bytes_max_rank"],
           "parameters": ok[0]["parameters"], "final_loss": [r["final_loss"] for r in ok], "runs": len(ok)}
    for key in ("train_peak_bytes_max_rank", "train_peak_above_start_bytes", "eval_peak_bytes_max_rank"):
        row[key] = statistics.median(r[key] for r in ok)
        row[key + "_runs"] = [r[key] for r in ok]
    return row


def markdown(rows: list[dict]) -> str:
    lines = ["| system | model states, formula (MiB) | states held (MiB) | planner: states + transients (MiB) |"
             " peak in training above the process's start (MiB) | measured - planner (MiB) |"
             " peak in training (MiB) | peak in evaluation (MiB) | runs |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | error: {r['error'].splitlines()[-1][:80]} ||||||||")
            continue
        planned = r["formula_states_bytes"] + r["planner_transient_bytes"] if "planner_transient_bytes" in r else None
        above = r["train_peak_above_start_bytes"]
        lines.append(
            f"| {r['system']} | {r['formula_states_bytes'] / MiB:.1f} | {r['model_state_bytes_max_rank'] / MiB:.1f}"
            f" | {'' if planned is None else f'{planned / MiB:.1f}'} | {above / MiB:.1f}"
            f" | {'' if planned is None else f'{(above - planned) / MiB:.1f}'}"
            f" | {r['train_peak_bytes_max_rank'] / MiB:.1f} | {r['eval_peak_bytes_max_rank'] / MiB:.1f} | {r['runs']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    systems = args.systems.split(",")
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory(prefix="paro-memory-") as tmp:
        for k in range(args.runs):  # pass by pass: a busy spell of the machine hits every system alike
            for system in systems:
                result = run_one(system, Path(tmp) / system)
                runs[system].append(result)
                print(k, json.dumps({key: result.get(key) for key in (
                    "system", "train_peak_bytes_max_rank", "eval_peak_bytes_max_rank", "error")}), flush=True)
    rows = [{**median_row(runs[s]), **predicted(s)} for s in systems]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "memory.json").write_text(json.dumps({"world_size": WORLD, "group_size": GROUP, "model": MODEL,
                                                     "accumulation": ACCUMULATION, "rows": rows,
                                                     "provenance": stamp()}, indent=2))
    (RESULTS / "memory.md").write_text(markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
