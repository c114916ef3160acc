"""Per-step traffic records and the printable summary of a PaRO run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_paro.comm.accounting import INTER, INTRA
from lightning_paro.comm.topology import Topology
from lightning_paro.strategy.levels import KNOWN_AS, ShardingSpec


@dataclass(frozen=True)
class StepTraffic:
    """Bytes one rank sent during one optimizer step (all its micro-steps and the syncs)."""

    intra: int
    """Over intra-group links."""
    inter: int
    """Over inter-group links."""
    by_op: tuple[tuple[str, str, int], ...]
    """(operation, scope, bytes) for every collective kind used."""

    @classmethod
    def between(cls, before: dict, after: dict) -> StepTraffic:
        delta = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
        intra = sum(v for (_, scope), v in delta.items() if scope == INTRA)
        inter = sum(v for (_, scope), v in delta.items() if scope == INTER)
        return cls(intra, inter, tuple(sorted((op, scope, v) for (op, scope), v in delta.items())))


def _mb(n: float) -> str:
    return f"{n / 1e6:,.3f} MB"


def format_summary(spec: ShardingSpec, topology: Optional[Topology], history: list[StepTraffic],
                   memory: dict[str, int], params: dict[str, int]) -> str:
    lines = [f"PaRO strategy {spec.name}" + (f" ({KNOWN_AS[spec.name]})" if spec.name in KNOWN_AS else "")]
    if topology is not None:
        lines.append(f"  topology: n={topology.world_size} ranks = g={topology.num_groups} groups x"
                     f" m={topology.group_size}; this rank {topology.rank} (group {topology.group_index},"
                     f" local {topology.local_index})")
    if params:
        lines.append(f"  parameters: {params['total']:,} ({params['trainable']:,} trainable);"
                     f" padded {params['total_padded']:,} / {params['trainable_padded']:,}")
    if history:
        last = history[-1]
        mean_intra = sum(h.intra for h in history) / len(history)
        mean_inter = sum(h.inter for h in history) / len(history)
        lines.append(f"  traffic per optimizer step (this rank, sent): intra {_mb(mean_intra)},"
                     f" inter {_mb(mean_inter)} (mean of {len(history)} steps)")
        for op, scope, b in last.by_op:
            lines.append(f"    {op:<15} {scope:<6} {_mb(b)}")
    if memory:
        lines.append(f"  model states on this rank: params {_mb(memory['params'])}, grads {_mb(memory['grads'])},"
                     f" optimizer {_mb(memory['optim'])}")
    return "\n".join(lines)
