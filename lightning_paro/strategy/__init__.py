"""The PaRO strategy and its sharding engine."""

from lightning_paro.strategy.levels import VALID_STRATEGIES, Level, ShardingSpec

__all__ = ["Level", "ShardingSpec", "VALID_STRATEGIES"]
