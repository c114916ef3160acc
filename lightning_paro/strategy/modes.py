"""The modes of a :class:`~lightning_paro.strategy.engine.PaROEngine`: what its unit hooks do, and in which dtype its
flat groups gather. :class:`~lightning_paro.strategy.evaluation.EvaluationStages` owns the engine's current mode."""

from __future__ import annotations

import enum


class Mode(enum.Enum):
    SHARDED = "sharded"
    """Training: gather before use, free after use; gathers travel in the strategy's ``comm_dtypes``."""
    FULL = "full"
    """Evaluation: every unit stays gathered, hooks do nothing (no collectives per batch, so ranks may run
    different numbers of batches)."""
    EVAL = "eval"
    """Sharded evaluation: the root unit stays gathered, the other units are gathered one at a time and freed after
    their forward; ranks that ran out of batches serve the gathers of their peers' steps
    (:class:`~lightning_paro.strategy.evaluation.ShardedEvaluation`)."""
