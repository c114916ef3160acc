"""How much memory a rank may plan with: free device memory, or its share of the host's available memory on CPU,
agreed on as the smallest over the ranks.
"""

from __future__ import annotations

from pathlib import Path


def available_host_memory(meminfo: Path = Path("/proc/meminfo")) -> int:
    """``MemAvailable`` of this machine in bytes (memory the kernel can hand out without swapping)."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{meminfo} has no MemAvailable line: pass device_memory to the plan explicitly.")


def device_memory_bytes(device, ranks_on_host: int = 1) -> int:
    """Memory one rank may use: free CUDA memory of its device, or its share of the host's available memory on CPU
    (``ranks_on_host`` processes of the job share one machine's memory)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        return available_host_memory() // max(1, ranks_on_host)
    raise ValueError(f"Cannot read the memory of a {device.type!r} device: pass device_memory to the plan explicitly.")


def agreed_minimum(value: float, group=None, device=None) -> float:
    """The smallest ``value`` over the ranks of ``group`` (collective), so every rank plans with the same figure."""
    return _agreed(value, "MIN", group, device)


def agreed_maximum(value: float, group=None, device=None) -> float:
    """The largest ``value`` over the ranks of ``group`` (collective)."""
    return _agreed(value, "MAX", group, device)


def _agreed(value: float, op: str, group, device) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
    return float(t.item())
