"""Collective benchmark on the emulated cluster: flat vs hierarchical (no overlap) vs HO-Ring.

For each scenario (nodes x ranks per node, link rate, NIC model, rank placement) this starts the cluster of
``bench/cluster.py``, runs this file as every rank, and measures all-reduce, reduce-scatter and all-gather of
1-256 MiB fp32 buffers with:

* ``flat``: the torch.distributed collective over the world (gloo),
* ``hier``: HO-Ring with a single chunk, so its phases run one after another (hierarchical, no overlap),
* ``ho-ring``: HO-Ring with its default configuration (chunked, phases overlapped),
* ``comm-global``: the ``Communicator``'s global collective, issued through its communication thread (contiguous
  placement only, since its topology assumes it).

Reported per case: median time over the repetitions (each the slowest rank's), algorithm bandwidth ``S / t``, bus
bandwidth (nccl-tests convention: all-reduce ``algbw * 2(n-1)/n``, the others ``algbw * (n-1)/n``), the fraction of the
link limit (the time the hierarchical byte volume needs on the busiest NIC at the set rate, over the measured time),
and the bytes the busiest emulated NIC really sent. Results go to ``bench/results/collectives/``: one JSON file per
scenario, ``summary.md`` and ``collectives.png``.

Run as root: ``python bench/collectives.py`` (all scenarios) or ``--scenario 2x2-node-contiguous-1g --sizes 64``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "collectives"
MiB = 1024 * 1024


@dataclass(frozen=True)
class Scenario:
    """One emulated cluster to benchmark on."""

    name: str
    """Short label used in file names and tables."""
    nodes: int
    """g: nodes."""
    ranks_per_node: int
    """m: ranks per node."""
    rate_mbit: int
    """NIC rate, each direction."""
    nic: str
    """``node`` (one NIC per node) or ``rank`` (one per rank)."""
    placement: str
    """``contiguous`` or ``round-robin``."""
    sizes_mib: tuple[int, ...]
    """Buffer sizes to run."""


SCENARIOS = {s.name: s for s in [
    Scenario("2x2-node-contiguous-1g", 2, 2, 1000, "node", "contiguous", (1, 4, 16, 64, 256)),
    Scenario("4x2-node-round-robin-1g", 4, 2, 1000, "node", "round-robin", (1, 4, 16, 64)),
    Scenario("4x2-rank-contiguous-1g", 4, 2, 1000, "rank", "contiguous", (1, 4, 16, 64)),
    Scenario("4x2-node-contiguous-1g", 4, 2, 1000, "node", "contiguous", (4, 16, 64)),
    Scenario("2x2-node-contiguous-100m", 2, 2, 100, "node", "contiguous", (4, 16)),
    # The 4x2 runs above need more CPU than a shared 2-core machine gives 8 ranks; at 100 Mbit/s the links bound them.
    Scenario("4x2-node-round-robin-100m", 4, 2, 100, "node", "round-robin", (16,)),
    Scenario("4x2-rank-contiguous-100m", 4, 2, 100, "rank", "contiguous", (16,)),
]}
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
COLORS = {"flat": "tab:blue", "hier": "tab:orange", "comm-global": "tab:green", "ho-ring": "tab:red"}


# ------------------------------------------------------------------------------------------------- byte model
def link_limit_bytes(collective: str, nbytes: int, nodes: int, m: int, nic: str) -> float:
    """Bytes the busiest NIC must send in the best hierarchical schedule: per node ``2(g-1)/g S`` for all-reduce and
    ``(g-1)/g S`` for the others, split over m NICs when every rank has its own."""
    factor = 2 if collective == "all_reduce" else 1
    per_node = factor * (nodes - 1) / nodes * nbytes
    return per_node / (m if nic == "rank" else 1)


def busbw_factor(collective: str, n: int) -> float:
    return 2 * (n - 1) / n if collective == "all_reduce" else (n - 1) / n


# ------------------------------------------------------------------------------------------------- rank side
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    from lightning_paro.comm import ho_ring
    from lightning_paro.comm.collectives import Communicator
    from lightning_paro.comm.topology import Topology

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    m = int(os.environ["LOCAL_WORLD_SIZE"])
    contiguous = os.environ["CLUSTER_PLACEMENT"] == "contiguous"
    topo = Topology(world_size=n, group_size=m, rank=rank)
    # Groups are the ranks of one node whatever the placement.
    groups = ho_ring.create_groups(topo, ho_ring.rank_order_by_node(int(os.environ["NODE_RANK"])))
    comm = Communicator(topo) if contiguous else None
    no_overlap = ho_ring.HORingConfig(chunk_bytes=1 << 62, flat_below_bytes=0)
    chunked = ho_ring.DEFAULT_CONFIG if args.chunk_mib is None else ho_ring.HORingConfig(
        chunk_bytes=int(args.chunk_mib * MiB), flat_below_bytes=0)
    first_of_node = int(os.environ["LOCAL_RANK"]) == 0

    def nic_bytes() -> dict[str, int]:
        out = {}
        if first_of_node:  # one reader per node: its NICs are in this namespace
            for nic in sorted(os.listdir("/sys/class/net")):
                if nic.startswith("eth"):
                    out[f"node{os.environ['NODE_RANK']}/{nic}"] = int(
                        Path(f"/sys/class/net/{nic}/statistics/tx_bytes").read_text())
        return out

    def gathered(d: dict) -> dict:
        parts: list = [None] * n
        dist.all_gather_object(parts, d)
        return {k: v for p in parts for k, v in p.items()}

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        return dt.item()

    impls = ["flat", "hier", "ho-ring"] + (["comm-global"] if contiguous and args.with_comm else [])
    if args.impls:
        impls = [i for i in impls if i in args.impls.split(",")]
    for size_mib in args.sizes:
        numel = int(size_mib * MiB) // 4
        full = torch.ones(numel)
        a, b = ho_ring.shard_range(numel, topo, groups.position)
        shard = torch.ones(b - a)
        for coll in args.collectives.split(","):
            for impl in impls:
                if impl == "flat":
                    call = {"all_reduce": lambda: dist.all_reduce(full),
                            "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full),
                            "all_gather": lambda: dist.all_gather_into_tensor(full, shard)}[coll]
                elif impl == "comm-global":
                    call = {"all_reduce": lambda: comm.all_reduce(full, "global"),
                            "reduce_scatter": lambda: comm.reduce_scatter(shard, full, "global"),
                            "all_gather": lambda: comm.all_gather(full, shard, "global")}[coll]
                else:
                    cfg = no_overlap if impl == "hier" else chunked
                    call = {"all_reduce": lambda: ho_ring.all_reduce(full, topo, config=cfg, groups=groups),
                            "reduce_scatter": lambda: ho_ring.reduce_scatter(shard, full, topo, config=cfg,
                                                                             groups=groups),
                            "all_gather": lambda: ho_ring.all_gather(full, shard, topo, config=cfg,
                                                                     groups=groups)}[coll]
                timed(call)  # warm-up: connections, allocations
                before = gathered(nic_bytes())
                cpu0 = time.process_time()  # all threads of this rank, gloo's included
                times = [timed(call) for _ in range(args.reps)]
                cpu = torch.tensor(time.process_time() - cpu0, dtype=torch.float64)
                dist.all_reduce(cpu)
                after = gathered(nic_bytes())
                sent = {k: (after[k] - before[k]) / args.reps for k in after}
                if rank == 0:
                    print("BENCH " + json.dumps({"collective": coll, "impl": impl, "size_mib": size_mib,
                                                 "times": times, "nic_bytes_per_run": sent,
                                                 "cpu_s_per_run": cpu.item() / args.reps}), flush=True)
    if comm is not None:
        comm.close()
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------- driver side
def summarise(sc: Scenario, raw: dict) -> dict:
    n = sc.nodes * sc.ranks_per_node
    rate = sc.rate_mbit * 1e6 / 8
    t = statistics.median(raw["times"])
    nbytes = raw["size_mib"] * MiB
    limit_bytes = link_limit_bytes(raw["collective"], nbytes, sc.nodes, sc.ranks_per_node, sc.nic)
    busiest = max(raw["nic_bytes_per_run"].values())
    return {**raw, "time_s": t, "time_min_s": min(raw["times"]), "time_max_s": max(raw["times"]),
            "algbw_MBps": nbytes / t / 1e6, "busbw_MBps": nbytes / t / 1e6 * busbw_factor(raw["collective"], n),
            "link_limit_s": limit_bytes / rate, "link_fraction": limit_bytes / rate / t,
            "busiest_nic_MiB": busiest / MiB, "busiest_nic_utilisation": busiest / t / rate,
            # CPU seconds of all ranks per second of the collective: near the machine's core count = CPU-bound.
            "cores_busy": raw["cpu_s_per_run"] / statistics.mean(raw["times"]) if "cpu_s_per_run" in raw else None}


def run_scenario(sc: Scenario, args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT / "bench"))
    from cluster import Cluster, ClusterConfig

    cfg = ClusterConfig(nodes=sc.nodes, ranks_per_node=sc.ranks_per_node, rate_mbit=sc.rate_mbit, nic=sc.nic,
                        placement=sc.placement)
    argv = [str(Path(__file__).resolve()), "--worker", "--reps", str(args.reps), "--collectives", args.collectives,
            "--sizes", *[str(s) for s in (args.sizes or sc.sizes_mib)]]
    if args.chunk_mib is not None:
        argv += ["--chunk-mib", str(args.chunk_mib)]
    if args.impls:
        argv += ["--impls", args.impls]
    if args.with_comm:
        argv += ["--with-comm"]
    with Cluster(cfg) as cluster:
        outputs = cluster.run(argv, timeout=args.timeout)
    rows = [summarise(sc, json.loads(line[6:])) for line in outputs[0].splitlines() if line.startswith("BENCH ")]
    return {"scenario": asdict(sc), "reps": args.reps, "chunk_mib": args.chunk_mib, "rows": rows,
            "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{os.cpu_count()} CPU cores, shared with other jobs (timings are noisy)"}


def cores(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def speedup(base: float | None, t: float) -> str:
    return f"{base / t:.2f}x" if base else "—"


def table(results: list[dict]) -> str:
    lines = ["| scenario | collective | MiB | impl | time s (min-max) | algbw MB/s | busbw MB/s | link limit s | "
             "fraction of link limit | busiest NIC MiB | cores busy | vs flat |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        flat = {(r["collective"], r["size_mib"]): r["time_s"] for r in res["rows"] if r["impl"] == "flat"}
        for r in res["rows"]:
            base = flat.get((r["collective"], r["size_mib"]))
            impl = r["impl"] + (f" (chunk {res['chunk_mib']} MiB)" if res.get("chunk_mib") and r["impl"] == "ho-ring"
                                else "")
            lines.append(f"| {res['scenario']['name']} | {r['collective']} | {r['size_mib']} | {impl} | "
                         f"{r['time_s']:.3f} ({r['time_min_s']:.3f}-{r['time_max_s']:.3f}) | {r['algbw_MBps']:.1f} | "
                         f"{r['busbw_MBps']:.1f} | {r['link_limit_s']:.3f} | {r['link_fraction']:.2f} | "
                         f"{r['busiest_nic_MiB']:.1f} | {cores(r.get('cores_busy'))} | {speedup(base, r['time_s'])} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(len(results), 3, figsize=(13, 3.2 * len(results)), squeeze=False)
    for row, res in zip(axes, results):
        for ax, coll in zip(row, COLLECTIVES):
            for impl in ("flat", "hier", "comm-global", "ho-ring"):
                pts = sorted((r["size_mib"], r["busbw_MBps"]) for r in res["rows"]
                             if r["collective"] == coll and r["impl"] == impl)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl, color=COLORS[impl])
            ax.set_xscale("log", base=2)
            ax.set_title(f"{res['scenario']['name']}: {coll}", fontsize=9)
            ax.set_xlabel("MiB")
            ax.set_ylabel("busbw MB/s")
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description="Flat vs hierarchical vs HO-Ring collectives on the emulated cluster.")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), help="default: all")
    ap.add_argument("--sizes", type=float, nargs="*", help="MiB; default: the scenario's")
    ap.add_argument("--collectives", default=",".join(COLLECTIVES))
    ap.add_argument("--impls", help="comma-separated subset of flat,hier,ho-ring,comm-global")
    ap.add_argument("--with-comm", action="store_true", help="also time the Communicator's global collectives")
    ap.add_argument("--chunk-mib", type=float, help="HO-Ring chunk size (default: the library default)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--tag", default="", help="suffix of the result file names")
    ap.add_argument("--summarise", action="store_true", help="only rebuild summary.md and the plot from --out")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    for name in [] if args.summarise else args.scenario or list(SCENARIOS):
        res = run_scenario(SCENARIOS[name], args)
        sys.path.insert(0, str(ROOT / "bench"))
        from provenance import stamp

        res["provenance"] = stamp()
        (args.out / f"{name}{args.tag}.json").write_text(json.dumps(res, indent=1))
        print(table([res]), flush=True)
    results = sorted((json.loads(p.read_text()) for p in args.out.glob("*.json")),
                     key=lambda r: (r["scenario"]["name"], r.get("chunk_mib") or 0))
    (args.out / "summary.md").write_text(
        "# Collective benchmark results\n\nMedians of the repetitions on the emulated cluster (bench/cluster.py); "
        "measured on a 2-core machine shared with other jobs, so times are noisy.\n\n" + table(results) + "\n")
    one_per_scenario = len({r["scenario"]["name"] for r in results}) == len(results)
    several_sizes = any(len({row["size_mib"] for row in r["rows"]}) > 1 for r in results)
    if one_per_scenario and several_sizes:  # a plot of busbw against size says something
        plot(results, args.out / "collectives.png")


if __name__ == "__main__":
    main()
