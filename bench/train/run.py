"""Training benchmark on the emulated cluster: PaRO strategies against Lightning's DDP, FSDP2 and HSDP.

Every system trains the same GPT (about 10.7M parameters; all of them, or in the PEFT-like settings only the last
block) for ``bench.warmup_steps + bench.steps`` optimizer steps
through the package's own ``bench`` command, each rank in its node's network namespace (``bench/cluster.py``), and
reports tokens/s over the timed steps, the bytes each rank sent per optimizer step (PaRO's accounting) and the bytes
that crossed each node's NIC (the NIC counters). Results go to ``bench/results/train/``.

Results are written after every system, and a rerun skips systems that already have one (``--redo`` reruns).
``--more N`` adds N runs of every listed system to the ones it has, pass by pass over the systems (so a busy spell of
the machine hits every system alike); a system's row is then its run of median tokens/s, and ``runs`` holds them all.

``--set run`` runs auto against the choice set's best fixed strategy over runs of about 40 s (``RUN_SETTINGS``),
with results in ``bench/results/train/run/``; each setting's first run of auto starts with an empty link cache (its
own: ``LINK_CACHE``), later ones find what it stored, and where runs are added to stored ones and the cache is gone, an
uncounted run of auto stores the links first.

``--set compression`` runs PaRO's communication options beside the anchors' own (``COMPRESSION_SETTINGS``: 2x2 and
4x2, 100 Mbit/s and 1 Gbit/s, A = 1 and 4; ``COMPRESSION_SYSTEMS``), every system through ``anchors.py``'s worker so
that each row's bytes between groups per step are the NIC counters over its timed steps, and with 2 warm-up steps
for every system (PowerSGD all-reduces plainly for its first 2); results in ``bench/results/train/compression/``.

``--set choice`` runs the settings ``sharding="auto"`` is scored on (``CHOICE_SETTINGS``: auto beside the strategies
that contend there) and the re-planning check, with results in ``bench/results/train/choice/``; ``--fresh`` drops
the listed systems' stored runs before ``--more`` adds new ones.

Usage (root): ``python bench/train/run.py [--set sweep|choice|run|compression] [--settings 2x2-100m-a4,...]
[--systems ddp,fsdp2,paro_iig,...] [--redo] [--fresh] [--more N]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from anchors import ANCHORS  # noqa: E402
from provenance import stamp  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "train"
PARO = ["paro_" + s.lower() for s in ("NNN", "NNI", "NNG", "NIG", "NGG", "INI", "ING", "IIG", "IGG", "GNG", "GIG",
                                      "GGG", "NII", "III")]
SYSTEMS = ["ddp", "fsdp2", "hsdp", *PARO, "paro", *ANCHORS]
"""The anchors (``anchors.py``: DDP with a bf16 or PowerSGD hook, FSDP2/HSDP with a bf16 mixed-precision policy) are
run by the ``compression`` set; a system ``NAME~VARIANT`` is a PaRO strategy with a communication variant
(``VARIANTS``). ``paro`` is ``sharding="auto"`` with its defaults (its link cache on: a later run on the same emulated cluster
reuses the links an earlier one probed, once checked). Also runnable by name: ``paro@NGG`` (auto started on
NGG)."""


@dataclass(frozen=True)
class Setting:
    """One benchmark setting: the emulated cluster and how the model is trained."""

    nodes: int
    """Nodes (network namespaces)."""
    per_node: int
    """Ranks per node (the PaRO group size and the HSDP shard group)."""
    mbit: int
    """Rate of each node's NIC, each direction."""
    accumulation: int
    """accumulate_grad_batches."""
    trainable_blocks: Optional[int] = None
    """None: full training; k: only the last k of the 6 blocks train (PEFT-like)."""
    timed_steps: int = 2
    """Optimizer steps timed, after one warm-up step."""
    memory_budget: Optional[float] = None
    """Bytes per rank ``sharding="auto"`` may plan with (``strategy.memory_budget``); the fixed strategies that fit
    it are those the setting compares auto with. None: the default share of memory (every strategy fits here)."""
    contenders: Optional[tuple[str, ...]] = None
    """The systems run by default (all of ``SYSTEMS`` when None): under a budget, the fitting strategies whose
    earlier runs came within 1.6x of the fastest fitting one, and auto."""


SETTINGS = {
    "2x2-1g-a1": Setting(2, 2, 1000, 1, timed_steps=8),
    "2x2-1g-a4": Setting(2, 2, 1000, 4, timed_steps=6),
    "2x2-100m-a1": Setting(2, 2, 100, 1),
    "2x2-100m-a4": Setting(2, 2, 100, 4),
    "4x2-100m-a1": Setting(4, 2, 100, 1),
    "4x2-100m-a4": Setting(4, 2, 100, 4),
    "2x2-100m-a4-peft": Setting(2, 2, 100, 4, trainable_blocks=1),
    "4x2-100m-a4-peft": Setting(4, 2, 100, 4, trainable_blocks=1),
}
"""The sweep: every system in each setting (``bench/results/train/<setting>.json``; ``report.py``'s tables)."""

VARIANTS: dict[str, tuple[str, ...]] = {
    "": (),
    "bf16": ("strategy.param_dtype=bf16", "strategy.reduce_dtype=bf16"),
    "int8": ("strategy.inter_quant=int8",),
    "int8ef": ("strategy.inter_quant=int8", "strategy.error_feedback=true"),
    "bf16+int8": ("strategy.param_dtype=bf16", "strategy.reduce_dtype=bf16", "strategy.inter_quant=int8"),
}
"""The strategy options each communication variant sets (after ``~`` in a system's name)."""

COMPRESSION_SETTINGS = {
    **{name: SETTINGS[name] for name in ("2x2-100m-a1", "2x2-100m-a4", "2x2-1g-a1", "2x2-1g-a4", "4x2-100m-a1",
                                         "4x2-100m-a4")},
    "4x2-1g-a1": Setting(4, 2, 1000, 1, timed_steps=6),
    "4x2-1g-a4": Setting(4, 2, 1000, 4, timed_steps=4),
}
"""Point 1's grid: 2x2 and 4x2, 100 Mbit/s and 1 Gbit/s, A = 1 and 4 (results in ``bench/results/train/compression/``)."""
PRECISION = {
    "fp32": ("ddp", "fsdp2", "hsdp", "paro_nng", "paro_nig", "paro_iig"),
    "bf16": ("ddp_bf16hook", "fsdp2_bf16", "hsdp_bf16", "paro_nng~bf16", "paro_nig~bf16", "paro_iig~bf16"),
    "lossy (low-rank or int8 between groups)": ("ddp_powersgd", "paro_nig~int8", "paro_nig~int8ef",
                                                "paro_nig~bf16+int8", "paro_iig~bf16+int8"),
}
"""The compression table's blocks: each PaRO option beside the anchors of the same precision."""
COMPRESSION_SYSTEMS = [system for block in PRECISION.values() for system in block]
POWERSGD_WARMUP = 2
"""Warm-up steps of every run of the compression set (and of PowerSGD anywhere): PowerSGD all-reduces plainly for
its first 2 steps, and the same warm-up for every row keeps their steps, data and final losses alike."""
COMPRESSION_RESULTS = RESULTS / "compression"

SWEEP_CONTENDERS = {
    "2x2-1g-a1": ("paro_nng", "paro_ngg", "paro_nig"),
    "2x2-1g-a4": ("paro_nng", "paro_nnn", "paro_nni"),
    "2x2-100m-a1": ("paro_ngg", "paro_nng", "paro_nig"),
    "2x2-100m-a4": ("paro_nng", "paro_nnn"),
    "4x2-100m-a1": ("paro_ngg", "paro_nng"),
    "4x2-100m-a4": ("paro_nng", "paro_nni"),
    "2x2-100m-a4-peft": ("paro_nng", "paro_nnn"),
    "4x2-100m-a4-peft": ("paro_nnn", "paro_nng"),
}
"""Per sweep setting, its two or three fastest fixed strategies in the sweep (within 13% of the fastest)."""

CHOICE_SETTINGS = {
    # The planner's criterion (``auto_report.py``; results in bench/results/train/choice/): auto beside the sweep's
    # contenders (memory-bound: every fitting strategy within 1.6x of the fastest fitting one). At least 5 timed
    # steps, so that auto's re-plan after its 4th step (the default) falls inside the timed window with its cost.
    **{name: dataclasses.replace(SETTINGS[name], timed_steps=max(5, SETTINGS[name].timed_steps),
                                 contenders=(*contenders, "paro"))
       for name, contenders in SWEEP_CONTENDERS.items()},
    # Memory-bound: a budget under which NNN, NNG and NIG (and more) do not fit.
    "2x2-100m-a4-m106": Setting(2, 2, 100, 4, timed_steps=5, memory_budget=106e6,
                                contenders=("paro_iig", "paro_ngg", "paro_igg", "paro")),
    "2x2-100m-a4-m96": Setting(2, 2, 100, 4, timed_steps=5, memory_budget=96e6,
                               contenders=("paro_igg", "paro_gig", "paro_ggg", "paro")),
    "4x2-100m-a4-m96": Setting(4, 2, 100, 4, timed_steps=5, memory_budget=96e6,
                               contenders=("paro_iig", "paro_ngg", "paro_igg", "paro")),
    "2x2-100m-a8-m106": Setting(2, 2, 100, 8, timed_steps=5, memory_budget=106e6,
                                contenders=("paro_iig", "paro_ngg", "paro_igg", "paro")),
}
"""The settings ``sharding="auto"`` is scored on (``choice.py``'s criterion): 12, four of them memory-bound."""
REPLAN_SETTINGS = {
    # auto forced to start on NGG (fits, 0.55x IIG's speed here): its re-plan after step 4 must move it to the best.
    "2x2-100m-a4-m106-replan": Setting(2, 2, 100, 4, timed_steps=12, memory_budget=106e6,
                                       contenders=("paro_iig", "paro@NGG", "paro")),
    # the same over a run of 64 steps: the 3 timed steps on NGG before the switch cost about 2.5 steps of IIG, which
    # a run must be about 50 steps long to bring within 5%
    "2x2-100m-a4-m106-replan-64": Setting(2, 2, 100, 4, timed_steps=64, memory_budget=106e6,
                                          contenders=("paro_iig", "paro@NGG")),
}
"""Settings of the re-planning check, apart from the planner's criterion (a longer run, a forced first plan);
results beside the criterion's."""
CHOICE_RESULTS = RESULTS / "choice"

RUN_STEPS = {"2x2-1g-a1": 67, "2x2-1g-a4": 38, "2x2-100m-a1": 10, "2x2-100m-a4": 9, "4x2-100m-a1": 7,
             "4x2-100m-a4": 6, "2x2-100m-a4-peft": 42, "4x2-100m-a4-peft": 25, "2x2-100m-a4-m106": 7,
             "2x2-100m-a4-m96": 5, "4x2-100m-a4-m96": 5, "2x2-100m-a8-m106": 5}
"""Timed steps per setting of the run set: about 40 s of training at the step times of the choice set (at least 5,
so the re-plan after step 4 falls inside)."""
RUN_SETTINGS = {
    # auto against the best fixed strategy of the choice set (bench/results/train/choice/auto.md) over runs of about
    # 40 s, auto's probe, plan and switches paid: the first run of each setting starts with an empty link cache (the
    # whole probe, as a first job on these hosts), the later ones reuse what it stored
    name: dataclasses.replace(CHOICE_SETTINGS[name], timed_steps=RUN_STEPS[name], contenders=(best, "paro"))
    for name, best in {
        "2x2-1g-a1": "paro_ngg", "2x2-1g-a4": "paro_nng", "2x2-100m-a1": "paro_ngg", "2x2-100m-a4": "paro_nng",
        "4x2-100m-a1": "paro_ngg", "4x2-100m-a4": "paro_nng", "2x2-100m-a4-peft": "paro_nng",
        "4x2-100m-a4-peft": "paro_nng", "2x2-100m-a4-m106": "paro_iig", "2x2-100m-a4-m96": "paro_igg",
        "4x2-100m-a4-m96": "paro_iig", "2x2-100m-a8-m106": "paro_iig"}.items()}
"""The run set: ``sharding="auto"`` over runs of about 40 s against the choice set's best fixed strategy, with its
start-up paid (``auto_report.py``'s second table)."""
RUN_RESULTS = RESULTS / "run"
WORK = Path("/tmp") / "paro-train-bench"
"""Where the runs write (a folder per set, setting and system) and the link caches live."""
LINK_CACHE = WORK / "link-cache"
"""The benchmark's link caches (``LIGHTNING_PARO_CACHE_DIR`` of its runs), one folder per setting: settings on the same
emulated hosts differ in link rate, which a job's cache key cannot see (a real cluster's links keep their rate)."""
MODEL = ["model.dim=384", "model.layers=6", "model.heads=6", "model.seq_len=64", "data.batch_size=1"]
"""About 10.7M parameters: at 100 Mbit/s one full fp32 gradient all-reduce takes seconds, far above compute."""
TINY = ["model.dim=32", "model.layers=2", "model.heads=2", "model.seq_len=32", "data.batch_size=1"]
"""``--tiny``: a GPT of about 30k parameters, for checking the harness."""


def command(system: str, s: Setting, out: Path, extra: tuple[str, ...] = (), worker: bool = False,
            timeout: int = 1200, memory_limit: int = 0, warmup: Optional[int] = None) -> list[str]:
    """The command line of one run of ``system`` in setting ``s`` (see :func:`run_one`)."""
    system, _, variant = system.partition("~")
    if variant not in VARIANTS:
        raise SystemExit(f"no communication variant {variant!r}: the variants are {', '.join(v for v in VARIANTS if v)}")
    extra = (*VARIANTS[variant], *extra)
    if warmup is None:
        # torch's PowerSGD all-reduces plainly before start_powerSGD_iter (2 here): its timed steps must compress
        warmup = POWERSGD_WARMUP if system == "ddp_powersgd" else 1
    if warmup < POWERSGD_WARMUP and system == "ddp_powersgd":
        raise SystemExit(f"ddp_powersgd needs {POWERSGD_WARMUP} warm-up steps (plain all-reduce before them)")
    if system in ANCHORS:
        worker = True
        strategy = ["strategy=" + ("ddp" if system.startswith("ddp") else "fsdp2")]
    elif system.split("@")[0] == "paro":  # paro@NGG: auto started on NGG (AutoConfig.first_plan)
        strategy = ["strategy=paro", "strategy.sharding=auto"]
        if "@" in system:
            strategy.append(f"strategy.first_plan={system.split('@')[1]}")
        if s.memory_budget is not None:
            strategy.append(f"strategy.memory_budget={s.memory_budget:.0f}")
    else:
        strategy = [f"strategy={system}"]
    if system.startswith("paro"):
        strategy.append(f"strategy.group_size={s.per_node}")
    peft = [f"model.trainable_blocks={s.trainable_blocks}"] if s.trainable_blocks is not None else []
    if memory_limit:
        worker = True
    entry = ([str(ROOT / "bench" / "train" / "anchors.py"), "--anchor", system if system in ANCHORS else "none",
              *(["--memory-limit", str(memory_limit)] if memory_limit else []), "--"]
             if worker else ["-m", "lightning_paro", "bench"])
    return [sys.executable, str(ROOT / "bench" / "cluster.py"), "--nodes", str(s.nodes), "--ranks-per-node",
            str(s.per_node), "--rate-mbit", str(s.mbit), "--nic", "node", "--timeout", str(timeout), "--",
            *entry, *strategy, "trainer.accelerator=cpu", f"trainer.devices={s.per_node}",
            f"trainer.num_nodes={s.nodes}", f"trainer.accumulate_grad_batches={s.accumulation}",
            "trainer.enable_progress_bar=false", f"bench.warmup_steps={warmup}", f"bench.steps={s.timed_steps}",
            f"run.dir={out}", *MODEL, *peft, *extra]


def run_one(system: str, s: Setting, out: Path, extra: tuple[str, ...] = (), cwd: Path = ROOT, worker: bool = False,
            model: Optional[list[str]] = None, timeout: int = 1200, memory_limit: int = 0,
            warmup: Optional[int] = None) -> dict:
    """One run of ``system`` in setting ``s``; ``extra``: more overrides (e.g. the strategy's communication dtypes);
    ``cwd``: the tree whose package runs (``python -m`` finds the working directory's first); ``worker``: through
    ``anchors.py``'s worker (anchors always are), which adds the NIC bytes of the timed steps; ``model``: overrides
    in place of ``MODEL`` (a tiny model for tests); ``memory_limit``: bytes a rank's resident set may grow above its
    start (``anchors.py``'s enforced limit; a run that crosses it returns ``memory_limit_exceeded``)."""
    cmd = command(system, s, out, extra, worker, timeout, memory_limit, warmup)
    if model is not None:
        first = cmd.index(MODEL[0])
        cmd[first:first + len(MODEL)] = model
    report = out / "bench.json"
    report.unlink(missing_ok=True)  # a report left by an earlier run must not pass for this one's
    for left in out.glob("memory_limit_exceeded_rank*.json"):
        left.unlink()
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=timeout + 120)
    except subprocess.TimeoutExpired as exc:  # cluster.py's own timeout should have ended it: its output, if any
        return {"system": system, "error": f"no report after {timeout + 120} s: {str(exc.stdout or '')[-1500:]}",
                "wall_s": time.perf_counter() - started}
    wall = time.perf_counter() - started
    exceeded = sorted(out.glob("memory_limit_exceeded_rank*.json"))
    if exceeded:
        return {"system": system, "error": "memory limit exceeded", "wall_s": round(wall, 1),
                "memory_limit_exceeded": json.loads(exceeded[0].read_text())}
    if not report.exists():
        return {"system": system, "error": proc.stdout[-1500:] + proc.stderr[-1500:], "wall_s": wall}
    result = json.loads(report.read_text())
    if proc.returncode != 0:  # trained and reported, then failed while exiting (seen: gloo aborting FSDP2's teardown)
        result["exit_error"] = f"exit status {proc.returncode} after the report: {proc.stdout[-300:]}"
    nic = {m.group(1): float(m.group(2)) for m in re.finditer(r"(node\d+/eth\d+): sent ([\d.]+) MiB",
                                                                 proc.stdout + proc.stderr)}
    return {"system": system, **result, "nic_sent_mib_whole_run": nic, "wall_s": round(wall, 1),
            "auto_choice": result.get("auto", {}).get("choice")}


def with_run(old: Optional[dict], new: dict) -> dict:
    """``new`` added to the runs ``old`` holds (a row without ``runs`` is one run): the run of median tokens/s (the
    upper one of an even count), with every run in ``runs``."""
    runs = [*(old.get("runs", [old]) if old else []), new]
    runs = [r for r in runs if "error" not in r] or [new]
    median = sorted(runs, key=lambda r: r["tokens_per_s"] or 0.0)[len(runs) // 2]
    return {**{k: v for k, v in median.items() if k != "runs"}, "runs": [{k: v for k, v in r.items() if k != "runs"}
                                                                         for r in runs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", choices=("sweep", "choice", "run", "compression"), default="sweep",
                    help="sweep: every system (results/train/); choice: auto's criterion and the re-planning check"
                         " (results/train/choice/); run: auto over longer runs, start-up paid (results/train/run/);"
                         " compression: PaRO's options beside the anchors' (results/train/compression/)")
    ap.add_argument("--settings", default=None, help="default: every setting of the set")
    ap.add_argument("--systems", default=None, help="default: the setting's contenders, else every system")
    ap.add_argument("--redo", action="store_true", help="rerun the listed systems even where they have a result (others are kept)")
    ap.add_argument("--fresh", action="store_true",
                    help="drop the listed systems' stored runs first (runs of older code must not join a median)")
    ap.add_argument("--more", type=int, default=0, metavar="N",
                    help="add N runs of each listed system, pass by pass; rows become the median run")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny GPT and 2 timed steps, to check the harness (needs --out outside bench/results)")
    ap.add_argument("--out", type=Path, default=None, help="results folder (default: the set's own)")
    args = ap.parse_args()
    settings, results = {"sweep": (SETTINGS, RESULTS), "choice": ({**CHOICE_SETTINGS, **REPLAN_SETTINGS}, CHOICE_RESULTS),
                         "run": (RUN_SETTINGS, RUN_RESULTS),
                         "compression": (COMPRESSION_SETTINGS, COMPRESSION_RESULTS)}[args.set]
    if args.tiny and (args.out is None or RESULTS in args.out.resolve().parents or args.out.resolve() == RESULTS):
        sys.exit("--tiny checks the harness: give --out a folder outside bench/results")
    results = args.out or results
    results.mkdir(parents=True, exist_ok=True)
    for name in (args.settings.split(",") if args.settings else list(settings)):
        if name not in settings:
            sys.exit(f"no setting {name!r} in the {args.set} set; it has: {', '.join(settings)}")
        s = settings[name]
        path = results / f"{name}.json"
        old = json.loads(path.read_text()) if path.exists() else {}
        rows = {r["system"]: r for r in old.get("rows", []) if "error" not in r}
        default = COMPRESSION_SYSTEMS if args.set == "compression" else list(s.contenders or SYSTEMS[:-len(ANCHORS)])
        listed = args.systems.split(",") if args.systems else default
        if args.fresh:
            rows = {k: v for k, v in rows.items() if k not in listed}
        work, cache = WORK / args.set / name, LINK_CACHE / name
        os.environ["LIGHTNING_PARO_CACHE_DIR"] = str(cache)  # auto's link cache: the benchmark's own, not the user's
        if args.set == "run" and "paro" in listed:
            if "paro" not in rows:  # this setting's first run of auto probes; the later ones find its links stored
                shutil.rmtree(cache, ignore_errors=True)
            elif not any(cache.glob("*.json")):
                # runs added to stored ones (--more without --fresh) are later jobs on these hosts: the first run,
                # stored, paid the whole probe; a job of auto, not counted, stores the links it would have left
                primed = run_one("paro", s, work / "prime")
                print(name, "link cache primed by an uncounted run of auto:", primed.get("error") or "stored",
                      flush=True)
        for system in listed * max(1, args.more):  # --more: pass after pass over the systems
            if system in rows and not (args.redo or args.more):
                continue
            row = run_one(system, dataclasses.replace(s, timed_steps=2) if args.tiny else s,
                          work / system.replace("~", "-").replace("+", "-"), worker=args.set == "compression",
                          model=TINY if args.tiny else None,
                          warmup=POWERSGD_WARMUP if args.set == "compression" else None)
            rows[system] = with_run(rows.get(system), row) if args.more else row
            print(name, json.dumps({k: row.get(k) for k in ("system", "tokens_per_s", "final_loss", "error",
                                                           "auto_choice")}), flush=True)
            order = COMPRESSION_SYSTEMS if args.set == "compression" else SYSTEMS
            ordered = [rows[k] for k in order if k in rows] + [rows[k] for k in rows if k not in order]
            path.write_text(json.dumps({"setting": name, "nodes": s.nodes, "ranks_per_node": s.per_node,
                                        "mbit": s.mbit, "accumulation": s.accumulation,
                                        "trainable_blocks": s.trainable_blocks, "memory_budget": s.memory_budget,
                                        "timed_steps": s.timed_steps, "rows": ordered, "provenance": stamp()},
                                       indent=2))


if __name__ == "__main__":
    main()
