"""Runs ``predict_step`` on a batch so that rows which raise are isolated by bisection, not fatal."""

from __future__ import annotations

import traceback
from typing import Any, Callable, Sequence

from lightning_paro.predict.batch import ElasticBatch, RowFailure, StepOutcome, batch_size_of, plain, slice_batch
from lightning_paro.predict.columns import PredictionFormatError, detach_to_cpu, num_output_rows


def predict_isolated(step: Callable[[Any], Any], batch: ElasticBatch, retries: int) -> StepOutcome:
    """Predicts every row of ``batch``; a failing batch is retried, then split in halves down to single rows.

    ``step`` takes a collated batch and returns one prediction per row. A wrong output shape is a
    programming error, not a poison row, so it is raised at once.
    """
    outcome = StepOutcome(ticket=batch.ticket, indices=batch.indices, ids=batch.ids, failures=list(batch.failures))
    size = len(batch.indices)
    if batch.data is None or size == 0:
        return outcome
    data_size = batch_size_of(batch.data)
    if data_size is not None and data_size != size:
        raise PredictionFormatError(
            f"the collated batch has {data_size} rows but {size} samples were loaded; the collate function must "
            "keep one row per sample"
        )
    _bisect(step, batch.data, range(size), size, retries, outcome, batch)
    return outcome


def _bisect(step, data, positions: Sequence[int], size: int, retries: int, outcome: StepOutcome, batch: ElasticBatch) -> None:
    error: BaseException | None = None
    tb = ""
    for _ in range(retries + 1):
        try:
            prediction = detach_to_cpu(step(data))
        except PredictionFormatError:
            raise
        except Exception as exc:  # the row(s) are isolated below; the job goes on
            error, tb = exc, traceback.format_exc(limit=8)
            continue
        got = num_output_rows(prediction)
        if got != len(positions):
            raise PredictionFormatError(
                f"predict_step returned {got} rows for a batch of {len(positions)}; it must return one prediction "
                "per input row (a tensor with the batch size as first dimension, or a dict of such columns)"
            )
        outcome.chunks.append((positions, prediction))
        return
    if len(positions) == 1:
        index = int(batch.indices[positions[0]])
        row_id = plain(batch.ids[positions[0]]) if batch.ids is not None else index
        outcome.failures.append(RowFailure(index, row_id, "predict_step", f"{type(error).__name__}: {error}", tb))
        return
    if batch_size_of(data) != len(positions):
        # the batch cannot be split row-wise (no leaf has the batch size): report all its rows
        for p in positions:
            index = int(batch.indices[p])
            row_id = plain(batch.ids[p]) if batch.ids is not None else index
            outcome.failures.append(
                RowFailure(index, row_id, "predict_step", f"{type(error).__name__}: {error} (batch not splittable)", tb)
            )
        return
    half = len(positions) // 2
    for part in (range(half), range(half, len(positions))):
        sub = slice_batch(data, list(part), len(positions))
        _bisect(step, sub, [positions[p] for p in part], len(part), retries, outcome, batch)
