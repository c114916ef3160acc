"""The strategy's engine over the module, as plain functions: built with the precision's master dtype, the HO-Ring
settings its communicator gets, the engine of an earlier set-up retired, and a warning for parameters that require
grad but sit in no optimizer. ``PaROStrategy`` (``strategy.py``) calls them from ``setup`` and when
``sharding="auto"`` switches strategy in place."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from lightning_paro.comm.collectives import Communicator
from lightning_paro.comm.ho_ring import HORingConfig
from lightning_paro.strategy.engine import PaROEngine
from lightning_paro.strategy.levels import ShardingSpec
from lightning_paro.strategy.transitions import CommDtypes
from lightning_paro.strategy.units import UnitPolicy

if TYPE_CHECKING:
    from lightning_paro.planner import Plan


def unwrap(optimizer: Any) -> Optimizer:
    """The torch optimizer inside a Lightning one (or ``optimizer`` itself)."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def ho_ring_config(base: HORingConfig, chunk_bytes: Optional[int], plan: Optional[Plan]) -> HORingConfig:
    """``base`` with the ``chunk_bytes`` given, else the chunk ``sharding="auto"`` planned with (``plan``), else as
    it is."""
    if chunk_bytes is None and plan is not None:
        chunk_bytes = int(plan.cluster.chunk_bytes)
    return base if chunk_bytes is None else replace(base, chunk_bytes=chunk_bytes)


def new_engine(module: nn.Module, spec: ShardingSpec, comm: Communicator, optimizers: list[Optimizer], *,
               precision: str, units: UnitPolicy, prefetch: int, comm_dtypes: CommDtypes,
               replicated: bool = False) -> PaROEngine:
    """An engine of ``spec`` over ``module`` and ``optimizers`` (raw torch optimizers), with an fp32 master copy under
    a "-true" half ``precision``."""
    master_dtype = torch.float32 if precision in ("bf16-true", "16-true") else None
    return PaROEngine(module, spec, comm, optimizers=optimizers, units=units, prefetch=prefetch,
                      master_dtype=master_dtype, comm_dtypes=comm_dtypes, replicated=replicated)


def retire(engine: PaROEngine, comm: Optional[Communicator]) -> None:
    """Give the plain module back from ``engine`` and close its communicator (set-up runs again)."""
    engine.restore_module()
    if comm is not None:
        comm.close()


def warn_untracked(engine: PaROEngine) -> None:
    """Warn (rank 0) about parameters that require grad but are in no optimizer: the engine treats them as frozen."""
    if engine.untracked:
        rank_zero_warn(
            f"{len(engine.untracked)} parameters require grad but are in no optimizer (e.g."
            f" {engine.untracked[0]!r}); the PaRO strategy treats them as frozen."
        )
