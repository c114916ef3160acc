"""Rebuilds the user's predict DataLoader around the shard sampler, keeping its reading settings."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Iterator, Optional

from torch.utils.data import DataLoader, IterableDataset, default_collate

from lightning_paro.predict.dataset import ElasticCollate, ElasticDataset
from lightning_paro.predict.sampler import ShardBatchSampler
from lightning_paro.predict.sources import SourceDataset, SourceLayout, UnitRetry, is_sharded_source


log = logging.getLogger(__name__)

_END = object()


class UnsupportedDataLoaderError(ValueError):
    """The predict dataloader cannot be driven by leased shards."""


def single_dataloader(dataloaders: Any) -> DataLoader:
    """The one DataLoader behind what was passed to ``trainer.predict``, or a clear error."""
    if isinstance(dataloaders, (list, tuple)):
        if len(dataloaders) != 1:
            raise UnsupportedDataLoaderError(
                f"ElasticPredict drives exactly one predict dataloader, got {len(dataloaders)}; run one job per dataset."
            )
        dataloaders = dataloaders[0]
    if not isinstance(dataloaders, DataLoader):
        raise UnsupportedDataLoaderError(
            f"ElasticPredict needs a torch DataLoader over a map-style dataset, got {type(dataloaders).__name__}."
        )
    if isinstance(dataloaders.dataset, IterableDataset) and not is_sharded_source(dataloaders.dataset):
        raise UnsupportedDataLoaderError(
            "ElasticPredict shards the dataset's index space, so it needs a map-style dataset (with __len__ and "
            "__getitem__), not an IterableDataset. For data stored as files or objects, use a sharded source: "
            "ParquetSource, JsonlSource, TextSource, PathSource, or your own with units() and read(unit, start, stop) "
            "(docs/predict.md, Sources)."
        )
    if dataloaders.batch_size is None:
        raise UnsupportedDataLoaderError(
            "ElasticPredict needs a DataLoader built with batch_size=...; its own sampler decides which rows "
            "each batch holds, so a custom batch_sampler cannot be used."
        )
    return dataloaders


def sharded_dataloader(
    loader: DataLoader,
    sampler: ShardBatchSampler,
    id_column: Optional[str],
    row_retries: int,
    fetch_threads: Optional[int] = 1,
    layout: Optional[SourceLayout] = None,
    unit_retry: Optional[UnitRetry] = None,
) -> DataLoader:
    """A DataLoader with ``loader``'s reading settings whose batches come from leased shards.

    With ``layout`` the dataset is a sharded source, read a unit range at a time instead of row by row; when the
    loader collates with ``default_collate`` (no ``collate_fn`` given) and the source can read a range as a
    batch (``read_batch``), batches are read that way. A ``collate_fn`` of the user's expects rows, so it gets rows.
    ``unit_retry`` says how a source unit that cannot be read is retried.
    """
    workers = loader.num_workers
    if layout is None:
        dataset = ElasticDataset(loader.dataset, row_retries=row_retries, fetch_threads=fetch_threads)
    else:
        dataset = SourceDataset(loader.dataset, layout, row_retries=row_retries, fetch_threads=fetch_threads,
                                batched=loader.collate_fn is default_collate, unit_retry=unit_retry)
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=workers,
        collate_fn=ElasticCollate(loader.collate_fn, id_column),
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        prefetch_factor=loader.prefetch_factor if workers > 0 else None,
        # a job's DataLoader iterates once; persistent workers would only outlive it
        persistent_workers=False,
        pin_memory_device=loader.pin_memory_device,
        in_order=True,
    )


class BackgroundLoader:
    """Iterates a DataLoader on a thread of its own, up to ``depth`` batches ahead of the model's thread.

    What happens between two batches when a DataLoader is iterated on the model's thread happens on this thread
    instead, while the model computes: receiving the batch from a DataLoader worker (unpickling it, and for each
    tensor a handshake with the worker whose shared memory holds it) and, at a shard's end, leasing the next shard
    (the shard sampler runs when the DataLoader asks it for indices). The model's thread only takes a batch that
    is ready. Lightning takes this object as a plain iterable, so it does not rebuild it either (Lightning rebuilds
    a predict DataLoader around a sampler wrapper that keeps every batch's indices until the run ends).
    """

    def __init__(self, loader: DataLoader, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self.loader = loader
        self.depth = depth
        self._lock = threading.Lock()
        self._active: Optional[tuple[threading.Thread, threading.Event, queue.Queue]] = None

    def __iter__(self) -> Iterator[Any]:
        # a generator: nothing starts until the first batch is asked for (Lightning calls iter() once just to check)
        return self._batches()

    def _batches(self) -> Iterator[Any]:
        self.close()
        # the DataLoader's iterator is made on the calling thread, as without this class (torch installs its
        # handler for DataLoader workers that die only from the main thread); only next() runs on the other one
        iterator = iter(self.loader)
        halt = threading.Event()
        ready: queue.Queue = queue.Queue(maxsize=self.depth)
        thread = threading.Thread(target=_pump, args=(iterator, ready, halt), name="lightning-paro-loader",
                                  daemon=True)
        del iterator  # the thread holds the only reference: the DataLoader workers stop when it ends
        with self._lock:
            self._active = (thread, halt, ready)
        thread.start()
        try:
            while True:
                try:
                    item = ready.get(timeout=1.0)
                except queue.Empty:
                    if not thread.is_alive() and ready.empty():
                        raise RuntimeError("the prediction data loader thread stopped unexpectedly") from None
                    continue
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.error
                yield item
        finally:
            self.close()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stops the thread of the current iteration (after the batch it is receiving, if any)."""
        with self._lock:
            active, self._active = self._active, None
        if active is None:
            return
        thread, halt, ready = active
        halt.set()
        _drain(ready)
        if thread is not threading.current_thread():
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("the prediction data loader thread did not stop within %.0f s", timeout_s)
        _drain(ready)


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def _drain(ready: queue.Queue) -> None:
    try:
        while True:
            ready.get_nowait()
    except queue.Empty:
        pass


def _put(ready: queue.Queue, item: Any, halt: threading.Event) -> bool:
    while not halt.is_set():
        try:
            ready.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _pump(iterator: Iterator[Any], ready: queue.Queue, halt: threading.Event) -> None:
    try:
        for batch in iterator:
            if not _put(ready, batch, halt):
                return
        _put(ready, _END, halt)
    except BaseException as exc:  # handed to the model's thread, which raises it
        _put(ready, _Failure(exc), halt)
