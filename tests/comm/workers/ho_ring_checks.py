"""Run every HO-Ring check for one world size and print one ``RESULT <name> OK|FAIL <why>`` line per case.

Usage: ho_ring_checks.py GROUP_SIZES [ROUND_ROBIN_GROUP_SIZE]; the torch.distributed environment comes from the
launcher. Results are compared with the flat torch.distributed collective over the default group.
"""

import dataclasses
import os
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_paro.comm import ho_ring
from lightning_paro.comm.accounting import TrafficMeter, ring_bytes
from lightning_paro.comm.topology import Topology

rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
group_sizes = [int(x) for x in sys.argv[1].split(",")]
round_robin_m = int(sys.argv[2]) if len(sys.argv) > 2 else 0

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Sizes: a single element, fewer elements than ranks, not divisible by n, and large enough for many chunks.
SIZES = [1, 5, 3 * n + 1, 12_007]
# Many small chunks and no flat fallback, so every size runs the pipeline; plus the defaults (small sizes go flat).
PIPELINED = ho_ring.HORingConfig(chunk_bytes=4096, flat_below_bytes=0)
CONFIGS = {"pipelined": PIPELINED, "default": ho_ring.DEFAULT_CONFIG}
SIZES_FOR = {"pipelined": SIZES, "default": [3 * n + 1, 4099]}


def report(name: str, ok: bool, why: str = "") -> None:
    print(f"RESULT {name} {'OK' if ok else 'FAIL ' + why}", flush=True)


def data(numel: int, dtype: torch.dtype, seed: int, who: int = rank) -> torch.Tensor:
    # Small integers: sums over <= 8 ranks and divisions by a power of two are exact in fp32 and bf16, so the
    # comparison with the flat collective can be exact whatever order either one adds in.
    gen = torch.Generator().manual_seed(seed * 1000 + who)
    return torch.randint(-8, 9, (numel,), generator=gen).to(dtype)


def flat_all_reduce(x: torch.Tensor, op: str) -> torch.Tensor:
    ref = x.clone()
    dist.all_reduce(ref)
    return ref / n if op == "avg" else ref


def flat_all_gather(numel: int, dtype, seed: int, topo: Topology, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard and the full buffer built by a flat all-reduce of zero buffers holding one shard each."""
    a, b = ho_ring.shard_range(numel, topo, position)
    full = torch.zeros(numel, dtype=dtype)
    shard = data(numel, dtype, seed)[a:b]
    full[a:b] = shard
    dist.all_reduce(full)
    return shard.clone(), full


def compare(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype != want.dtype or got.shape != want.shape:
        report(name, False, f"dtype/shape {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}")
    elif not torch.equal(got, want):
        bad = (got != want).nonzero().flatten()
        report(name, False, f"{bad.numel()} elements differ, first at {bad[0].item()}: {got[bad[0]].item()} != "
                            f"{want[bad[0]].item()}")
    else:
        report(name, True)


def run_layout(m: int, groups=None, tag: str = "") -> None:
    topo = Topology(world_size=n, group_size=m, rank=rank)
    grp = groups or ho_ring.create_groups(topo)
    pos = grp.position
    layout = f"{n // m}x{m}{tag}"
    seed = 0
    for cfg_name, cfg in CONFIGS.items():
        for dname, dtype in DTYPES.items():
            for op in ("sum", "avg"):
                for numel in SIZES_FOR[cfg_name]:
                    seed += 1
                    case = f"{layout}/{cfg_name}/{dname}/{op}/{numel}"
                    x = data(numel, dtype, seed)
                    want = flat_all_reduce(x, op)
                    ho_ring.all_reduce(x, topo, op=op, config=cfg, groups=grp)
                    compare(f"all_reduce/sync/{case}", x, want)

                    a, b = ho_ring.shard_range(numel, topo, pos)
                    out = torch.full((b - a,), 99, dtype=dtype)
                    ho_ring.reduce_scatter(out, data(numel, dtype, seed), topo, op=op, config=cfg, groups=grp)
                    compare(f"reduce_scatter/sync/{case}", out, want[a:b])

                    shard, full = flat_all_gather(numel, dtype, seed, topo, pos)
                    got = torch.full((numel,), 99, dtype=dtype)
                    ho_ring.all_gather(got, shard, topo, config=cfg, groups=grp)
                    compare(f"all_gather/sync/{case}", got, full)

    # Async: many collectives of all three kinds in flight at once, waited for at the end. Their phases interleave,
    # so this also checks that every phase runs them in the same order on every rank. (The flat fallback of the
    # default configuration is a single task; the sync cases cover it.)
    pending = []
    for cfg_name, cfg in [("pipelined", PIPELINED)]:
        for dname, dtype in DTYPES.items():
            for op in ("sum", "avg"):
                for numel in SIZES_FOR[cfg_name]:
                    seed += 1
                    case = f"{layout}/{cfg_name}/{dname}/{op}/{numel}"
                    x = data(numel, dtype, seed)
                    want = flat_all_reduce(x, op)
                    a, b = ho_ring.shard_range(numel, topo, pos)
                    out = torch.full((b - a,), 99, dtype=dtype)
                    shard, full = flat_all_gather(numel, dtype, seed, topo, pos)
                    got = torch.full((numel,), 99, dtype=dtype)
                    works = [ho_ring.all_reduce(x, topo, op=op, config=cfg, groups=grp, async_op=True),
                             ho_ring.reduce_scatter(out, data(numel, dtype, seed), topo, op=op, config=cfg,
                                                    groups=grp, async_op=True),
                             ho_ring.all_gather(got, shard, topo, config=cfg, groups=grp, async_op=True)]
                    pending.append((case, works, [(x, want), (out, want[a:b]), (got, full)]))
    for case, works, pairs in pending:
        for coll, work, (got, want) in zip(("all_reduce", "reduce_scatter", "all_gather"), works, pairs):
            work.wait(timeout=60)
            compare(f"{coll}/async/{case}", got, want)

    if n // m > 1:
        run_rails(grp, layout, seed)
    run_single_thread(topo, grp, layout)

    # Real-valued data: every rank must end with the same bits (replicas must not drift), close to the flat sum.
    gen = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(12_007, generator=gen)
    want = flat_all_reduce(x, "sum")
    ho_ring.all_reduce(x, topo, config=PIPELINED, groups=grp)
    copies = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(copies, x)
    same = all(torch.equal(c, copies[0]) for c in copies)
    report(f"all_reduce/identical_bits/{layout}", same, "ranks hold different results")
    close = torch.allclose(x, want, rtol=1e-5, atol=1e-5)
    report(f"all_reduce/close_to_flat/{layout}", close, f"max error {(x - want).abs().max().item()}")

    # Traffic: a buffer whose chunks all divide by n sends exactly the ring volumes, by scope.
    numel, es = 8 * 1000, 4
    nbytes = numel * es
    g = n // m
    meter = TrafficMeter()
    ho_ring.all_reduce(torch.ones(numel), topo, config=PIPELINED, groups=grp, meter=meter)
    snap = meter.snapshot()
    want_ar = {("reduce_scatter", "intra"): ring_bytes("reduce_scatter", nbytes, m),
               ("all_reduce", "inter"): ring_bytes("all_reduce", nbytes // m, g),
               ("all_gather", "intra"): ring_bytes("all_gather", nbytes, m)}
    want_ar = {k: v for k, v in want_ar.items() if v}
    report(f"traffic/all_reduce/{layout}", snap == want_ar, f"{snap} != {want_ar}")
    meter.reset()
    a, b = ho_ring.shard_range(numel, topo, pos)
    ho_ring.reduce_scatter(torch.empty(b - a), torch.ones(numel), topo, config=PIPELINED, groups=grp, meter=meter)
    ho_ring.all_gather(torch.empty(numel), torch.ones(b - a), topo, config=PIPELINED, groups=grp, meter=meter)
    snap = meter.snapshot()
    want_rs_ag = {("reduce_scatter", "intra"): ring_bytes("reduce_scatter", nbytes, m),
                  ("reduce_scatter", "inter"): ring_bytes("reduce_scatter", nbytes // m, g),
                  ("all_gather", "inter"): ring_bytes("all_gather", nbytes // m, g),
                  ("all_gather", "intra"): ring_bytes("all_gather", nbytes, m)}
    want_rs_ag = {k: v for k, v in want_rs_ag.items() if v}
    report(f"traffic/reduce_scatter_all_gather/{layout}", snap == want_rs_ag, f"{snap} != {want_rs_ag}")


def rail_reference(x: torch.Tensor, grp) -> torch.Tensor:
    """Sum of ``x`` over this rank's rail, by a flat all-reduce of m slots where each rank fills its local index's."""
    slots = torch.zeros((grp.topology.group_size, x.numel()), dtype=x.dtype)
    slots[grp.local_index] = x
    dist.all_reduce(slots)
    return slots[grp.local_index]


def run_rails(grp, layout: str, seed: int) -> None:
    """Rail (inter-only) collectives, sync and several in flight, against flat references over the rail."""
    g, i = len(grp.rail_peers), grp.group_index
    pending = []
    for chunk_bytes in (64, ho_ring.DEFAULT_CONFIG.chunk_bytes):
        for dname, dtype in DTYPES.items():
            for op in ("sum", "avg"):
                for numel in (1, g + 1, 1001):
                    seed += 1
                    case = f"{layout}/{chunk_bytes}/{dname}/{op}/{numel}"
                    x = data(numel, dtype, seed)
                    want = rail_reference(x, grp)
                    want = want / g if op == "avg" else want
                    a, b = ho_ring.split_range(0, numel, g)[i]
                    shard = data(numel, dtype, seed + 500)[a:b]
                    full_want = torch.zeros(numel, dtype=dtype)
                    full_want[a:b] = shard
                    full_want = rail_reference(full_want, grp)
                    for mode in ("sync", "async"):
                        ar, rs_in = x.clone(), x.clone()
                        rs_out = torch.full((b - a,), 99, dtype=dtype)
                        ag = torch.full((numel,), 99, dtype=dtype)
                        async_op = mode == "async"
                        works = [ho_ring.rail_all_reduce(ar, grp, op=op, async_op=async_op, chunk_bytes=chunk_bytes),
                                 ho_ring.rail_reduce_scatter(rs_out, rs_in, grp, op=op, async_op=async_op,
                                                             chunk_bytes=chunk_bytes),
                                 ho_ring.rail_all_gather(ag, shard, grp, async_op=async_op, chunk_bytes=chunk_bytes)]
                        pending.append((mode, case, works, [(ar, want), (rs_out, want[a:b]), (ag, full_want)]))
    for mode, case, works, pairs in pending:
        for coll, work, (got, want) in zip(("all_reduce", "reduce_scatter", "all_gather"), works, pairs):
            if work is not None:
                work.wait(timeout=60)
            compare(f"rail_{coll}/{mode}/{case}", got, want)


def run_single_thread(topo: Topology, grp, layout: str) -> None:
    """Single-thread mode against the phase threads: the same bits for every collective (real-valued data, so any
    change in summation order would show), and every message posted from the calling thread, in batches."""
    threaded = dataclasses.replace(PIPELINED, single_thread=False)
    inline = dataclasses.replace(PIPELINED, single_thread=True)
    gen = torch.Generator().manual_seed(11 + rank)
    numel = 3001
    a, b = ho_ring.shard_range(numel, topo, grp.position)
    i, g = grp.group_index, topo.num_groups
    ra, rb = ho_ring.split_range(0, numel, g)[i]
    x, shard, rail_shard = (torch.randn(numel, generator=gen), torch.randn(b - a, generator=gen),
                            torch.randn(rb - ra, generator=gen))

    def collectives(cfg):
        """name -> result of each collective under ``cfg``."""
        out = {}
        y = x.clone()
        ho_ring.all_reduce(y, topo, config=cfg, groups=grp)
        out["all_reduce"] = y
        out["reduce_scatter"] = torch.empty(b - a)
        ho_ring.reduce_scatter(out["reduce_scatter"], x, topo, config=cfg, groups=grp)
        out["all_gather"] = torch.empty(numel)
        ho_ring.all_gather(out["all_gather"], shard, topo, config=cfg, groups=grp)
        if g > 1:
            kw = {"chunk_bytes": cfg.chunk_bytes, "single_thread": cfg.single_thread}
            y = x.clone()
            ho_ring.rail_all_reduce(y, grp, **kw)
            out["rail_all_reduce"] = y
            out["rail_reduce_scatter"] = torch.empty(rb - ra)
            ho_ring.rail_reduce_scatter(out["rail_reduce_scatter"], x, grp, **kw)
            out["rail_all_gather"] = torch.empty(numel)
            ho_ring.rail_all_gather(out["rail_all_gather"], rail_shard, grp, **kw)
        return out

    want = collectives(threaded)
    issued = []  # (call, thread) of every message while single-thread mode runs
    originals = {name: getattr(dist, name) for name in ("isend", "irecv", "batch_isend_irecv", "all_reduce")}

    def watch(name):
        def recorded(*args, **kwargs):
            issued.append((name, threading.current_thread().name))
            return originals[name](*args, **kwargs)
        return recorded

    for name in originals:
        setattr(dist, name, watch(name))
    try:
        got = collectives(inline)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    for name in want:
        report(f"single_thread/{layout}/{name}", torch.equal(got[name], want[name]),
               f"max difference {(got[name] - want[name]).abs().max().item()}")
    calls = {c for c, _ in issued}
    threads = {t for _, t in issued}
    report(f"single_thread/{layout}/one_thread", threads <= {threading.current_thread().name} and
           calls <= {"batch_isend_irecv"} and (bool(calls) or n == 1), f"calls {calls} from threads {threads}")


topo_world = Topology(world_size=n, group_size=group_sizes[0], rank=rank)
report("shared_groups", ho_ring.shared_groups(topo_world) is ho_ring.shared_groups(topo_world), "created twice")
for m in group_sizes:
    run_layout(m)
if round_robin_m:
    # Ranks placed round-robin over nodes: node of rank r is r % g. Groups must still be the ranks of one node.
    g = n // round_robin_m
    order = ho_ring.rank_order_by_node(rank % g)
    expected = sorted(range(n), key=lambda r: (r % g, r))
    report("rank_order_by_node", order == expected, f"{order} != {expected}")
    topo = Topology(world_size=n, group_size=round_robin_m, rank=rank)
    run_layout(round_robin_m, ho_ring.create_groups(topo, order), tag="-round-robin")

dist.barrier()
dist.destroy_process_group()
print("DONE", flush=True)
