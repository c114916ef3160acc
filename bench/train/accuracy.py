"""Accuracy of the lossy communication options across seeds: held-out loss curves of the benchmark GPT on the demo's
corpus (the standard library's source files as bytes, ``lightning_paro.demo.StdlibData``).

Options (``OPTIONS``): fp32 (PaRO NIG, exact), PaRO NIG with bf16 communication, int8 between groups, int8 with error
feedback, bf16 + int8, and the anchors' own compression: DDP with a bf16 hook and DDP with PowerSGD (rank 4, error
feedback, warm start, ``start_powerSGD_iter`` 10% of the run as torch suggests). Each option trains ``--seeds`` seeds
(``run.seed``: the same initial weights and data order for every option of a seed) for ``--steps`` optimizer steps on
4 CPU processes (2 groups of 2), validating on the held-out files every ``--every`` steps (Lightning's validation
loop: each strategy evaluates its own way).

Reported per option (``bench/results/train/accuracy.json``, plot ``accuracy.png``): every curve, the final held-out
loss's mean and seed-to-seed standard deviation, and the same for the paired difference to fp32 (option minus fp32,
seed by seed), with the standard error of that mean difference. A rerun skips (option, seed) pairs already stored with
the same settings (``--redo`` reruns them).

Usage (root or not; no emulated network): ``python bench/train/accuracy.py [--seeds 3] [--steps 1000] [--every 100]
[--options fp32,bf16,...] [--out bench/results/train/accuracy.json]``. A check at small size:
``--seeds 2 --steps 20 --every 10 --model tiny --out /tmp/accuracy.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import MODEL, ROOT, VARIANTS  # noqa: E402  (puts bench/ on the path too)
from provenance import stamp  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "train"
OPTIONS: dict[str, tuple[str, str]] = {
    # name: (strategy or anchor, communication variant)
    "fp32": ("paro_nig", ""),
    "bf16": ("paro_nig", "bf16"),
    "int8": ("paro_nig", "int8"),
    "int8+ef": ("paro_nig", "int8ef"),
    "bf16+int8": ("paro_nig", "bf16+int8"),
    "ddp_bf16hook": ("ddp_bf16hook", ""),
    "ddp_powersgd": ("ddp_powersgd", ""),
}
"""The options compared; ``fp32`` is the reference of the paired differences."""
REFERENCE = "fp32"
SEEDS = 3
"""Seeds per option of the registered grid (``--seeds``' default)."""
TINY = ["model.dim=32", "model.layers=2", "model.heads=2", "model.seq_len=32"]
"""``--model tiny``: a GPT of about 30k parameters, for checking the harness."""
DEVICES, GROUP = 4, 2
"""4 processes as 2 groups of 2: int8 compresses the traffic between the groups."""
BATCH_SIZE = 4
"""Sequences per micro-step per rank, chosen before the grid's first run and not changed after it: 16 windows of 64
bytes per optimizer step (with ``ACCUMULATION``), so 1,000 steps read the 600 kB training text about 1.7 times
(batch 8 would read it 3.4 times, and a 10.7M-parameter model then mostly memorizes)."""
ACCUMULATION = 1
"""Micro-batches per optimizer step, set on every run because the trainer config's default is 2. With accumulation,
an epoch of an odd number of micro-batches ends on a half window that Lightning steps anyway, and validation (counted
in micro-batches) then falls one step later for each epoch: off the grid of ``--every`` and past the last step."""


def command(option: str, seed: int, steps: int, every: int, out: Path, model: list[str], batch_size: int,
            val_batches: int) -> list[str]:
    system, variant = OPTIONS[option]
    anchor = system if system.startswith("ddp_") else "none"
    strategy = ["strategy=ddp"] if anchor != "none" else [f"strategy={system}", f"strategy.group_size={GROUP}"]
    return [sys.executable, str(ROOT / "bench" / "train" / "anchors.py"), "--anchor", anchor, "--curve", str(every),
            "--curve-batches", str(val_batches), "--", *strategy, *VARIANTS[variant], "trainer.accelerator=cpu",
            f"trainer.devices={DEVICES}", f"trainer.accumulate_grad_batches={ACCUMULATION}",
            "trainer.enable_progress_bar=false", "bench.warmup_steps=0",
            f"bench.steps={steps}", f"run.seed={seed}", f"run.dir={out}", f"data.batch_size={batch_size}", *model]


def curve_problem(held_out: list, steps: int, every: int) -> Optional[str]:
    """Why a run's held-out curve cannot be stored (its evaluations are not at every ``every``-th optimizer step up to
    the last), or None."""
    got = [int(step) for step, _ in held_out]
    want = list(range(every, steps + 1, every))
    if got == want:
        return None
    return (f"held-out loss evaluated at steps {got}, not at {want}: the curve is off the grid, so its final value is"
            " not the last step's")


def summarise(runs: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """Per option: final held-out loss mean and seed-to-seed sd; paired difference to fp32 (mean, sd, standard
    error, the seeds it is over)."""
    out = {}
    ref = runs.get(REFERENCE, {})
    for option, seeds in runs.items():
        finals = {s: r["held_out"][-1][1] for s, r in seeds.items() if r.get("held_out")}
        values = list(finals.values())
        row: dict = {"seeds": sorted(finals), "final_mean": statistics.fmean(values) if values else None,
                     "final_sd": statistics.stdev(values) if len(values) > 1 else None}
        paired = [finals[s] - ref[s]["held_out"][-1][1] for s in finals if s in ref and ref[s].get("held_out")]
        if option != REFERENCE and paired:
            sd = statistics.stdev(paired) if len(paired) > 1 else None
            row.update(diff_mean=statistics.fmean(paired), diff_sd=sd, diff_n=len(paired),
                       diff_se=sd / math.sqrt(len(paired)) if sd is not None else None)
        out[option] = row
    return out


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (option, seeds) in enumerate(data["runs"].items()):
        for j, (seed, run) in enumerate(sorted(seeds.items())):
            steps, losses = zip(*run["held_out"]) if run.get("held_out") else ((), ())
            ax.plot(steps, losses, color=colors[i % len(colors)], alpha=0.8, label=option if j == 0 else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out loss (nats per byte)")
    s = data["settings"]
    ax.set_title(f"{len(data['summary'].get(REFERENCE, {}).get('seeds', []))} seeds, {s['steps']} steps,"
                 f" {s['parameters_label']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=SEEDS)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--options", default=",".join(OPTIONS))
    ap.add_argument("--model", choices=("bench", "tiny"), default="bench",
                    help="bench: the training benchmark's GPT (10.7M parameters); tiny: a check of the harness")
    ap.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="sequences per micro-step per rank")
    ap.add_argument("--val-batches", type=int, default=24, help="held-out batches of 16 windows per rank per check")
    ap.add_argument("--timeout", type=int, default=6 * 3600, help="seconds one run may take")
    ap.add_argument("--out", type=Path, default=RESULTS / "accuracy.json")
    ap.add_argument("--redo", action="store_true")
    args = ap.parse_args(argv)
    options = args.options.split(",")
    unknown = [o for o in options if o not in OPTIONS]
    if unknown:
        sys.exit(f"no option {unknown}: the options are {', '.join(OPTIONS)}")
    if args.steps % args.every:
        sys.exit(f"--every {args.every} must divide --steps {args.steps} (the last step is evaluated)")
    model = [m for m in MODEL if not m.startswith("data.")] if args.model == "bench" else TINY
    settings = {"steps": args.steps, "every": args.every, "model": model, "batch_size": args.batch_size,
                "accumulation": ACCUMULATION,
                "val_batches": args.val_batches, "devices": DEVICES, "group_size": GROUP,
                "parameters_label": "bench GPT (10.7M parameters)" if args.model == "bench" else "tiny GPT",
                "data": "lightning_paro.demo.StdlibData defaults (600 kB train, 100 kB held out)",
                "options": {o: list(OPTIONS[o]) for o in OPTIONS}}
    settings = json.loads(json.dumps(settings))  # as stored (tuples become lists), so a rerun finds its runs
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    if data.get("settings") != settings:
        data = {"settings": settings, "runs": {}}  # runs of other settings never join these
    runs: dict[str, dict[str, dict]] = data["runs"]
    work = Path("/tmp") / "paro-accuracy"
    for seed in range(args.seeds):  # seed by seed, so that a cut-short run still has complete pairs
        for option in options:
            if str(seed) in runs.get(option, {}) and not args.redo:
                continue
            out = work / f"{option.replace('+', '-')}-s{seed}"
            curve = out / "curve.json"
            curve.unlink(missing_ok=True)
            cmd = command(option, seed, args.steps, args.every, out, model, args.batch_size, args.val_batches)
            started = time.perf_counter()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=args.timeout)
                failed = proc.returncode != 0 or not curve.exists()
                tail = (proc.stdout + proc.stderr)[-2000:]
            except subprocess.TimeoutExpired:
                failed, tail = True, f"no result after {args.timeout} s"
            if failed:
                print(f"{option} seed {seed} failed:\n{tail}", file=sys.stderr, flush=True)
                continue
            result = json.loads(curve.read_text())
            problem = curve_problem(result["held_out"], args.steps, args.every)
            if problem:
                print(f"{option} seed {seed} not stored: {problem}", file=sys.stderr, flush=True)
                continue
            result["wall_s"] = round(time.perf_counter() - started, 1)
            # the grid spans sessions: each run records the code it ran, the file the latest
            result["provenance"] = data["provenance"] = stamp()
            runs.setdefault(option, {})[str(seed)] = result
            data["summary"] = summarise(runs)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(data, indent=2))
            print(option, "seed", seed, "final held-out loss", result["held_out"][-1][1], flush=True)
    if runs:
        plot(data, args.out.with_suffix(".png"))
        print(json.dumps(data["summary"], indent=2))


if __name__ == "__main__":
    main()
