"""Communication dtypes and the quantized hop between groups on the emulated cluster: tokens/s and bytes per step.

The training benchmark's model and settings (``run.py``: the 10.7M-parameter GPT, 2 nodes of 2 ranks at 100 Mbit/s,
accumulation 4 by default), each system once per pass, passes in a row (so a busy spell of the machine hits every
system alike), the row of a system its run of median tokens/s. A system is a strategy of ``run.py`` and a variant of
its communication (``VARIANTS``). Results: ``bench/results/train/comm_<setting>.json`` and ``.md``.

Usage (root): ``python bench/train/comm.py [--setting 2x2-100m-a4] [--passes 3] [--systems ddp,paro_iig,...]``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import RESULTS, SETTINGS, VARIANTS, run_one, with_run  # noqa: E402  (puts bench/ on the path too)
from provenance import stamp  # noqa: E402
SYSTEMS = ["ddp", "paro_nig", "paro_iig", "paro_iig~bf16", "paro_iig~int8", "paro_iig~bf16+int8",
           "paro_nig~bf16+int8"]


def table(rows: list[dict]) -> str:
    """Markdown: tokens/s (median and every run), bytes per optimizer step and the final loss, per system."""
    ddp = next((r["tokens_per_s"] for r in rows if r["system"] == "ddp"), None)
    out = ["| system | tokens/s (median) | runs | vs ddp | intra MiB/step | inter MiB/step | final loss |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['system']} | error | | | | | |")
            continue
        runs = ", ".join(f"{x['tokens_per_s']:.1f}" for x in r["runs"])
        ratio = f"{r['tokens_per_s'] / ddp:.2f}x" if ddp else ""
        intra, inter = (r.get(k) for k in ("intra_bytes_per_step", "inter_bytes_per_step"))
        mib = lambda b: f"{b / 2**20:.2f}" if b is not None else ""  # noqa: E731
        loss = f"{r['final_loss']:.4f}" if r.get("final_loss") is not None else ""
        out.append(f"| {r['system']} | {r['tokens_per_s']:.1f} | {runs} | {ratio} | {mib(intra)} | {mib(inter)} |"
                   f" {loss} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setting", default="2x2-100m-a4", choices=sorted(SETTINGS))
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    args = ap.parse_args()
    s = SETTINGS[args.setting]
    systems = args.systems.split(",")
    rows: dict[str, dict] = {}
    path = RESULTS / f"comm_{args.setting}.json"
    for _ in range(args.passes):
        for system in systems:
            base, _, variant = system.partition("~")
            run_dir = Path("/tmp") / "paro-comm-bench" / args.setting / system.replace("~", "-").replace("+", "-")
            row = run_one(base, s, run_dir, VARIANTS[variant])
            row["system"] = system
            print(json.dumps({k: row.get(k) for k in ("system", "tokens_per_s", "inter_bytes_per_step", "final_loss",
                                                      "error")}), flush=True)
            if "error" in row:  # kept only while the system has no run that worked
                rows.setdefault(system, row)
                continue
            rows[system] = with_run(rows.get(system) if "error" not in rows.get(system, {}) else None, row)
            ordered = [rows[k] for k in systems if k in rows]
            path.write_text(json.dumps({"setting": args.setting, "nodes": s.nodes, "ranks_per_node": s.per_node,
                                        "mbit": s.mbit, "accumulation": s.accumulation, "rows": ordered,
                                        "provenance": stamp()}, indent=2))
    path.with_suffix(".md").write_text(table([rows[k] for k in systems]) + "\n")


if __name__ == "__main__":
    main()
