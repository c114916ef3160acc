"""Rebuilds the user's predict DataLoader around the shard sampler, keeping its reading settings."""

from __future__ import annotations

from typing import Any, Optional

from torch.utils.data import DataLoader, IterableDataset, default_collate

from lightning_paro.predict.dataset import ElasticCollate, ElasticDataset
from lightning_paro.predict.sampler import ShardBatchSampler
from lightning_paro.predict.sources import SourceDataset, SourceLayout, is_sharded_source


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
    fetch_threads: int = 1,
    layout: Optional[SourceLayout] = None,
) -> DataLoader:
    """A DataLoader with ``loader``'s reading settings whose batches come from leased shards.

    With ``layout`` the dataset is a sharded source, read a unit range at a time instead of row by row; when the
    loader collates with ``default_collate`` (no ``collate_fn`` given) and the source can read a range as a
    batch (``read_batch``), batches are read that way. A ``collate_fn`` of the user's expects rows, so it gets rows.
    """
    workers = loader.num_workers
    if layout is None:
        dataset = ElasticDataset(loader.dataset, row_retries=row_retries, fetch_threads=fetch_threads)
    else:
        dataset = SourceDataset(loader.dataset, layout, row_retries=row_retries, fetch_threads=fetch_threads,
                                batched=loader.collate_fn is default_collate)
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
