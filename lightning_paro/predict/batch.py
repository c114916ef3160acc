"""What travels from the shard sampler through DataLoader workers to ``predict_step`` and the writer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np
import torch

IDLE_SHARD = -1


class BatchTicket(NamedTuple):
    """One batch's worth of dataset indices from a leased shard, as yielded by the shard sampler."""

    shard_id: int
    start_row: int
    end_row: int
    indices: Sequence[int]
    """The batch's dataset indices: a ``range`` (three numbers however large the batch, when it is pickled to a
    DataLoader worker and back)."""
    last: bool
    attempt: int

    @property
    def idle(self) -> bool:
        """An idle ticket carries no rows: it keeps the loop turning while this worker waits for work."""
        return self.shard_id == IDLE_SHARD


def idle_ticket() -> BatchTicket:
    return BatchTicket(IDLE_SHARD, 0, 0, range(0), False, 0)


class RowFailure(NamedTuple):
    """A row that raised in the dataset or in ``predict_step`` after its retries."""

    index: int
    row_id: Any
    stage: str
    error: str
    traceback: str


@dataclass
class ElasticBatch:
    """A collated user batch plus the bookkeeping that gives every row its stable id.

    It travels from a DataLoader worker to the model thread once per batch, so its bookkeeping is kept compact:
    ``indices`` is a ``range`` when the rows are consecutive (the usual case) and ``ids`` an array when the ids are
    numbers. Lightning moves it to the device through ``to``, which moves ``data`` only: Lightning's transfer would
    otherwise walk every per-row value of the bookkeeping.
    """

    data: Any
    """The user's collated batch of the rows that loaded (None when none did)."""
    ticket: BatchTicket
    """Where the rows came from."""
    indices: Sequence[int] = field(default_factory=list)
    """Dataset index of each row in ``data``, in order (a ``range``, a list or an int64 array)."""
    ids: Optional[Sequence] = None
    """The user id column's value for each row in ``data``, when one is configured (a list or an array)."""
    failures: list = field(default_factory=list)
    """Rows that raised while loading."""
    fetch_threads: int = 0
    """Threads that read this batch's rows in the DataLoader worker (0: not read by a fetch pool)."""
    by_value: bool = False
    """Send ``data``'s small CPU tensors by value when pickled (set on column batches, see ``__getstate__``)."""

    def __len__(self) -> int:
        return len(self.indices)

    def __getstate__(self) -> dict:
        # A DataLoader worker passes each tensor of a batch through shared memory, with a file-descriptor handshake
        # per tensor that the receiving process waits for; a column batch holds one tensor per column. Sent by value,
        # its columns cost a copy of their bytes instead (up to BY_VALUE_BYTES each; larger ones keep shared memory).
        state = dict(self.__dict__)
        if self.by_value and self.data is not None:
            state["data"] = _map_tensors(self.data, _tensor_to_array)
        return state

    def __setstate__(self, state: dict) -> None:
        if state.get("by_value") and state.get("data") is not None:
            state["data"] = _map_tensors(state["data"], _array_to_tensor)
        self.__dict__.update(state)

    def to(self, device: Any, **kwargs: Any) -> "ElasticBatch":
        """This batch with ``data`` moved to ``device`` (Lightning's batch transfer calls it)."""
        from lightning.fabric.utilities import move_data_to_device

        if self.data is None:
            return self
        return dataclasses.replace(self, data=move_data_to_device(self.data, device))


BY_VALUE_BYTES = 1 << 20
"""The largest tensor of a column batch sent by value rather than through shared memory."""


class _ArrayOfTensor(NamedTuple):
    """A tensor's values while they travel by value."""

    array: np.ndarray


def _tensor_to_array(value: Any) -> Any:
    if (isinstance(value, torch.Tensor) and value.device.type == "cpu" and not value.requires_grad
            and value.dtype != torch.bfloat16 and value.numel() * value.element_size() <= BY_VALUE_BYTES):
        return _ArrayOfTensor(value.numpy())
    return value


def _array_to_tensor(value: Any) -> Any:
    return torch.from_numpy(value.array) if isinstance(value, _ArrayOfTensor) else value


def _map_tensors(data: Any, fn) -> Any:
    """``data`` (a column batch: a dict of columns, or one value) with ``fn`` applied to each column."""
    if isinstance(data, dict):
        return type(data)((k, fn(v)) for k, v in data.items())
    return fn(data)


def index_array(indices: Sequence[int]) -> np.ndarray:
    """Row indices as an int64 array, without a Python int per row when they are a range."""
    if isinstance(indices, range):
        return np.arange(indices.start, indices.stop, indices.step, dtype=np.int64)
    return np.asarray(indices, dtype=np.int64)


def take(values: Sequence, positions: Sequence[int]) -> Sequence:
    """``values`` at ``positions`` (an array, range or list), without a copy when the positions are all of them."""
    if isinstance(positions, range) and positions == range(len(values)):
        return values
    if isinstance(values, np.ndarray):
        return values[np.asarray(positions, dtype=np.int64)]
    if isinstance(values, range):
        return index_array(values)[np.asarray(positions, dtype=np.int64)]
    return [values[p] for p in positions]


def plain(value: Any) -> Any:
    """A tensor or numpy scalar as a plain Python value, so it can be written and compared."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    return value


@dataclass
class StepOutcome:
    """What the wrapped ``predict_step`` hands to the writer for one batch."""

    ticket: BatchTicket
    """The batch's ticket."""
    chunks: list = field(default_factory=list)
    """``(positions, prediction)`` pairs: predictions for the rows at those positions of the batch."""
    indices: list = field(default_factory=list)
    """Dataset index of each row of the batch."""
    ids: Optional[list] = None
    """User ids of the rows, when configured."""
    failures: list = field(default_factory=list)
    """Rows that raised in loading or predicting."""


def batch_size_of(batch: Any) -> Optional[int]:
    """The number of rows in a collated batch, read from its first sliceable leaf."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return int(batch.shape[0]) if batch.ndim > 0 else None
    if isinstance(batch, dict):
        for value in batch.values():
            n = batch_size_of(value)
            if n is not None:
                return n
        return None
    if isinstance(batch, (list, tuple)):
        for value in batch:
            n = batch_size_of(value)
            if n is not None:
                return n
        return None
    return None


def slice_batch(batch: Any, positions: list, size: int) -> Any:
    """The rows at ``positions`` of a collated batch: every leaf whose first dimension is ``size`` is sliced.

    Used to bisect a failing batch down to the rows that raise without re-reading them.
    """
    if isinstance(batch, torch.Tensor):
        if batch.ndim > 0 and batch.shape[0] == size:
            return batch[torch.as_tensor(positions, dtype=torch.long, device=batch.device)]
        return batch
    if isinstance(batch, np.ndarray):
        return batch[np.asarray(positions)] if batch.ndim > 0 and batch.shape[0] == size else batch
    if isinstance(batch, dict):
        return type(batch)({k: slice_batch(v, positions, size) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(slice_batch(v, positions, size) for v in batch))
    if isinstance(batch, (list, tuple)):
        if len(batch) == size and all(not isinstance(v, (torch.Tensor, np.ndarray, dict, list, tuple)) for v in batch):
            return type(batch)(batch[p] for p in positions)  # a per-row list such as strings
        return type(batch)(slice_batch(v, positions, size) for v in batch)
    return batch
