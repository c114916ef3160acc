"""lightning-paro: PaRO-DP sharding, HO-Ring collectives and elastic batch prediction for PyTorch Lightning.

Importing the package registers ``"paro"`` and one alias per strategy (``"paro_nig"``, ``"paro_iig"``, ...) with
Lightning's strategy registry, so ``Trainer(strategy="paro_iig")`` works.
"""

from lightning_paro.strategy.levels import VALID_STRATEGIES, ShardingSpec
from lightning_paro.strategy.options import GatherConfig, PaROOptions
from lightning_paro.strategy.strategy import PaROStrategy

__version__ = "0.1.0"
__all__ = ["GatherConfig", "PaROOptions", "PaROStrategy", "ShardingSpec", "VALID_STRATEGIES"]


def _register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    if "paro" not in StrategyRegistry:
        PaROStrategy.register_strategies(StrategyRegistry)


_register()
