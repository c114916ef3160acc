"""Peak memory of this process over a stretch of a run, for the ``bench`` command.

On CUDA it is the caching allocator's high-water mark of allocated bytes (``torch.cuda.max_memory_allocated``). On
the CPU it is the resident set's high-water mark (``VmHWM``), reset through ``/proc/self/clear_refs``; glibc keeps
freed memory resident unless the allocation was mmapped, and raises its mmap threshold as large blocks are freed, so
the threshold is fixed first (:func:`fix_mmap_threshold`): every tensor from that size up is mapped on allocation and
returned to the system on free, and the high-water mark follows the tensors alive at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch

M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number for the mmap threshold (``malloc.h``)."""
MMAP_THRESHOLD_BYTES = 128 * 1024
"""The threshold fixed for a memory measurement: glibc's own starting value, kept from moving up."""


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` for the rest of this process. False where it cannot (not glibc)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, int(nbytes)))


def _status_kib(field: str, status: Path = Path("/proc/self/status")) -> Optional[int]:
    try:
        for line in status.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def resident_bytes() -> Optional[int]:
    """This process's resident set now (None where /proc is not readable)."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def reset_peak(device: torch.device) -> None:
    """Start a new high-water mark at what is resident (CPU) or allocated (CUDA) now."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")  # "5": reset the peak resident set size (Linux 4.0+)
    except OSError:
        pass


def peak_bytes(device: torch.device) -> Optional[int]:
    """The high-water mark since the last :func:`reset_peak` (None where it cannot be read)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


class PeakMemory(L.Callback):
    """Records this rank's peak memory during training (from the start of the first training batch to the end of
    training, before the strategy's teardown) and during evaluation (a ``validate`` or ``test`` stage run outside
    fit), each from a fresh high-water mark."""

    def __init__(self) -> None:
        self.process_resident = resident_bytes()
        """Resident bytes when this callback was made: the interpreter and the imported framework, before the model
        (on CUDA too: the host side)."""
        self.train_peak: Optional[int] = None
        self.eval_peak: Optional[int] = None
        self.setup_resident: Optional[int] = None
        """Resident bytes at the start of training: the process, the framework and whatever the model holds."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.setup_resident = resident_bytes() if trainer.strategy.root_device.type != "cuda" else (
            int(torch.cuda.memory_allocated(trainer.strategy.root_device)))
        reset_peak(trainer.strategy.root_device)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.train_peak = peak_bytes(trainer.strategy.root_device)

    @staticmethod
    def _evaluating(trainer: L.Trainer) -> bool:
        return trainer.state.fn in ("validate", "test")  # a stage of its own, not fit's validation loop

    def _eval_start(self, trainer: L.Trainer) -> None:
        if self._evaluating(trainer):
            reset_peak(trainer.strategy.root_device)

    def _eval_end(self, trainer: L.Trainer) -> None:
        if self._evaluating(trainer):
            self.eval_peak = peak_bytes(trainer.strategy.root_device)

    def on_validation_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._eval_start(trainer)

    def on_validation_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._eval_end(trainer)

    def on_test_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._eval_start(trainer)

    def on_test_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._eval_end(trainer)
