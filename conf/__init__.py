"""The package's Hydra config tree: conf/ in the repository, installed as ``lightning_paro.conf`` (``pkg://lightning_paro.conf``)."""
