"""The dataset and collate wrappers that run in DataLoader workers: per-row error capture and row ids."""

from __future__ import annotations

import math
import os
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils.data import Dataset, default_collate

from lightning_paro.predict.batch import BatchTicket, ElasticBatch, RowFailure, plain


class LoadedRows:
    """The samples of one ticket that loaded, and the rows that raised.

    A source that reads a range column by column hands over ``batch`` instead of ``samples``: the rows at
    ``indices`` already collated, as ``default_collate`` would collate their samples.
    """

    def __init__(self, ticket: BatchTicket, samples: list, indices: Sequence[int], failures: list, batch: Any = None,
                 fetch_threads: int = 0) -> None:
        self.ticket = ticket
        self.samples = samples
        self.indices = indices
        self.failures = failures
        self.batch = batch
        self.fetch_threads = fetch_threads


def compact_indices(indices: list, ticket: BatchTicket) -> Sequence[int]:
    """The loaded rows' indices, as the ticket's own range when every row of it loaded (they keep its order)."""
    return ticket.indices if len(indices) == len(ticket.indices) else indices


def load_row(dataset: Any, index: int, retries: int) -> tuple[Any, Optional[BaseException], str]:
    """``dataset[index]``, retried ``retries`` times; returns (sample, None, "") or (None, error, traceback)."""
    for attempt in range(retries + 1):
        try:
            return dataset[index], None, ""
        except Exception as exc:  # a poison row must not take the worker down: it is reported instead
            if attempt == retries:
                return None, exc, traceback.format_exc(limit=8)
    raise AssertionError("unreachable")


AUTO_FETCH_THREADS_MAX = 64
"""The most threads per DataLoader worker that ``fetch_threads=None`` (automatic) chooses."""


def thread_busy_s() -> float:
    """Seconds the calling thread has run or waited to run (its CPU time plus its wait for a CPU, from Linux's
    ``/proc/thread-self/schedstat``; elsewhere only its CPU time). What is left of a read's wall time is time the
    thread waited for something else: storage, the network, a lock."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            ran_ns, waited_ns = f.read().split()[:2]
        return (int(ran_ns) + int(waited_ns)) / 1e9
    except (OSError, ValueError):
        return time.thread_time()


class FetchTuner:
    """Chooses a DataLoader worker's fetch threads from how its batches read (``fetch_threads=None``).

    Reading a row from remote storage waits on latency, not CPU, so more rows in flight read a batch faster; rows
    that cost CPU (parsing, preprocessing) read no faster with more threads, which then only add switching.

    * More threads are tried only while the worker is the bottleneck: when it waited for its next batch's indices
      for more than :attr:`AHEAD` of the time it took to read a batch, the model (or whatever consumes the batches) is
      slower than the reading, and reading faster would gain nothing.
    * A read on one thread that kept it busy (running, or waiting for a CPU: over :attr:`BUSY` of the read's wall time)
      is bound by CPU: one thread stays. Half is the line: below it more threads could read at least twice as fast;
      above it they could not, and on a job whose reads mostly compute (decoding, tokenizing rows from a store on the
      same machine) they would take CPU from the model and the store without reading faster. One that left it idle tries as many threads as would keep it busy (the
      wall time over the busy time, rounded up to a power of two, at most ``max_threads`` and the batch's rows).
      A worker's second row is read alone for this (after its first, which pays for imports and connections), so
      a latency-bound job is at full speed from its first batch on. A read shorter than :attr:`MIN_WALL_S` says
      nothing either way: one thread stays.
    * A try is kept when its batches read at least ``gain`` times as fast (rows per second of the read) as the
      thread count it started from: at once when the first is twice that, else when the first two both are; then
      twice as many threads are tried. A try that falls short is undone and not tried again for a pause that
      doubles each time (:attr:`RETRY_AFTER` batches, at most :attr:`MAX_PAUSE`), so a job whose reads become bound by
      latency later is still found.
    """

    BUSY = 0.5
    """Share of a one-thread read's wall time that it ran or waited for a CPU, above which it is bound by CPU."""
    AHEAD = 0.25
    """Share of a read's wall time the worker may wait for its next batch and still be the bottleneck."""
    RETRY_AFTER = 8
    """Batches before a try that did not pay is made again (the first pause; each next one doubles)."""
    MAX_PAUSE = 256
    """The longest pause, in batches."""
    MIN_WALL_S = 0.002
    """Seconds under which a read decides nothing."""

    def __init__(self, max_threads: int = AUTO_FETCH_THREADS_MAX, gain: float = 1.25) -> None:
        self.max_threads = max_threads
        self.gain = gain
        self.threads = 1
        self.measured = False
        """Whether a read was recorded yet (a worker's first two rows are read alone while it is not)."""
        self._base: Optional[tuple[int, float]] = None  # (threads, rows/s) a try started from
        self._tries: list[float] = []  # the rates of the batches read in the current try
        self._pause = 0
        self._next_pause = self.RETRY_AFTER

    def choose(self, rows: int) -> int:
        """Threads to read the next batch of ``rows`` rows with."""
        return max(1, min(self.threads, rows))

    def record(self, threads: int, rows: int, wall_s: float, busy_s: Optional[float] = None,
               batch_rows: Optional[int] = None, waited_s: Optional[float] = None) -> None:
        """The read of ``rows`` rows on ``threads`` threads in ``wall_s`` seconds; on one thread, ``busy_s`` is the
        time it ran or waited to run (``thread_busy_s``); ``waited_s`` is how long the worker waited for this batch
        after the previous one; ``batch_rows`` bounds a try (default ``rows``). Decides the threads of the next read."""
        self.measured = True
        limit = min(self.max_threads, batch_rows or rows)
        if (wall_s <= 0 or threads != self.choose(rows) or (rows <= 1 and self._base is not None)
                or (batch_rows or rows) < self.threads):  # a short batch (a shard's last) says little
            return
        rate = rows / wall_s
        if self._base is not None:
            self._tries.append(rate)
            base_threads, base_rate = self._base
            if min(self._tries) >= self.gain * base_rate and (len(self._tries) >= 2 or rate >= 2 * self.gain * base_rate):
                self._base, self._tries = None, []
                self._next_pause = self.RETRY_AFTER  # paid: keep it and try twice as many at once
                if waited_s is None or waited_s <= self.AHEAD * wall_s:
                    self._try(self.threads, rate, 2 * self.threads, limit)
            elif len(self._tries) >= 2:
                self.threads = base_threads
                self._base, self._tries = None, []
                self._pause, self._next_pause = self._next_pause, min(2 * self._next_pause, self.MAX_PAUSE)
            return
        if self._pause > 0:
            self._pause -= 1
            return
        if wall_s < self.MIN_WALL_S or (waited_s is not None and waited_s > self.AHEAD * wall_s):
            return  # too quick to tell, or the batches are consumed slower than they are read
        if threads == 1 and busy_s is not None:
            if busy_s > self.BUSY * wall_s:
                return  # bound by CPU
            wanted = 2 ** math.ceil(math.log2(max(wall_s / max(busy_s, 1e-9), 2.0)))
            self._try(1, rate, wanted, limit)
        else:
            self._try(self.threads, rate, 2 * self.threads, limit)

    def _try(self, base_threads: int, base_rate: float, threads: int, limit: int) -> None:
        threads = min(threads, limit)
        if threads > base_threads:
            self._base = (base_threads, base_rate)
            self.threads = threads


class FetchPool:
    """Mixin: the fetch threads of a dataset, made in the process that uses them (a DataLoader worker) and dropped
    when the dataset is pickled or forked, as threads do not survive either. Needs ``fetch_threads`` (None chooses
    them with a ``FetchTuner``), ``_pool`` and ``_pool_pid`` set in ``__init__``."""

    fetch_threads: Optional[int]
    _pool: Optional[ThreadPoolExecutor]
    _pool_pid: int
    _pool_threads = 0
    _tuner: Optional[FetchTuner] = None
    _last_read_end: Optional[float] = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_pool"], state["_pool_pid"], state["_tuner"], state["_last_read_end"] = None, -1, None, None
        return state

    def _tuner_here(self) -> Optional[FetchTuner]:
        """This process's tuner when the threads are chosen automatically (a fork or unpickling starts afresh)."""
        if self.fetch_threads is not None:
            return None
        if self._tuner is None or self._pool_pid != os.getpid():
            self._tuner = FetchTuner()
            self._pool_pid = os.getpid()
            self._pool, self._last_read_end = None, None
        return self._tuner

    def _map(self, fn: Callable, items: Sequence) -> tuple[list, int]:
        """``[fn(item) for item in items]``, on as many threads as chosen for them; also returns that number."""
        tuner = self._tuner_here()
        if tuner is None:
            return self._timed(fn, items, self.fetch_threads, None, len(items)), self.fetch_threads
        results: list = []
        if not tuner.measured and len(items) > 3:
            # a worker's first two rows are read alone: the first pays for what is done once (imports, connections),
            # and whether the second waited or computed sets the threads of the rest
            results = self._timed(fn, items[:1], 1, None, len(items))
            results.extend(self._timed(fn, items[1:2], 1, tuner, len(items)))
            items = items[2:]
        threads = tuner.choose(len(items))
        results.extend(self._timed(fn, items, threads, tuner, len(items) + len(results)))
        return results, threads

    def _timed(self, fn: Callable, items: Sequence, threads: int, tuner: Optional[FetchTuner],
               batch_rows: int) -> list:
        start = time.perf_counter()
        if threads > 1 and len(items) > 1:
            results = list(self._executor(threads).map(fn, items))
            busy_s = None
        else:
            busy = thread_busy_s() if tuner is not None else 0.0
            results = [fn(item) for item in items]
            busy_s = thread_busy_s() - busy if tuner is not None else None
        end = time.perf_counter()
        if tuner is not None:
            # the wait for this read since the previous one ended
            waited = start - self._last_read_end if self._last_read_end is not None else None
            tuner.record(threads, len(items), end - start, busy_s, batch_rows, waited)
            self._last_read_end = end
        return results

    def _executor(self, threads: int) -> ThreadPoolExecutor:
        pool = self._pool
        if pool is None or self._pool_pid != os.getpid() or self._pool_threads != threads:
            if pool is not None and self._pool_pid == os.getpid():
                pool.shutdown(wait=False)
            self._pool = pool = ThreadPoolExecutor(threads, thread_name_prefix="lightning-paro-fetch")
            self._pool_pid, self._pool_threads = os.getpid(), threads
        return pool


class ElasticDataset(FetchPool, Dataset):
    """Wraps a map-style dataset: reads a whole ticket, capturing rows that raise instead of failing the batch.

    With ``fetch_threads > 1`` the rows of a batch are read concurrently by a thread pool in each
    DataLoader worker: reading from remote storage one object per row is bound by latency, not CPU,
    so many requests in flight per worker multiply throughput without more worker processes. With
    ``fetch_threads=None`` each worker chooses its threads as it reads (``FetchTuner``).
    """

    def __init__(self, dataset: Any, row_retries: int = 1, fetch_threads: Optional[int] = 1) -> None:
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
        loaded, threads = self._map(lambda i: load_row(self.dataset, i, self.row_retries), ticket.indices)
        for index, (sample, error, tb) in zip(ticket.indices, loaded):
            if error is None:
                samples.append(sample)
                indices.append(index)
            else:
                failures.append(RowFailure(index, index, "dataset", f"{type(error).__name__}: {error}", tb))
        return LoadedRows(ticket, samples, compact_indices(indices, ticket), failures, fetch_threads=threads)


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
                    ids.append(plain(sample[self.id_column]))
                except (KeyError, TypeError, IndexError) as exc:
                    failures.append(
                        RowFailure(index, index, "dataset", f"id column {self.id_column!r} missing: {exc!r}", "")
                    )
                    continue
                kept_samples.append(sample)
                kept_indices.append(index)
            samples = kept_samples
            indices = kept_indices if len(kept_indices) < len(indices) else indices
        data = self.collate_fn(samples) if samples else None
        return ElasticBatch(data=data, ticket=loaded.ticket, indices=indices, ids=ids, failures=failures,
                            fetch_threads=loaded.fetch_threads)

    def _collated(self, loaded: LoadedRows) -> ElasticBatch:
        """A batch the source read already collated: its ids are read from the id column as a whole."""
        batch, indices = loaded.batch, loaded.indices
        failures = list(loaded.failures)
        threads = loaded.fetch_threads
        if self.id_column is None:
            return ElasticBatch(data=batch, ticket=loaded.ticket, indices=indices, failures=failures,
                                fetch_threads=threads, by_value=True)
        try:
            column = batch[self.id_column]
        except (KeyError, TypeError, IndexError) as exc:  # as on the per-row path: every row lacks its id
            failures.extend(RowFailure(i, i, "dataset", f"id column {self.id_column!r} missing: {exc!r}", "")
                            for i in indices)
            return ElasticBatch(data=None, ticket=loaded.ticket, indices=[], ids=[], failures=failures,
                                fetch_threads=threads)
        if isinstance(column, torch.Tensor) and column.ndim == 1:
            # an array of numbers travels as one buffer, not a Python int per row; a copy, never a view of the
            # tensor: sending the batch moves the tensor's storage to shared memory and frees the memory it viewed
            ids = column.numpy().copy()
        else:
            ids = column.tolist() if hasattr(column, "tolist") else [plain(v) for v in column]
        return ElasticBatch(data=batch, ticket=loaded.ticket, indices=indices, ids=ids, failures=failures,
                            fetch_threads=threads, by_value=True)
