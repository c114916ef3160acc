"""The results tables of README.md and docs/*.md, rendered from the stored results files (bench/results/).

A table in the docs lives between two markers::

    <!-- results:NAME -->
    ...what RENDERERS[NAME] produces from the stored files...
    <!-- /results:NAME -->

and only :func:`update` writes what is between them. ``tests/test_results_tables.py`` checks that every marked block
equals its renderer's output from the files as stored, and that every results file records its provenance (commit,
date, machine: ``bench/provenance.py``).

Adding a renderer (e.g. for the predict benchmark): write a function of no arguments returning markdown from the
files under ``bench/results/`` and register it with ``@renderer("NAME", sources=("predict/*.json",))``
(``from bench.results_tables import renderer``), in this file or in a module listed in ``RENDERER_MODULES`` (e.g.
``"bench.predict.tables"``, imported on first use, so the benchmark's own directory can hold it); then put the two
markers in the doc and run ``python -m bench.regenerate --render-only``. The files a renderer's ``sources`` name are
checked for provenance by the test.

Usage: ``python bench/results_tables.py [--check]`` (``--check``: list the blocks that differ, exit 1 if any).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# one module, whether imported as ``bench.results_tables`` (a renderer module of another area) or as
# ``results_tables`` (with bench/ on the path): the registry must be the same dict
sys.modules.setdefault("results_tables", sys.modules[__name__])
sys.modules.setdefault("bench.results_tables", sys.modules[__name__])

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
"""The files whose marked blocks are rendered."""
RENDERER_MODULES: tuple[str, ...] = ()
"""Modules (importable from the repository root) that register more renderers when imported."""
MiB = 2**20
BLOCK = re.compile(r"(<!-- results:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /results:(?P=name) -->)", re.S)


@dataclass(frozen=True)
class Renderer:
    name: str
    render: Callable[[], str]
    sources: tuple[str, ...]
    """Globs under bench/results/ the table is made from (the provenance test checks them)."""


RENDERERS: dict[str, Renderer] = {}


def renderer(name: str, sources: tuple[str, ...]) -> Callable[[Callable[[], str]], Callable[[], str]]:
    """Register ``fn`` as the renderer of the blocks named ``name``."""

    def register(fn: Callable[[], str]) -> Callable[[], str]:
        if name in RENDERERS and RENDERERS[name].render is not fn:
            raise ValueError(f"two renderers named {name!r}: {RENDERERS[name].render.__qualname__} and"
                             f" {fn.__qualname__}")
        RENDERERS[name] = Renderer(name, fn, sources)
        return fn

    return register


def registry() -> dict[str, Renderer]:
    """Every renderer, those of ``RENDERER_MODULES`` included."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    for module in RENDERER_MODULES:
        importlib.import_module(module)
    return RENDERERS


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _train_modules() -> None:
    for sub in ("train", "auto"):
        p = str(ROOT / "bench" / sub)
        if p not in sys.path:
            sys.path.insert(0, p)
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))


def _commits(datas: list[dict]) -> str:
    """The commits the stored files name, or what they lack."""
    commits = sorted({d["provenance"]["commit"][:7] for d in datas
                      if isinstance(d.get("provenance"), dict) and d["provenance"].get("commit")})
    return ", ".join(commits) if commits else "not recorded"


def _missing(what: str, command: str) -> str:
    return f"*Not measured at this commit: no stored results for {what}. Run `{command}`.*"


# ------------------------------------------------------------------------------------------------ training sweep


@renderer("train-sweep", sources=("train/2x2-*.json", "train/4x2-*.json"))
def train_sweep() -> str:
    _train_modules()
    import report
    from run import SETTINGS

    lines = ["| setting | best PaRO (tokens/s) | its model states MiB/rank | best Lightning strategy within that memory"
             " | PaRO vs it | vs best Lightning strategy, any memory | vs FSDP2 | `auto` chose | chosen's run / best |",
             "|---|---|---|---|---|---|---|---|---|"]
    datas = []
    for name, s in SETTINGS.items():
        path = RESULTS / "train" / f"{name}.json"
        if not path.exists():
            lines.append(f"| {name} | not measured | | | | | | | |")
            continue
        data = _load(path)
        datas.append(data)
        v = report.verdict(data)
        counts = sorted({len(r.get("runs", [r])) for r in data["rows"] if "error" not in r})
        runs = f"median of {counts[0]}" if len(counts) == 1 else f"medians of {counts[0]}-{counts[-1]}"
        label = (f"{s.nodes}x{s.per_node}, {s.mbit if s.mbit < 1000 else s.mbit // 1000}"
                 f" {'Mbit/s' if s.mbit < 1000 else 'Gbit/s'}, A={s.accumulation}"
                 f"{', PEFT' if s.trainable_blocks is not None else ''} ({runs})")
        fit = v.best_fitting_baseline
        lines.append(
            f"| {label} | {v.best_paro[5:].upper()} ({v.best_paro_tps:.0f}) | {v.budget_bytes / MiB:.1f}"
            f" | {(fit.upper() if fit == 'hsdp' else 'FSDP2' if fit == 'fsdp2' else fit) or 'none fits'}"
            f" | {report._cell(v.vs_fitting_baseline, '{:.2f}x')}"
            f" | {v.vs_best_baseline:.2f}x ({'HSDP' if v.best_baseline == 'hsdp' else v.best_baseline})"
            f" | {report._cell(v.vs_fsdp2, '{:.2f}x')} | {v.auto_choice or '—'}"
            f" | {report._cell(v.choice_vs_best, '{:.2f}')} |")
    loss = max((report.verdict(d).max_loss_diff for d in datas), default=math.nan)
    lines += ["", f"Largest spread of the final loss across the systems of a setting: {loss:.1e}. Stored files:"
                  f" `bench/results/train/<setting>.json`; measured at commits: {_commits(datas)}."]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ memory


@renderer("train-memory", sources=("train/memory.json",))
def train_memory() -> str:
    path = RESULTS / "train" / "memory.json"
    if not path.exists():
        return _missing("peak memory", "python -m bench.regenerate --only memory")
    data = _load(path)
    names = {"ddp": "Lightning `ddp`", "fsdp2": "FSDP2 full shard", "hsdp": "FSDP2 HSDP",
             "paro_ggg+sharded_eval": 'PaRO GGG, `gather="sharded"`'}
    lines = ["| system | model states (formula) | planner: states + transients | peak in training"
             " | of which above the process's start | peak in evaluation | runs |", "|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        if "error" in r:
            lines.append(f"| {r['system']} | failed | | | | | |")
            continue
        planned = (r["formula_states_bytes"] + r["planner_transient_bytes"]) / MiB if "planner_transient_bytes" in r \
            else None
        name = names.get(r["system"], f"PaRO {r['system'][5:].upper()}" if r["system"].startswith("paro_")
                         else r["system"])
        lines.append(f"| {name} | {r['formula_states_bytes'] / MiB:.1f} | {'' if planned is None else f'{planned:.1f}'}"
                     f" | {r['train_peak_bytes_max_rank'] / MiB:.1f} | {r['train_peak_above_start_bytes'] / MiB:.1f}"
                     f" | {r['eval_peak_bytes_max_rank'] / MiB:.1f} | {r['runs']} |")
    lines += ["", f"MiB, largest rank, medians of the runs; {data['world_size']} processes in groups of"
                  f" {data['group_size']}, `accumulate_grad_batches={data['accumulation']}`, model"
                  f" `{' '.join(data['model'])}`. Measured at commit: {_commits([data])}."]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ collectives

SCENARIO_WORDS = {"node": "one per node", "rank": "one per rank"}


@renderer("collectives-targets", sources=("collectives/targets/*.json",))
def collectives_targets() -> str:
    files = sorted((RESULTS / "collectives" / "targets").glob("*.json"))
    if not files:
        return _missing("the collectives' targets", "python -m bench.regenerate --only collectives")
    by: dict[str, list[dict]] = {}
    for p in files:
        d = _load(p)
        by.setdefault(d["scenario"]["name"], []).append(d)
    lines = ["| nodes x ranks, NIC, placement | flat | hierarchical, no overlap | HO-Ring | HO-Ring vs flat"
             " | vs no overlap | of link limit | launches |", "|---|---|---|---|---|---|---|---|"]
    datas = []
    for name, runs in by.items():
        datas += runs
        sc = runs[0]["scenario"]
        times: dict[str, list[float]] = {}
        ratios: dict[str, list[float]] = {"flat": [], "hier": [], "fraction": []}
        for d in runs:
            rows = {r["impl"]: r for r in d["rows"] if r["collective"] == "all_reduce" and r["size_mib"] == 64.0}
            if not {"flat", "hier", "ho-ring"} <= set(rows):
                continue
            for k, r in rows.items():
                times.setdefault(k, []).append(r["time_s"])
            ratios["flat"].append(rows["flat"]["time_s"] / rows["ho-ring"]["time_s"])
            ratios["hier"].append(rows["hier"]["time_s"] / rows["ho-ring"]["time_s"])
            ratios["fraction"].append(rows["ho-ring"]["link_fraction"])
        if not ratios["flat"]:
            continue
        med = {k: statistics.median(v) for k, v in times.items()}
        rat = {k: statistics.median(v) for k, v in ratios.items()}
        lines.append(f"| {sc['nodes']} x {sc['ranks_per_node']}, {SCENARIO_WORDS[sc['nic']]}, {sc['placement']}"
                     f" | {med['flat']:.3f} s | {med['hier']:.3f} s | {med['ho-ring']:.3f} s"
                     f" | {rat['flat']:.2f}x | {rat['hier']:.2f}x | {rat['fraction']:.2f} | {len(runs)} |")
    lines += ["", "64 MiB fp32 all-reduce at 1 Gbit/s; times: the median over the launches of each launch's median;"
                  " ratios and fractions: the median over the launches of each launch's own. Machine: {datas[0].get('machine', 'not recorded')}; measured"
                  f" {', '.join(sorted({d.get('measured_at', '?')[:10] for d in datas}))}, commit: {_commits(datas)}."]
    return "\n".join(lines)


def _f(v: float | None, fmt: str = "{:.3f}") -> str:
    return "" if v is None else fmt.format(v)


@renderer("collectives-targets-runs", sources=("collectives/targets/*.json",))
def collectives_targets_runs() -> str:
    files = sorted((RESULTS / "collectives" / "targets").glob("*.json"))
    if not files:
        return _missing("the collectives' targets", "python -m bench.regenerate --only collectives")
    lines = ["| scenario (64 MiB fp32 all-reduce) | run | flat s | hier s | HO-Ring s | HO-Ring vs flat | HO-Ring vs hier"
             " | HO-Ring fraction of link limit | cores busy (HO-Ring) |", "|---|---|---|---|---|---|---|---|---|"]
    by: dict[str, list[tuple[str, dict]]] = {}
    datas = []
    for p in files:
        d = _load(p)
        datas.append(d)
        rows = {r["impl"]: r for r in d["rows"] if r["collective"] == "all_reduce" and r["size_mib"] == 64.0}
        by.setdefault(d["scenario"]["name"], []).append((p.stem.rsplit("-run", 1)[-1], rows))
    for name, runs in by.items():
        cols: list[list[float]] = [[] for _ in range(7)]
        for run, r in runs:
            if not {"flat", "hier", "ho-ring"} <= set(r):
                continue
            vals = [r["flat"]["time_s"], r["hier"]["time_s"], r["ho-ring"]["time_s"],
                    r["flat"]["time_s"] / r["ho-ring"]["time_s"], r["hier"]["time_s"] / r["ho-ring"]["time_s"],
                    r["ho-ring"]["link_fraction"], r["ho-ring"].get("cores_busy")]
            for c, v in zip(cols, vals):
                c.append(v)
            lines.append(f"| {name} | {run} | {vals[0]:.3f} | {vals[1]:.3f} | {vals[2]:.3f} | {vals[3]:.2f}x"
                         f" | {vals[4]:.2f}x | {vals[5]:.2f} | {_f(vals[6], '{:.2f}')} |")
        med = [statistics.median([v for v in c if v is not None]) if any(v is not None for v in c) else None
               for c in cols]
        if med[0] is not None:
            lines.append(f"| **{name}** | median | {med[0]:.3f} | {med[1]:.3f} | {med[2]:.3f} | **{med[3]:.2f}x**"
                         f" | **{med[4]:.2f}x** | {med[5]:.2f} | {_f(med[6], '{:.2f}')} |")
    lines += ["", f"Measured at commit: {_commits(datas)}."]
    return "\n".join(lines)


@renderer("collectives-all", sources=("collectives/*.json",))
def collectives_all() -> str:
    files = sorted((RESULTS / "collectives").glob("*.json"))
    if not files:
        return _missing("the collectives", "python -m bench.regenerate --only collectives")
    lines = ["| scenario | collective | MiB | flat s | hier s | HO-Ring s | comm-global s | HO-Ring vs flat"
             " | HO-Ring vs hier | HO-Ring fraction of link limit | busiest NIC MiB flat / HO-Ring"
             " | cores busy flat / HO-Ring |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    datas = []
    for p in files:
        d = _load(p)
        datas.append(d)
        rows: dict[tuple[str, float], dict[str, dict]] = {}
        for r in d["rows"]:
            rows.setdefault((r["collective"], r["size_mib"]), {})[r["impl"]] = r
        for (collective, size), by in rows.items():
            flat, hier, ho, comm = (by.get(k) for k in ("flat", "hier", "ho-ring", "comm-global"))
            if not (flat and ho):
                continue
            t = lambda r: _f(r["time_s"]) if r else ""  # noqa: E731
            lines.append(
                f"| {d['scenario']['name']} | {collective} | {size:g} | {t(flat)} | {t(hier)} | {t(ho)} | {t(comm)}"
                f" | {flat['time_s'] / ho['time_s']:.2f}x | {_f(hier and hier['time_s'] / ho['time_s'], '{:.2f}x')}"
                f" | {ho['link_fraction']:.2f} | {flat['busiest_nic_MiB']:.1f} / {ho['busiest_nic_MiB']:.1f}"
                f" | {_f(flat.get('cores_busy'), '{:.2f}')} / {_f(ho.get('cores_busy'), '{:.2f}')} |")
    lines += ["", f"Measured at commit: {_commits(datas)}."]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ compression


@renderer("compression", sources=("train/compression/*.json",))
def compression() -> str:
    _train_modules()
    from run import COMPRESSION_SETTINGS, POWERSGD_WARMUP, PRECISION

    files = [RESULTS / "train" / "compression" / f"{n}.json" for n in COMPRESSION_SETTINGS]
    if not any(p.exists() for p in files):
        return _missing("PaRO's communication options beside the anchors'",
                        "python -m bench.regenerate --only compression")
    out = []
    datas = []
    for name, p in zip(COMPRESSION_SETTINGS, files):
        if not p.exists():
            out.append(f"**{name}**: not measured.\n")
            continue
        data = _load(p)
        datas.append(data)
        rows = {r["system"]: r for r in data["rows"] if "error" not in r}
        out += [f"**{name}** ({data['nodes']} nodes x {data['ranks_per_node']} ranks, {data['mbit']} Mbit/s per node,"
                f" A = {data['accumulation']}, {POWERSGD_WARMUP} warm-up and {data['timed_steps']} timed steps)", "",
                "| precision | system | tokens/s | vs the best anchor of its precision | between groups MB/step"
                " (NIC, all nodes) | final loss | runs |", "|---|---|---|---|---|---|---|"]
        for precision, systems in PRECISION.items():
            anchors = [rows[s]["tokens_per_s"] for s in systems if s in rows and not s.startswith("paro")]
            best_anchor = max(anchors) if anchors else None
            for s in systems:
                r = rows.get(s)
                if r is None:
                    failed = any(x["system"] == s for x in data["rows"])
                    out.append(f"| {precision} | {s} | {'failed' if failed else 'not run'} | | | | |")
                    continue
                nic = r.get("nic_inter_bytes_per_step")
                ratio = f"{r['tokens_per_s'] / best_anchor:.2f}x" if best_anchor else ""
                out.append(f"| {precision} | {s} | {r['tokens_per_s']:.1f} | {ratio}"
                           f" | {'' if nic is None else f'{nic / 1e6:.2f}'} | {r['final_loss']:.4f}"
                           f" | {len(r.get('runs', [r]))} |")
        out.append("")
    out.append(f"Measured at commits: {_commits(datas)}.")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ accuracy


@renderer("accuracy", sources=("train/accuracy.json",))
def accuracy() -> str:
    path = RESULTS / "train" / "accuracy.json"
    if not path.exists():
        return _missing("accuracy across seeds", "python -m bench.regenerate --only accuracy")
    data = _load(path)
    s = data["settings"]
    fmt = lambda v, f="{:.4f}": "" if v is None else f.format(v)  # noqa: E731
    micro = s.get("accumulation", 1)
    per_step = f"{s['batch_size']} sequences per rank per step" if micro == 1 else \
        f"{s['batch_size']} sequences per rank per micro-batch, {micro} micro-batches per step"
    lines = [f"{s['parameters_label']}, {s['steps']} optimizer steps, held-out loss every {s['every']} steps,"
             f" {s['devices']} processes in groups of {s['group_size']}, {per_step}. Final held-out loss (nats per"
             " byte): mean and seed-to-seed standard deviation; the paired difference to fp32 (same seed), its mean, standard deviation and standard error.", "",
             "| option | seeds | final held-out loss | sd | minus fp32: mean | sd | standard error |",
             "|---|---|---|---|---|---|---|"]
    for option, r in data["summary"].items():
        lines.append(f"| {option} | {len(r['seeds'])} | {fmt(r['final_mean'])} | {fmt(r['final_sd'])}"
                     f" | {fmt(r.get('diff_mean'), '{:+.4f}')} | {fmt(r.get('diff_sd'))} | {fmt(r.get('diff_se'))} |")
    _train_modules()
    import accuracy as grid

    options = s.get("options") or data["summary"]
    total = len(options) * grid.SEEDS
    stored = sum(min(len(data["summary"].get(o, {}).get("seeds", [])), grid.SEEDS) for o in options)
    if stored < total:
        lines += ["", f"Incomplete: {stored} of the registered grid's {total} runs ({len(options)} options x"
                  f" {grid.SEEDS} seeds) are stored. The figures are of those runs only; a row of one seed has no"
                  " spread, and no claim rests on this table until the grid is complete."]
    lines += ["", f"Measured at commit: {_commits([data])}. Curves: `bench/results/train/accuracy.png`."]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ auto


@renderer("auto-choice", sources=("train/choice/*.json", "train/run/*.json"))
def auto_choice() -> str:
    _train_modules()
    import auto_report

    text, _ = auto_report.report()
    datas = [_load(p) for p in (RESULTS / "train" / "choice").glob("*-*.json")]
    return text + f"\n\nMeasured at commits: {_commits(datas)}."


@renderer("auto-paper-scale", sources=("auto/paper_scale.json",))
def auto_paper_scale() -> str:
    path = RESULTS / "auto" / "paper_scale.json"
    if not path.exists():
        return _missing("the paper-scale predictions", "python -m bench.regenerate --only auto")
    data = _load(path)
    rows = data["rows"] if isinstance(data, dict) else data
    _train_modules()
    from paper_scale import paper_scale_markdown

    out = [paper_scale_markdown(rows)]
    out.append(f"Predicted (no run) at commit: {_commits([data] if isinstance(data, dict) else [])}.")
    return "\n".join(out)


@renderer("auto-preregistered", sources=("auto/preregistered/*.json",))
def auto_preregistered() -> str:
    _train_modules()
    import prereg

    return prereg.table()


# ------------------------------------------------------------------------------------------------ files


def render(name: str) -> str:
    reg = registry()
    if name not in reg:
        raise KeyError(f"no renderer {name!r}: the renderers are {', '.join(sorted(reg))}")
    return reg[name].render().rstrip("\n") + "\n"


def blocks(text: str) -> list[tuple[str, str]]:
    """(name, body) of every marked block of ``text``."""
    return [(m.group("name"), m.group("body")) for m in BLOCK.finditer(text)]


def rendered(text: str, cache: dict[str, str] | None = None) -> str:
    """``text`` with every marked block's body replaced by its renderer's output."""
    cache = {} if cache is None else cache

    def sub(m: re.Match) -> str:
        name = m.group("name")
        if name not in cache:
            cache[name] = render(name)
        return m.group(1) + cache[name] + m.group(4)

    return BLOCK.sub(sub, text)


def update(paths: tuple[Path, ...] = DOCS) -> list[Path]:
    """Render every marked block of ``paths`` in place; returns the files changed."""
    cache: dict[str, str] = {}
    changed = []
    for p in paths:
        old = p.read_text()
        new = rendered(old, cache)
        if new != old:
            p.write_text(new)
            changed.append(p)
    return changed


def stale(paths: tuple[Path, ...] = DOCS) -> list[tuple[Path, str]]:
    """(file, block name) of every marked block that differs from its renderer's output."""
    cache: dict[str, str] = {}
    out = []
    for p in paths:
        for name, body in blocks(p.read_text()):
            if name not in cache:
                cache[name] = render(name)
            if body != cache[name]:
                out.append((p, name))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only list the blocks that differ from their renderer's")
    args = ap.parse_args()
    if args.check:
        bad = stale()
        for p, name in bad:
            print(f"{p.relative_to(ROOT)}: block {name} differs from what bench/results renders", file=sys.stderr)
        sys.exit(1 if bad else 0)
    for p in update():
        print("rendered", p.relative_to(ROOT))


if __name__ == "__main__":
    main()
