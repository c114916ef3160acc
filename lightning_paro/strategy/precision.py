"""Precision plugins whose norm clipping reduces over the ranks that hold disjoint optimizer shards."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Union

from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.optim import Optimizer

if TYPE_CHECKING:
    from lightning_paro.strategy.engine import PaROEngine


class _ShardedClipping:
    """Mixin, listed first so its ``clip_grad_by_norm`` wins: the norm goes through the engine (value clipping is
    element-wise and needs no change)."""

    paro_engine: PaROEngine | None = None
    paro_sync_grads: Optional[Callable[[], None]] = None
    """Set by the strategy: under manual optimization, brings the gradients accumulated so far to the optimizer
    shards, which clipping reads."""

    def clip_gradients(self, optimizer: Optimizer, clip_val: Union[int, float] = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        if clip_val > 0 and self.paro_sync_grads is not None:
            self.paro_sync_grads()
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)  # type: ignore[misc]

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        if self.paro_engine is None:
            raise RuntimeError("The PaRO precision plugin is used before the strategy set up its engine.")
        self.paro_engine.clip_grad_norm_(float(clip_val), optimizer)


class PaROPrecision(_ShardedClipping, Precision):
    """``precision="32-true"`` (or 64) under the PaRO strategy."""


class PaROMixedPrecision(_ShardedClipping, MixedPrecision):
    """``precision="bf16-mixed"`` under the PaRO strategy: autocast compute, fp32 parameters, so the
    optimizer shard is the fp32 master copy."""


class PaROHalfPrecision(_ShardedClipping, HalfPrecision):
    """``precision="bf16-true"``: bf16 parameters and gradients, fp32 master weights in the optimizer shard."""


def to_paro_precision(plugin: Precision) -> Precision:
    """Return the PaRO counterpart of one of Lightning's standard precision plugins."""
    if isinstance(plugin, _ShardedClipping):
        return plugin
    if type(plugin) is Precision:
        return PaROPrecision()
    if type(plugin) is MixedPrecision:
        if plugin.scaler is not None:
            raise ValueError(
                "precision='16-mixed' needs a gradient scaler whose inf/NaN check would differ between ranks that hold"
                " different gradient shards. Use precision='bf16-mixed' with the PaRO strategy."
            )
        return PaROMixedPrecision(plugin.precision, plugin.device, plugin.scaler)
    if type(plugin) is HalfPrecision:
        return PaROHalfPrecision(plugin.precision)
    raise ValueError(
        f"The PaRO strategy does not support the precision plugin {type(plugin).__name__}. Use"
        " precision='32-true', 'bf16-mixed' or 'bf16-true'."
    )
