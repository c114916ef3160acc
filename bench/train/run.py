"""Training benchmark on the emulated cluster: PaRO strategies against Lightning's DDP, FSDP2 and HSDP.

Every system trains the same GPT (about 10.7M parameters) for ``bench.warmup_steps + bench.steps`` optimizer steps
through the package's own ``bench`` command, each rank in its node's network namespace (``bench/cluster.py``), and
reports tokens/s over the timed steps, the bytes each rank sent per optimizer step (PaRO's accounting) and the bytes
that crossed each node's NIC (the NIC counters). Results go to ``bench/results/train/``.

Usage (root): ``python bench/train/run.py [--settings 2x2-1g-a1,2x2-1g-a4] [--systems ddp,fsdp2,paro_iig,...]``
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "train"
SYSTEMS = ["ddp", "fsdp2", "hsdp", "paro_nng", "paro_nig", "paro_nii", "paro_iii", "paro_iig", "paro_igg", "paro_ggg",
           "paro"]
SETTINGS = {  # name: (nodes, ranks per node, Mbit/s, accumulation)
    "2x2-1g-a1": (2, 2, 1000, 1),
    "2x2-1g-a4": (2, 2, 1000, 4),
}
MODEL = ["model.dim=384", "model.layers=6", "model.heads=6", "model.seq_len=64", "data.batch_size=1"]


def run_one(system: str, nodes: int, per_node: int, mbit: int, acc: int, out: Path) -> dict:
    strategy = [f"strategy={system}"] if system != "paro" else ["strategy=paro", "strategy.sharding=auto"]
    if system.startswith("paro"):
        strategy.append(f"strategy.group_size={per_node}")
    cmd = [sys.executable, str(ROOT / "bench" / "cluster.py"), "--nodes", str(nodes), "--ranks-per-node",
           str(per_node), "--rate-mbit", str(mbit), "--nic", "node", "--timeout", "900", "--",
           "-m", "lightning_paro", "bench", *strategy, "trainer.accelerator=cpu", f"trainer.devices={per_node}",
           f"trainer.num_nodes={nodes}", f"trainer.accumulate_grad_batches={acc}", "trainer.enable_progress_bar=false",
           "bench.warmup_steps=1", "bench.steps=3", f"run.dir={out}", *MODEL]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        return {"system": system, "error": proc.stdout[-1500:] + proc.stderr[-1500:], "wall_s": wall}
    result = json.loads((out / "bench.json").read_text())
    nic = {m.group(1): float(m.group(2)) for m in re.finditer(r"(node\d+/eth\d+): sent ([\d.]+) MiB",
                                                                 proc.stdout + proc.stderr)}
    chosen = re.search(r"sharding='auto' chose (\w+)", proc.stdout + proc.stderr)
    return {"system": system, **result, "nic_sent_mib_whole_run": nic, "wall_s": round(wall, 1),
            "auto_choice": chosen.group(1) if chosen else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    for setting in args.settings.split(","):
        nodes, per_node, mbit, acc = SETTINGS[setting]
        rows = []
        for system in args.systems.split(","):
            row = run_one(system, nodes, per_node, mbit, acc, Path("/tmp") / "paro-train-bench" / setting / system)
            rows.append(row)
            print(json.dumps({k: row.get(k) for k in ("system", "tokens_per_s", "inter_bytes_per_step", "error",
                                                     "auto_choice")}), flush=True)
        (RESULTS / f"{setting}.json").write_text(json.dumps({"setting": setting, "nodes": nodes,
                                                             "ranks_per_node": per_node, "mbit": mbit,
                                                             "accumulation": acc, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
