"""lightning-paro: PaRO-DP sharding, HO-Ring collectives and elastic batch prediction for PyTorch Lightning."""

__version__ = "0.1.0"
