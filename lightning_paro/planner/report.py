"""The plan as text: the candidate table (aligned or markdown), one-line link and cluster descriptions for the log,
and the plan as plain data for a run's outputs (:func:`plan_record`). It reads the plan (``choose.py``); the planning
never reads it back (byte counts as text: ``sizes.py``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from lightning_paro.planner.choose import Plan
from lightning_paro.planner.inputs import Cluster, Link
from lightning_paro.planner.sizes import format_bytes
from lightning_paro.strategy.levels import KNOWN_AS


def format_plan(result: Plan, markdown: bool = False) -> str:
    """The candidate table and the choice, as aligned text or as a markdown table."""
    head = ["strategy", "known as", "step s", "tokens/s/rank", "exposed comm s", "intra/step", "inter/step",
            "model states", "in flight", "total", "fits", "why"]
    body = []
    for c in result.candidates:
        p = c.prediction
        exposed = p.terms.total - p.terms.compute - p.terms.update
        body.append([p.strategy, KNOWN_AS.get(p.strategy, ""), f"{p.step_seconds:.4g}",
                     f"{p.tokens_per_second:,.0f}" if p.tokens_per_step else "-", f"{exposed:.4g}",
                     format_bytes(p.traffic.intra), format_bytes(p.traffic.inter),
                     format_bytes(p.memory.model_states), format_bytes(p.memory.transient + p.memory.activations),
                     format_bytes(p.memory.total), "yes" if c.fits else "no", c.why])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in body]
    else:
        widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [head, *body]]
    w, c = result.workload, result.cluster
    comm = "".join(f", {what} in {str(d).removeprefix('torch.')}" for what, d in
                   (("parameters gathered", w.comm.params), ("gradients reduced", w.comm.grads),
                    ("hops between groups quantized", w.comm.inter_quant)) if d is not None)
    header = (f"Psi {w.num_params:.4g} (trainable {w.num_trainable:.4g}){comm}, A={w.accumulation}, {w.num_units}"
              f" units, {describe_cluster(c)}; budget {format_bytes(result.budget_bytes)} of"
              f" {format_bytes(c.device_memory)} per rank")
    figures = "".join(f"\n- {note}" for note in result.notes)
    if figures:
        figures = "\nfigures:" + figures
    return (header + figures + "\n\n" + "\n".join(lines)
            + f"\n\nchoice: {result.choice or 'none'}. {result.reason}")


def describe_links(intra: Link, inter: Link) -> str:
    """One line for the log: measured or configured link figures."""
    def one(link: Link) -> str:
        if math.isinf(link.bandwidth):
            return "unused"
        hidden = "" if link.overlap == 1 else f", {link.overlap:.0%} hidden behind compute"
        return f"{link.bandwidth * 8 / 1e9:.3g} Gbit/s, {link.latency * 1e6:.3g} us per step{hidden}"
    return f"intra {one(intra)}; inter {one(inter)}"


def describe_cluster(cluster: Cluster) -> str:
    """One line for the log: ranks, links, the reduce-scatter factor, the HO-Ring factor and chunk."""
    return (f"n={cluster.world_size} ranks in groups of m={cluster.group_size}; "
            f"{describe_links(cluster.intra, cluster.inter)}; reduce-scatter {cluster.reduce_scatter_factor:.2f}x"
            f" an all-gather; HO-Ring phases {cluster.hierarchical_factor:.2f}x the links' time, chunks of"
            f" {cluster.chunk_bytes / 2**20:.4g} MiB")


def plan_record(result: Plan) -> dict[str, Any]:
    """The plan as plain data (JSON-ready but for dtypes, which ``json.dumps(..., default=str)`` writes by name): the
    choice and its reason, the budget, where each figure came from (``notes``), every figure the cost model used
    (``workload``, ``cluster``, ``compute``) and every candidate's prediction (step time term by term, memory in
    all and by part, traffic)."""
    return {
        "choice": result.choice, "reason": result.reason, "budget_bytes": result.budget_bytes,
        "notes": list(result.notes), "workload": dataclasses.asdict(result.workload),
        "cluster": dataclasses.asdict(result.cluster), "compute": dataclasses.asdict(result.compute),
        "candidates": [{"strategy": c.strategy, "fits": c.fits, "why": c.why,
                        "step_seconds": c.prediction.step_seconds, "memory_bytes": c.prediction.memory.total,
                        "terms": dataclasses.asdict(c.prediction.terms),
                        "memory": dataclasses.asdict(c.prediction.memory),
                        "traffic": dataclasses.asdict(c.prediction.traffic)} for c in result.candidates],
    }
