"""The strategy's side of an evaluation stage (``validate``, ``test``, ``predict``), as plain functions its hooks
call: whether the stage holds the whole model (:func:`gather_in_full`, for ``gather="full"``, ``"sharded"`` or
``"auto"``), the stage begun in full or sharded (:func:`begin_stage`), and each step run in its round
(:func:`run_step`, told by :func:`is_last_batch` when the rank has run its last batch).

Sharded evaluation needs each rank to know its last batch when it runs it: that rank then serves its peers' gathers
at once, before Lightning's epoch-end hooks and metric sync (world collectives a peer still gathering would never
reach). Lightning knows it one batch ahead, except for a step that takes ``dataloader_iter``; :func:`begin_stage`
refuses such a stage sharded at its start (:func:`check_last_batch_known`), and :func:`run_step` fails at a step
whose last-batch flag cannot be read, before it enters its round, instead of letting the stage hang at its end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

from lightning_paro.strategy.modes import Mode

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_paro.strategy.engine import PaROEngine
    from lightning_paro.strategy.options import GatherMode

STEP_OF_STAGE = {"validate": "validation_step", "test": "test_step", "predict": "predict_step"}
"""The LightningModule step each evaluation stage runs."""


def gather_in_full(mode: GatherMode, sharded: bool, full_bytes: int, memory_fraction: float,
                   free_bytes: Callable[[], float]) -> bool:
    """Whether a stage holds the whole model: always when no parameter is ``sharded`` (both ways are the same), as
    ``mode`` says under "full" and "sharded", and under "auto" when the ``full_bytes`` of every parameter gathered
    fit ``memory_fraction`` of ``free_bytes()`` (called only then: it may be a collective)."""
    if not sharded:
        return True
    if mode != "auto":
        return mode != "sharded"
    return full_bytes <= memory_fraction * free_bytes()


def begin_stage(engine: PaROEngine, in_full: Callable[[], bool], module: Optional[pl.LightningModule],
                stage: str) -> None:
    """Begin an evaluation ``stage``: the whole model gathered when ``in_full()`` (no collective per batch), else
    sharded evaluation's rounds, once :func:`check_last_batch_known` allows them."""
    if in_full():
        engine.materialize()
    else:
        check_last_batch_known(module, stage)
        engine.begin_eval()


def check_last_batch_known(module: Optional[pl.LightningModule], stage: str) -> None:
    """Refuse a sharded ``stage`` in which a rank could not tell its last batch when it runs it."""
    if module is None:
        return
    step = STEP_OF_STAGE[stage]
    if is_param_in_hook_signature(getattr(module, step), "dataloader_iter", explicit=True):
        raise RuntimeError(
            f"Sharded evaluation cannot run {type(module).__name__}.{step}, which takes `dataloader_iter`: a rank"
            " that runs out of batches must know its last batch when it runs it, to serve its peers' gathers before"
            " the epoch-end hooks and metric sync, and with `dataloader_iter` Lightning does not know it. Gather the"
            " model in full for this stage (PaROStrategy(gather=GatherConfig(evaluation='full'))), or write the step"
            " over batches.")


def run_step(engine: Optional[PaROEngine], step: Callable[..., Any], last_batch: Callable[[], bool], *args: Any,
             **kwargs: Any) -> Any:
    """Run an evaluation ``step``; under sharded evaluation inside its round, after which ``last_batch()`` says
    whether this rank has run its last batch of the stage."""
    if engine is None or engine.mode is not Mode.EVAL:
        return step(*args, **kwargs)
    last = last_batch()  # read before the round: a rank that cannot tell fails before its peers wait for it
    engine.eval_step_begin()
    out = step(*args, **kwargs)
    engine.eval_step_end(last=last)
    return out


def is_last_batch(module: pl.LightningModule) -> bool:
    """Whether the batch about to run (or just run) is this rank's last of the stage: Lightning sets
    ``batch_progress.is_last_batch`` on its active loop before each step. Raises where it cannot be read."""
    loop = getattr(module._trainer, "_active_loop", None)
    try:
        return bool(loop.batch_progress.is_last_batch)
    except AttributeError:
        raise RuntimeError(
            f"Sharded evaluation needs Lightning's {type(loop).__name__}.batch_progress.is_last_batch to know each"
            " rank's last batch, and it cannot be read here. Gather the model in full for evaluation"
            " (PaROStrategy(gather=GatherConfig(evaluation='full'))), or use a Lightning version that"
            " `python -m lightning_paro.compat` lists as supported.") from None
