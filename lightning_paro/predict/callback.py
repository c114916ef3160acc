"""``ElasticPredict``: the Lightning callback that makes ``trainer.predict`` elastic, exactly-once and resumable."""

from __future__ import annotations

import logging
import math
import signal
import warnings
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_paro import compat
from lightning_paro.predict.batch import ElasticBatch
from lightning_paro.predict.config import ElasticPredictConfig
from lightning_paro.predict.ledger import LEASED, TODO
from lightning_paro.predict.loader import single_dataloader
from lightning_paro.predict.run import WorkerRun, wrap_predict_step

log = logging.getLogger(__name__)


class ElasticPredict(Callback):
    """Streams ``trainer.predict`` output into committed shard files, with shards leased from a ledger.

    Add it to a normal Trainer and call ``trainer.predict(model, dataloaders=loader)``: the loader's
    dataset is split into shards that this worker leases one at a time; any number of workers (plain
    processes, torchrun, a scheduler) can run the same code against the same ``output_dir`` and
    ledger. Predictions are written by a background thread and never returned or kept in memory.
    Keyword arguments are the fields of ``ElasticPredictConfig``.
    """

    def __init__(self, output_dir: str, **settings: Any) -> None:
        self.config = ElasticPredictConfig(output_dir=str(output_dir), **settings)
        self.run: Optional[WorkerRun] = None
        self.manifest: Optional[dict] = None
        self._original_step = None
        self._module: Optional[pl.LightningModule] = None
        self.batches_run = 0
        """Batches of rows this worker predicted (idle waits left out)."""
        self._batches_expected: Optional[int] = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "predict":
            return
        check_one_rank(trainer)
        # Lightning warns that it cannot force drop_last=False on a custom batch sampler; ours never drops rows
        warnings.filterwarnings("ignore", message=r".*custom batch sampler `ShardBatchSampler`.*")
        source = compat.predict_data_source(trainer)  # the dataloaders given to trainer.predict, not yet iterated
        loader = single_dataloader(source.dataloader())
        self.run = WorkerRun(self.config, loader)
        source.instance = self.run.dataloader
        self.batches_run = 0
        batch_size = int(loader.batch_size)
        # the batches of the shards left to do: this worker's share when it runs alone, an upper bound with peers
        self._batches_expected = sum(math.ceil(s.num_rows / batch_size)
                                     for s in self.run.ledger.shards(states=(TODO, LEASED)))
        # predictions go to disk; Lightning must not also collect them all in memory
        trainer.predict_loop.return_predictions = False
        self._module = pl_module
        self._original_step = pl_module.predict_step
        pl_module.predict_step = wrap_predict_step(self._original_step, self.config.row_retries)

    @override
    def on_predict_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        assert self.run is not None
        if trainer.received_sigterm:
            # a scale-down (Kubernetes, torchrun, SLURM): Lightning records SIGTERM but its predict loop runs on, so stop
            # here; on_exception hands this worker's leases back, not counted as attempts; the process exits with 143
            raise SIGTERMException(128 + signal.SIGTERM)
        self.run.on_batch_end(outputs)
        if isinstance(batch, ElasticBatch) and not batch.ticket.idle:
            self.batches_run += 1
            self.run.note_batch(batch)
        bar = _predict_bar(trainer)
        if bar is None:
            return
        # Lightning cannot know the length of a leased stream and shows n/?: give it the batches left in the job
        if self._batches_expected is not None:
            bar.total = max(self._batches_expected, batch_idx + 1)
        text = self.run.progress_text
        if text and hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(text, refresh=False)

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.run is not None
        bar = _predict_bar(trainer)
        if bar is not None:
            # ends at the batches this worker ran (waits for its peers' shards are not batches of rows)
            bar.n = bar.total = self.batches_run
            if hasattr(bar, "refresh"):
                bar.refresh()
        self.manifest = self.run.finish()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.run is not None:
            self.run.abort()
            self.run.close()
            self.run = None
        self._restore()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "predict":
            return
        if self.run is not None:
            self.run.close()
        self._restore()

    def _restore(self) -> None:
        if self._module is not None and "predict_step" in self._module.__dict__:
            del self._module.__dict__["predict_step"]
        self._module = None


class SeveralRanksError(RuntimeError):
    """``ElasticPredict`` was set up under a Trainer of several ranks (``devices=k``, ``num_nodes``)."""


def check_one_rank(trainer: pl.Trainer) -> None:
    """Refuses a Trainer of several ranks: each rank leases shards of its own, so ranks run different numbers of
    forwards (idle waits skip it, a failing batch is bisected on its rank alone), and a strategy whose forward
    holds collectives (sharded parameters gathered, synchronised batch norm) would wait for a peer that is not
    there. Independent workers of one device each share the job with no collective at all."""
    if trainer.world_size <= 1:
        return
    raise SeveralRanksError(
        f"ElasticPredict runs one worker per process, but this Trainer has {trainer.world_size} ranks "
        f"(strategy {type(trainer.strategy).__name__}), whose collectives would wait for ranks that lease other "
        f"shards. Run {trainer.world_size} independent workers instead, each with Trainer(devices=1) and the same "
        f"output_dir, each on a device of its own: e.g. `torchrun --nproc-per-node={trainer.world_size} predict.py` "
        f"with Trainer(devices=1) in the script, the script started {trainer.world_size} times, or run_replicas (docs/predict.md, Elastic "
        "workers)."
    )


def _predict_bar(trainer: pl.Trainer) -> Any:
    """The predict progress bar of Lightning's TQDM progress bar (or one like it), None without one."""
    try:
        bar = getattr(trainer.progress_bar_callback, "predict_progress_bar", None)
    except TypeError:  # Lightning's TQDM bar before its first predict batch
        return None
    return bar if bar is not None and hasattr(bar, "total") and hasattr(bar, "n") else None
