"""The command line: ``python -m lightning_paro fit|predict|bench`` (or ``lightning-paro``) over the Hydra config
tree in ``conf/``. See docs/config.md for every key."""

from lightning_paro.cli.compose import load_config
from lightning_paro.cli.main import main
from lightning_paro.cli.schema import Config, ConfigError

__all__ = ["Config", "ConfigError", "load_config", "main"]
