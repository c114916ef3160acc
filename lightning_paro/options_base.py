"""The option error and checks that the strategy's options (``strategy/options.py``) and ``sharding="auto"``'s
options (``planner/job.py``) both raise and use. A leaf: it imports nothing of the package, so either side reads it
without importing the other."""

from __future__ import annotations

from typing import Any


class OptionError(ValueError):
    """An option value that cannot work; ``option`` names it, the message says what to pass instead."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


def is_count(value: Any, least: int) -> bool:
    """Whether ``value`` is an integer (not a bool) of at least ``least``."""
    return not isinstance(value, bool) and isinstance(value, int) and value >= least
