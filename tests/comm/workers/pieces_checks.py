"""All-gather and reduce-scatter in pieces against the single collective, and the staging memory of each.

Prints ``RESULT <name> OK|FAIL <why>`` lines; the torch.distributed environment comes from the launcher.
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_paro import compat
from lightning_paro.cli.peak_memory import fix_mmap_threshold, peak_bytes, reset_peak, resident_bytes
from lightning_paro.comm import pieces

fix_mmap_threshold()
rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
cpu = torch.device("cpu")


def report(name: str, ok: bool, why: str = "") -> None:
    print(f"RESULT {name} {'OK' if ok else 'FAIL'} {why}", flush=True)


for shard_numel, piece_bytes in [(1, 4), (7, 8 * n), (1001, 64 * n), (12_007, 4096)]:
    torch.manual_seed(rank)
    shard = torch.randn(shard_numel)
    full = torch.randn(n * shard_numel)
    want_gather, got_gather = torch.empty(n * shard_numel), torch.empty(n * shard_numel)
    compat.all_gather_single(want_gather, shard)
    pieces.all_gather(got_gather, shard, None, n, piece_bytes)
    want_reduce, got_reduce = torch.empty(shard_numel), torch.empty(shard_numel)
    compat.reduce_scatter_single(want_reduce, full)
    pieces.reduce_scatter(got_reduce, full, None, n, piece_bytes)
    case = f"{shard_numel}x{n}/{piece_bytes}B"
    report(f"all_gather {case}", torch.equal(got_gather, want_gather))
    report(f"reduce_scatter {case}", torch.equal(got_reduce, want_reduce))

# A 32 MiB buffer: the single call stages a copy of all of it, the pieces one piece.
MiB = 2**20
shard = torch.ones(8 * MiB // n)
full = torch.ones(8 * MiB)
out = torch.zeros(8 * MiB)  # touched: its pages are resident before the gather
for name, run in [("all_gather", lambda: pieces.all_gather(out, shard, None, n, MiB)),
                  ("reduce_scatter", lambda: pieces.reduce_scatter(shard, full, None, n, MiB))]:
    dist.barrier()
    reset_peak(cpu)
    before = resident_bytes()
    run()
    extra = peak_bytes(cpu) - before
    report(f"{name} staging", extra < 4 * MiB, f"{extra / MiB:.1f} MiB above the buffers")
dist.destroy_process_group()
