"""Turns what ``predict_step`` returns into per-row Arrow columns."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import pyarrow as pa
import torch

DEFAULT_PREDICTION_COLUMN = "prediction"


class PredictionFormatError(ValueError):
    """``predict_step`` returned something that cannot be written one value per row."""


def detach_to_cpu(output: Any) -> Any:
    """Moves tensors in a prediction to the CPU on the model's thread, so the writer never touches the device."""
    if isinstance(output, torch.Tensor):
        return output.detach().cpu()
    if isinstance(output, Mapping):
        return {k: detach_to_cpu(v) for k, v in output.items()}
    return output


_BUFFER_KINDS = "iuf"  # integer, unsigned and floating-point arrays are one Arrow buffer as they are


def numpy_to_arrow(values: np.ndarray) -> pa.Array:
    """A 1-D NumPy array as an Arrow array; numbers without a copy of their buffer.

    Numbers are wrapped as they are rather than passed through ``pa.array``, which imports pandas on its first call
    (about 0.2 s of CPU, in the writer thread beside the model)."""
    if values.ndim == 1 and values.dtype.kind in _BUFFER_KINDS and values.dtype.itemsize in (1, 2, 4, 8):
        if not values.dtype.isnative:  # Arrow holds numbers in this machine's byte order
            values = values.astype(values.dtype.newbyteorder("="))
        values = np.ascontiguousarray(values)
        return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])
    return pa.array(values)


def _to_arrow(name: str, value: Any, num_rows: int) -> pa.Array:
    if isinstance(value, torch.Tensor):
        value = value.numpy() if value.dtype != torch.bfloat16 else value.float().numpy()
    if isinstance(value, np.ndarray):
        if value.ndim == 0 or value.shape[0] != num_rows:
            raise PredictionFormatError(
                f"prediction column {name!r} has shape {tuple(value.shape)} but the batch has {num_rows} rows; "
                "predict_step must return one value per input row (first dimension = batch size)."
            )
        if value.ndim == 1:
            return numpy_to_arrow(value)
        flat = value.reshape(num_rows, -1)
        # a fixed-size list per row keeps vectors (embeddings, logits) compact and typed
        return pa.FixedSizeListArray.from_arrays(numpy_to_arrow(flat.reshape(-1)), flat.shape[1])
    if isinstance(value, (list, tuple)):
        if len(value) != num_rows:
            raise PredictionFormatError(
                f"prediction column {name!r} has {len(value)} values but the batch has {num_rows} rows."
            )
        return pa.array(list(value))
    raise PredictionFormatError(
        f"prediction column {name!r} is a {type(value).__name__}; return a tensor, a numpy array or a list "
        "with one value per row, or a dict of those."
    )


def prediction_columns(output: Any, num_rows: int) -> dict[str, pa.Array]:
    """``{column name: Arrow array}`` for one batch's prediction (a tensor, array, list or dict of them)."""
    if isinstance(output, Mapping):
        if not output:
            raise PredictionFormatError("predict_step returned an empty dict; return at least one column.")
        return {str(k): _to_arrow(str(k), v, num_rows) for k, v in output.items()}
    return {DEFAULT_PREDICTION_COLUMN: _to_arrow(DEFAULT_PREDICTION_COLUMN, output, num_rows)}


def num_output_rows(output: Any) -> int:
    """The row count a prediction claims (its first dimension), used to validate it against the batch."""
    if isinstance(output, Mapping):
        output = next(iter(output.values()))
    if isinstance(output, (torch.Tensor, np.ndarray)):
        return int(output.shape[0]) if output.ndim > 0 else -1
    if isinstance(output, (list, tuple)):
        return len(output)
    return -1
