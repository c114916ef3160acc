"""The demo: a byte-level GPT on the standard library's source, run through the command line
(``python -m lightning_paro.demo``); ``GPTTask`` and ``StdlibData`` are the ``_target_`` of its model and data
configs."""

from lightning_paro.demo.data import StdlibData
from lightning_paro.demo.task import GPTTask

__all__ = ["GPTTask", "StdlibData"]
