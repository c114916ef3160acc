"""Elastic, exactly-once, resumable batch prediction for ``Trainer.predict``."""

from lightning_paro.predict.builtin_sources import JsonlSource, ParquetSource, PathSource, TextSource
from lightning_paro.predict.callback import ElasticPredict
from lightning_paro.predict.config import ElasticPredictConfig
from lightning_paro.predict.db import LedgerUnavailableError
from lightning_paro.predict.ledger import JobMismatchError, Ledger
from lightning_paro.predict.manifest import JobIncompleteError
from lightning_paro.predict.pipeline import PipelineReport, PipelineStage, PipelineStageError, run_pipeline
from lightning_paro.predict.progress import JobProgress, read_progress
from lightning_paro.predict.results import iter_predictions, read_errors, read_predictions
from lightning_paro.predict.shard_files import OutputNotWritableError
from lightning_paro.predict.sources import ShardedSource, SourceUnit
from lightning_paro.predict.supervisor import ReplicaContext, ReplicaFailedError, ReplicaReport, run_replicas
from lightning_paro.predict.writer import ErrorBudgetExceededError

__all__ = [
    "ElasticPredict",
    "ElasticPredictConfig",
    "ErrorBudgetExceededError",
    "JobIncompleteError",
    "JobMismatchError",
    "JsonlSource",
    "JobProgress",
    "Ledger",
    "LedgerUnavailableError",
    "OutputNotWritableError",
    "ParquetSource",
    "PathSource",
    "PipelineReport",
    "PipelineStage",
    "PipelineStageError",
    "ReplicaContext",
    "ReplicaFailedError",
    "ReplicaReport",
    "ShardedSource",
    "SourceUnit",
    "TextSource",
    "iter_predictions",
    "read_errors",
    "read_predictions",
    "read_progress",
    "run_pipeline",
    "run_replicas",
]
