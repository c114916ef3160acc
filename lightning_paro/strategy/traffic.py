"""The traffic the strategy records from its communicator's meter: per optimizer step, the bytes this rank sent by
scope (kept in ``PaROStrategy.traffic_history`` and, with ``log_traffic``, logged), and the running totals that
``sharding="auto"``'s re-planner reads."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from lightning_paro.comm.accounting import TrafficMeter
from lightning_paro.strategy.report import StepTraffic

if TYPE_CHECKING:
    import lightning.pytorch as pl


def sent(meter: TrafficMeter) -> tuple[float, float]:
    """Bytes this rank has sent so far: (intra-group, inter-group)."""
    total = StepTraffic.between({}, meter.snapshot())
    return float(total.intra), float(total.inter)


def step_since(meter: TrafficMeter, since: dict) -> tuple[StepTraffic, dict]:
    """The bytes sent since the snapshot ``since`` (one optimizer step), and the meter's snapshot now."""
    now = meter.snapshot()
    return StepTraffic.between(since, now), now


def log_step(module: Optional[pl.LightningModule], step: StepTraffic) -> None:
    """Log one step's bytes through ``module`` (rank 0's figures), when it has a trainer and loggers."""
    if module is not None and module._trainer is not None and module.loggers:
        module.log_dict({"paro/intra_bytes": float(step.intra), "paro/inter_bytes": float(step.inter)},
                        on_step=True, on_epoch=False, rank_zero_only=True, prog_bar=False)
