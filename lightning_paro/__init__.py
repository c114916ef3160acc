"""lightning-paro: PaRO-DP sharding, HO-Ring collectives and elastic batch prediction for PyTorch Lightning.

Importing the package registers ``"paro"`` (``PaROStrategy()``: ``sharding="auto"``) and one alias per strategy
(``"paro_nig"``, ``"paro_iig"``, ...: that sharding pinned) with Lightning's strategy registry, so
``Trainer(strategy="paro_iig")`` works. The classes the README uses are importable from here; the prediction ones
(``ElasticPredict``, ...) and the checkpoint helpers load on first use.
"""

from typing import Any

from lightning_paro.options_base import OptionError
from lightning_paro.planner import AutoConfig, Link
from lightning_paro.strategy.levels import VALID_STRATEGIES, ShardingSpec
from lightning_paro.strategy.options import GatherConfig, PaROOptions
from lightning_paro.strategy.strategy import PaROStrategy

__version__ = "0.1.0"

_ON_FIRST_USE = {
    "ElasticPredict": "lightning_paro.predict",
    "ElasticPredictConfig": "lightning_paro.predict",
    "read_predictions": "lightning_paro.predict",
    "load_checkpoint": "lightning_paro.convert",
    "load_from_checkpoint": "lightning_paro.convert",
}
"""Names imported when first asked for (prediction reads pyarrow; the CLI and training need neither)."""

__all__ = ["AutoConfig", "GatherConfig", "Link", "OptionError", "PaROOptions", "PaROStrategy", "ShardingSpec",
           "VALID_STRATEGIES", *_ON_FIRST_USE]


def __getattr__(name: str) -> Any:
    if name in _ON_FIRST_USE:
        import importlib

        return getattr(importlib.import_module(_ON_FIRST_USE[name]), name)
    raise AttributeError(f"module 'lightning_paro' has no attribute {name!r}")


def _register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    if "paro" not in StrategyRegistry:
        PaROStrategy.register_strategies(StrategyRegistry)


_register()
