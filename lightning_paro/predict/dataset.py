"""The dataset and collate wrappers that run in DataLoader workers: per-row error capture and row ids."""

from __future__ import annotations

import os
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from torch.utils.data import Dataset, default_collate

from lightning_paro.predict.batch import BatchTicket, ElasticBatch, RowFailure


class LoadedRows:
    """The samples of one ticket that loaded, and the rows that raised.

    A source that reads a range column by column hands over ``batch`` instead of ``samples``: the rows at
    ``indices`` already collated, as ``default_collate`` would collate their samples.
    """

    def __init__(self, ticket: BatchTicket, samples: list, indices: list, failures: list, batch: Any = None) -> None:
        self.ticket = ticket
        self.samples = samples
        self.indices = indices
        self.failures = failures
        self.batch = batch


def load_row(dataset: Any, index: int, retries: int) -> tuple[Any, Optional[BaseException], str]:
    """``dataset[index]``, retried ``retries`` times; returns (sample, None, "") or (None, error, traceback)."""
    for attempt in range(retries + 1):
        try:
            return dataset[index], None, ""
        except Exception as exc:  # a poison row must not take the worker down: it is reported instead
            if attempt == retries:
                return None, exc, traceback.format_exc(limit=8)
    raise AssertionError("unreachable")


class FetchPool:
    """Mixin: the fetch threads of a dataset, made in the process that uses them (a DataLoader worker) and dropped
    when the dataset is pickled or forked, as threads do not survive either. Needs ``fetch_threads``, ``_pool`` and
    ``_pool_pid`` set in ``__init__``."""

    fetch_threads: int
    _pool: Optional[ThreadPoolExecutor]
    _pool_pid: int

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_pool"], state["_pool_pid"] = None, -1
        return state

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool = ThreadPoolExecutor(self.fetch_threads, thread_name_prefix="lightning-paro-fetch")
            self._pool_pid = os.getpid()
        return self._pool


class ElasticDataset(FetchPool, Dataset):
    """Wraps a map-style dataset: reads a whole ticket, capturing rows that raise instead of failing the batch.

    With ``fetch_threads > 1`` the rows of a batch are read concurrently by a thread pool in each
    DataLoader worker: reading from remote storage one object per row is bound by latency, not CPU,
    so many requests in flight per worker multiply throughput without more worker processes.
    """

    def __init__(self, dataset: Any, row_retries: int = 1, fetch_threads: int = 1) -> None:
        self.dataset = dataset
        self.row_retries = row_retries
        self.fetch_threads = fetch_threads
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pool_pid = -1

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, ticket: BatchTicket) -> LoadedRows:
        samples, indices, failures = [], [], []
        if self.fetch_threads > 1 and len(ticket.indices) > 1:
            loaded = list(self._executor().map(lambda i: load_row(self.dataset, i, self.row_retries), ticket.indices))
        else:
            loaded = [load_row(self.dataset, i, self.row_retries) for i in ticket.indices]
        for index, (sample, error, tb) in zip(ticket.indices, loaded):
            if error is None:
                samples.append(sample)
                indices.append(index)
            else:
                failures.append(RowFailure(index, index, "dataset", f"{type(error).__name__}: {error}", tb))
        return LoadedRows(ticket, samples, indices, failures)


class ElasticCollate:
    """Collates the loaded samples with the user's collate function and wraps them in an ``ElasticBatch``."""

    def __init__(self, collate_fn: Optional[Callable] = None, id_column: Optional[str] = None) -> None:
        self.collate_fn = collate_fn or default_collate
        self.id_column = id_column

    def __call__(self, loaded: LoadedRows) -> ElasticBatch:
        if loaded.batch is not None:
            return self._collated(loaded)
        ids = None
        failures = list(loaded.failures)
        samples, indices = loaded.samples, loaded.indices
        if self.id_column is not None:
            ids = []
            kept_samples, kept_indices = [], []
            for sample, index in zip(samples, indices):
                try:
                    ids.append(_plain(sample[self.id_column]))
                except (KeyError, TypeError, IndexError) as exc:
                    failures.append(
                        RowFailure(index, index, "dataset", f"id column {self.id_column!r} missing: {exc!r}", "")
                    )
                    continue
                kept_samples.append(sample)
                kept_indices.append(index)
            samples, indices = kept_samples, kept_indices
        data = self.collate_fn(samples) if samples else None
        return ElasticBatch(data=data, ticket=loaded.ticket, indices=list(indices), ids=ids, failures=failures)

    def _collated(self, loaded: LoadedRows) -> ElasticBatch:
        """A batch the source read already collated: its ids are read from the id column as a whole."""
        batch, indices = loaded.batch, list(loaded.indices)
        failures = list(loaded.failures)
        if self.id_column is None:
            return ElasticBatch(data=batch, ticket=loaded.ticket, indices=indices, failures=failures)
        try:
            column = batch[self.id_column]
        except (KeyError, TypeError, IndexError) as exc:  # as on the per-row path: every row lacks its id
            failures.extend(RowFailure(i, i, "dataset", f"id column {self.id_column!r} missing: {exc!r}", "")
                            for i in indices)
            return ElasticBatch(data=None, ticket=loaded.ticket, indices=[], ids=[], failures=failures)
        ids = column.tolist() if hasattr(column, "tolist") else [_plain(v) for v in column]
        return ElasticBatch(data=batch, ticket=loaded.ticket, indices=indices, ids=ids, failures=failures)


def _plain(value: Any) -> Any:
    """A tensor or numpy scalar id as a plain Python value, so it can be written and compared."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    return value
