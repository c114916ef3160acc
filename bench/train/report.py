"""Print the training benchmark's results (bench/results/train/*.json) as markdown tables."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "train"


def table(data: dict) -> str:
    rows = [r for r in data["rows"] if "error" not in r]
    ddp = next((r["tokens_per_s"] for r in rows if r["system"] == "ddp"), None)
    fsdp = next((r["tokens_per_s"] for r in rows if r["system"] == "fsdp2"), None)
    out = [f"### {data['nodes']} nodes x {data['ranks_per_node']} ranks, {data['mbit']} Mbit/s per node,"
           f" accumulate_grad_batches={data['accumulation']}", "",
           "| system | tokens/s | vs ddp | vs fsdp2 | inter MB/step/rank | intra MB/step/rank | model states MB/rank |"
           " node0 NIC MiB (whole run) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mem = r.get("memory_bytes_rank0")
        states = sum(mem[k] for k in ("params", "grads", "optim")) / 1e6 if mem else None
        name = r["system"] + (f" (auto: {r['auto_choice']})" if r.get("auto_choice") else "")
        cell = lambda v, f="{:.1f}": f.format(v) if v is not None else "—"  # noqa: E731
        out.append(f"| {name} | {cell(r['tokens_per_s'])} | {cell(r['tokens_per_s'] / ddp if ddp else None, '{:.2f}x')}"
                   f" | {cell(r['tokens_per_s'] / fsdp if fsdp else None, '{:.2f}x')}"
                   f" | {cell(r['inter_bytes_per_step'] / 1e6 if r.get('inter_bytes_per_step') else None)}"
                   f" | {cell(r['intra_bytes_per_step'] / 1e6 if r.get('intra_bytes_per_step') else None)}"
                   f" | {cell(states)} | {cell(r.get('nic_sent_mib_whole_run', {}).get('node0/eth0'))} |")
    failed = [r["system"] for r in data["rows"] if "error" in r]
    if failed:
        out.append(f"\nfailed: {', '.join(failed)}")
    return "\n".join(out)


def main() -> None:
    parts = [table(json.loads(p.read_text())) for p in sorted(RESULTS.glob("*.json"))]
    text = "\n\n".join(parts)
    (RESULTS / "summary.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
