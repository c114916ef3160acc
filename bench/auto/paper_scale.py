"""The ``sharding="auto"`` planner's predictions at the PaRO paper's scale: LLaMA-7B on 32 GPUs, LLaMA-65B on 64 and
128, 8 per node, NVLink inside, 100/200/400 Gbit/s per node between nodes. Prints the tables (markdown); ``--json`` and
``--plot`` also write the rows and a figure (matplotlib) to bench/results/auto/.

Usage: ``python bench/auto/paper_scale.py [--json bench/results/auto/paper_scale.json]
[--plot bench/results/auto/paper_scale.png]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from lightning_paro.planner import GB, Cluster, Compute, Link, Plan, Workload, fastest_chunk_bytes, plan
from lightning_paro.strategy.levels import KNOWN_AS, VALID_STRATEGIES


@dataclass(frozen=True)
class PaperModel:
    """A LLaMA model shape, for the paper-scale tables."""

    name: str
    """Display name."""
    num_params: float
    """Psi."""
    layers: int
    """Transformer blocks: the units."""
    hidden: int
    """Hidden size."""
    vocab: int = 32000
    """Vocabulary size (untied input embedding and output head form the root unit)."""

    @property
    def root_fraction(self) -> float:
        """Share of the parameters in the embedding, the head and the final norm."""
        return (2 * self.vocab * self.hidden + self.hidden) / self.num_params

    def activation_bytes_per_token(self) -> float:
        """bf16 activations with full activation checkpointing: every block's input (2 h bytes per block) plus one
        block's recomputed activations (about 34 h bytes, flash attention: no s^2 term)."""
        return 2 * self.hidden * self.layers + 34 * self.hidden


LLAMA_7B = PaperModel("LLaMA-7B", 6.74e9, 32, 4096)
LLAMA_65B = PaperModel("LLaMA-65B", 65.2e9, 80, 8192)
PAPER_SETTINGS = ((LLAMA_7B, 32), (LLAMA_65B, 64), (LLAMA_65B, 128))
"""(model, GPUs) of the paper's large-scale runs; 8 GPUs per node."""
PAPER_INTER_NODE_GBPS = (100, 200, 400)
"""Network bandwidth per node, shared by its 8 GPUs."""
PAPER_DEVICE = dict(device_memory=80 * GB, intra=Link.gbit(2400, 10), flops_per_second=125e12,
                    memory_bandwidth=2.0e12, memory_budget=0.9)
"""A100-80GB: NVLink 300 GB/s per direction, 125 TFLOP/s achieved (40% of bf16 peak), 2 TB/s memory; declared
activations, so 90% of the memory may be planned."""


def paper_scale_plan(model: PaperModel, gpus: int, inter_node_gbps: float, accumulation: int = 4,
                     tokens_per_micro_batch: int = 2048, gpus_per_node: int = 8) -> Plan:
    """The plan for one of the paper's settings: bf16 Adam (K = 12), one 2048-token sequence per micro-step."""
    workload = Workload(model.num_params, model.num_params, accumulation=accumulation, num_units=model.layers,
                        root_fraction=model.root_fraction, tokens_per_micro_batch=tokens_per_micro_batch,
                        param_bytes=2, grad_bytes=2, optim_bytes=12,
                        activation_bytes_per_token=model.activation_bytes_per_token())
    inter = Link.gbit(inter_node_gbps / gpus_per_node, 20)  # all 8 GPUs of a node cross its network at once
    cluster = Cluster(gpus, gpus_per_node, PAPER_DEVICE["intra"], inter, PAPER_DEVICE["device_memory"])
    cluster = dataclasses.replace(cluster, chunk_bytes=fastest_chunk_bytes(workload, cluster))
    compute = Compute(flops_per_second=PAPER_DEVICE["flops_per_second"],
                      memory_bandwidth=PAPER_DEVICE["memory_bandwidth"])
    return plan(workload, cluster, compute, PAPER_DEVICE["memory_budget"])


def paper_scale_rows(inter_node_gbps: tuple[float, ...] = PAPER_INTER_NODE_GBPS) -> list[dict]:
    """One row per (setting, strategy): model-state and total GB per rank, whether it fits, and predicted tokens/s
    per GPU at each network bandwidth (keys ``tokens_per_s@<gbps>``, ``chosen@<gbps>``)."""
    rows = []
    for model, gpus in PAPER_SETTINGS:
        plans = {bw: paper_scale_plan(model, gpus, bw) for bw in inter_node_gbps}
        for strategy in VALID_STRATEGIES:
            first = plans[inter_node_gbps[0]].candidate(strategy)
            row = {"setting": f"{model.name} on {gpus} GPUs", "strategy": strategy,
                   "states_gb": first.prediction.memory.model_states / GB,
                   "total_gb": first.prediction.memory.total / GB, "fits": first.fits}
            for bw, p in plans.items():
                c = p.candidate(strategy)
                row[f"tokens_per_s@{bw:g}"] = c.prediction.tokens_per_second
                row[f"chosen@{bw:g}"] = p.choice == strategy
            rows.append(row)
    return rows


def paper_scale_markdown(rows: list[dict]) -> str:
    """The paper-scale tables as markdown: one per setting, the chosen strategy in bold at each bandwidth (the one
    rendering of them: bench/results_tables.py renders the stored rows with it)."""
    bws = sorted({float(k.split("@")[1]) for r in rows for k in r if k.startswith("tokens_per_s@")})
    out = []
    for setting in dict.fromkeys(r["setting"] for r in rows):
        out.append(f"**{setting}** (8 per node; predicted tokens/s per GPU at the given network bandwidth per node)\n")
        head = ["strategy", "known as", "model states GB", "total GB", "fits"] + [f"{bw:g} Gbit/s" for bw in bws]
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in (r for r in rows if r["setting"] == setting):
            cells = [r["strategy"], KNOWN_AS.get(r["strategy"], ""), f"{r['states_gb']:.1f}", f"{r['total_gb']:.1f}",
                     "yes" if r["fits"] else "no"]
            for bw in bws:
                text = f"{r[f'tokens_per_s@{bw:g}']:,.0f}"
                cells.append(f"**{text}**" if r[f"chosen@{bw:g}"] else text)
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def plot_paper_scale(path: str, inter_node_gbps: tuple[float, ...] = PAPER_INTER_NODE_GBPS) -> None:
    """Save a figure of the paper-scale predictions: tokens/s per GPU (top) and memory per GPU (bottom) per strategy,
    one column per setting; strategies that do not fit are drawn faded. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as err:
        raise SystemExit("error: --plot needs matplotlib (pip install matplotlib).") from err
    rows = paper_scale_rows(inter_node_gbps)
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    fig, axes = plt.subplots(2, len(settings), figsize=(6 * len(settings), 7), squeeze=False)
    width = 0.8 / len(inter_node_gbps)
    for col, setting in enumerate(settings):
        mine = [r for r in rows if r["setting"] == setting]
        x = range(len(mine))
        top, bottom = axes[0][col], axes[1][col]
        for k, bw in enumerate(inter_node_gbps):
            for i, r in enumerate(mine):
                top.bar(i + (k - (len(inter_node_gbps) - 1) / 2) * width, r[f"tokens_per_s@{bw:g}"], width,
                        color=f"C{k}", alpha=1.0 if r["fits"] else 0.25)
        bottom.bar(x, [r["total_gb"] for r in mine], color=["C3" if not r["fits"] else "C7" for r in mine])
        bottom.axhline(PAPER_DEVICE["memory_budget"] * PAPER_DEVICE["device_memory"] / GB, color="k", ls="--", lw=1,
                       label="memory budget")
        bottom.set_yscale("log")
        for ax in (top, bottom):
            ax.set_xticks(list(x), [r["strategy"] for r in mine], rotation=90)
        top.set_title(setting)
        top.set_ylabel("predicted tokens/s per GPU")
        bottom.set_ylabel("predicted memory per GPU (GB)")
        handles = [Patch(color=f"C{k}", label=f"{bw:g} Gbit/s per node") for k, bw in enumerate(inter_node_gbps)]
        top.legend(handles=handles + [Patch(color="C0", alpha=0.25, label="does not fit")], fontsize=8)
        bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--plot", default=None, help="also save a figure to this file (matplotlib)")
    args = ap.parse_args()
    print(paper_scale_markdown(paper_scale_rows()))
    if args.json:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from provenance import stamp

        Path(args.json).write_text(json.dumps({"rows": paper_scale_rows(), "provenance": stamp()}, indent=1) + "\n")
    if args.plot:
        plot_paper_scale(args.plot)


if __name__ == "__main__":
    main()
