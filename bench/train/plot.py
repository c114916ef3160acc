"""Plot the training benchmark (bench/results/train/*.json): tokens/s of every system per setting, and per-rank
model-state memory against tokens/s. Needs matplotlib (``pip install -e .[bench]``).

Writes bench/results/train/throughput.png and memory.png, and cost_model.png (predicted against measured step time,
from cost_model.json, when ``validate.py`` has written it).
"""

from __future__ import annotations

import json
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from report import BASELINES, RESULTS, is_paro, title  # noqa: E402

COLORS = {"baseline": "#7f7f7f", "paro": "#1f77b4", "auto": "#ff7f0e"}


def kind(system: str) -> str:
    return "baseline" if system in BASELINES else "paro" if is_paro(system) else "auto"


def label(row: dict) -> str:
    s = row["system"]
    if s == "paro":
        return f"auto ({row.get('auto_choice')})"
    return s[5:].upper() if is_paro(s) else s


def settings() -> list[tuple[str, dict]]:
    out = []
    for p in sorted(RESULTS.glob("*.json")):
        data = json.loads(p.read_text())
        if any("error" not in r for r in data.get("rows", [])):
            out.append((p.stem, data))
    return out


def grid(count: int) -> tuple:
    cols = 2 if count > 1 else 1
    rows = math.ceil(count / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[count:]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def throughput(named: list[tuple[str, dict]]) -> None:
    fig, axes = grid(len(named))
    for ax, (name, data) in zip(axes, named):
        rows = [r for r in data["rows"] if "error" not in r]
        ax.barh(range(len(rows)), [r["tokens_per_s"] for r in rows], color=[COLORS[kind(r["system"])] for r in rows])
        ax.set_yticks(range(len(rows)), [label(r) for r in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("tokens/s (higher is better)")
        ax.set_title(title(data), fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / "throughput.png", dpi=110)


def memory(named: list[tuple[str, dict]]) -> None:
    fig, axes = grid(len(named))
    for ax, (name, data) in zip(axes, named):
        for r in (r for r in data["rows"] if "error" not in r):
            x, y = r["model_state_bytes_max_rank"] / 2**20, r["tokens_per_s"]
            ax.scatter(x, y, color=COLORS[kind(r["system"])], s=18)
            ax.annotate(label(r), (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
        ax.set_xlabel("model states per rank, MiB (lower is better)")
        ax.set_ylabel("tokens/s")
        ax.set_title(title(data), fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / "memory.png", dpi=110)


def cost_model() -> bool:
    path = RESULTS / "cost_model.json"
    if not path.exists():
        return False
    results = json.loads(path.read_text())["settings"]
    fig, ax = plt.subplots(figsize=(6.5, 6))
    top = 0.0
    for r in results:
        xs = [r["measured_s"][s] for s in r["measured_s"]]
        ys = [r["predicted_s"][s] for s in r["measured_s"]]
        ax.scatter(xs, ys, s=16, label=r["setting"])
        top = max(top, *xs, *ys)
    line = [0.5, top * 1.2]
    ax.plot(line, line, color="black", lw=0.8)
    for f in (0.75, 1.25):
        ax.plot(line, [v * f for v in line], color="gray", lw=0.6, ls="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured seconds per optimizer step")
    ax.set_ylabel("predicted seconds per optimizer step")
    ax.set_title("Cost model against the benchmark (dashed: +-25%)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(RESULTS / "cost_model.png", dpi=110)
    return True


def main() -> None:
    named = settings()
    throughput(named)
    memory(named)
    extra = " and cost_model.png" if cost_model() else ""
    print(f"wrote throughput.png, memory.png{extra} in {RESULTS}")


if __name__ == "__main__":
    main()
