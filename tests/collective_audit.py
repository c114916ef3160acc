"""Check where the package puts the tensors it hands to collectives, on a machine that has only a CPU.

Two pieces, used together by ``workers/placement.py``:

* :class:`Recorder` wraps torch.distributed's collectives and point-to-point calls (batched ones included) and
  records, for every call, the devices of its tensors and the thread that issued it; for a call from another thread
  than the package's communication thread, also whether that thread was busy at the time.
* :func:`allocate_on_meta_by_default` wraps every method of the package's engine and communication classes (and the
  HO-Ring functions, and the communication and phase threads' loops) so that while package code runs, a tensor
  created without naming its device lands on the ``meta`` device instead of the CPU.

Why both: on a CPU-only machine the compute device is the CPU, so a control tensor created without a device (which
lands on the default device, the CPU) looks exactly like one placed on the compute device on purpose. On CUDA the
first would sit on the CPU, where an NCCL group cannot carry it. With package code allocating on ``meta`` by default,
such a tensor reaches the collective as a meta tensor and the recorder reports it (the collective itself then fails on
the meta tensor, so the run fails loudly either way).

What this cannot catch: tensors created by code outside the wrapped functions (Lightning, the optimizer, user code,
closures the package hands to other code), a device named explicitly but wrongly (``device="cpu"`` hard-coded), and
anything only CUDA shows (streams, NCCL itself).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import threading
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single", "gather",
               "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier")
OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list")


def _tensors(obj: Any) -> list[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dist.P2POp):
        return [obj.tensor]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors(x)]
    return []


class Recorder:
    """Record every torch.distributed call: ``(name, thread, tensor devices)``, counted, and in :attr:`beside` the
    calls issued from another thread while ``busy()`` said the communication thread was running or holding work."""

    def __init__(self, compute_device: torch.device, busy: Callable[[], bool] = lambda: False) -> None:
        self.compute_device = compute_device
        self.busy = busy
        self.calls: Counter = Counter()
        self.beside: Counter = Counter()
        self._lock = threading.Lock()

    def install(self) -> Recorder:
        for name in COLLECTIVES + OBJECT_COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(name, fn))
        return self

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self.beside.clear()

    def misplaced(self) -> list[tuple[str, str, tuple[str, ...]]]:
        """Calls that were handed a tensor on another device than the compute device."""
        want = str(self.compute_device)
        return [call for call in self.calls if any(d != want for d in call[2])]

    def _wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def recorded(*args, **kwargs):
            thread = threading.current_thread().name
            call = (name, thread, tuple(str(t.device) for t in _tensors((args, kwargs))))
            beside = thread != "paro-comm" and not thread.startswith("ho-ring") and self.busy()
            with self._lock:
                self.calls[call] += 1
                if beside:
                    self.beside[call] += 1
            if name in OBJECT_COLLECTIVES:
                # torch's staging tensors for pickled objects are torch's, not the package's: they follow the device
                # torch picks, not the audit's default.
                with torch.device(self.compute_device):
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)
        return recorded


def _on_meta(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def audited(*args, **kwargs):
        with torch.device("meta"):
            return fn(*args, **kwargs)
    return audited


def allocate_on_meta_by_default() -> list[str]:
    """Wrap the package's engine and communication code so that tensors it creates without a device are meta
    tensors. Call before any of it runs (the threads' loops are bound when the threads start). Returns what was
    wrapped."""
    from lightning_paro.comm import collectives, ho_ring
    from lightning_paro.comm.ho_ring import pipeline
    from lightning_paro.strategy import (construction, engine, evaluation, export, flat, handback, optimizer_shards,
                                         schedule, units)

    wrapped = []
    classes = (flat.FlatGroup, units.Unit, engine.PaROEngine, schedule.UnitSchedule, optimizer_shards.OptimizerShards,
               evaluation.EvaluationStages, evaluation.ShardedEvaluation, collectives.Communicator, collectives._Worker,
               ho_ring.HORingGroups, pipeline._Phase, pipeline._Job, pipeline._Lane)
    for cls in classes:
        for name, member in list(vars(cls).items()):
            if inspect.isfunction(member) and (name == "__init__" or not name.startswith("__")):
                setattr(cls, name, _on_meta(member))
                wrapped.append(f"{cls.__qualname__}.{name}")
    # HO-Ring is a package whose modules call each other's functions through their own imports: wrap every function
    # of the package in every module of it that holds it.
    ho_ring_modules = [ho_ring] + [importlib.import_module(f"{ho_ring.__name__}.{info.name}")
                                   for info in pkgutil.iter_modules(ho_ring.__path__)]
    for module, owner in [(m, ho_ring.__name__) for m in ho_ring_modules] + [(flat, flat.__name__)]:
        for name, member in list(vars(module).items()):
            if inspect.isfunction(member) and (member.__module__ == owner or member.__module__.startswith(owner + ".")):
                setattr(module, name, _on_meta(member))
                wrapped.append(f"{module.__name__}.{name}")
    # The engine's concerns live in several modules that import each other's functions: wrap each of them wherever
    # it is held.
    engine_modules = [engine, construction, schedule, optimizer_shards, evaluation, export, handback, units]
    owners = {m.__name__ for m in engine_modules}
    for module in engine_modules:
        for name, member in list(vars(module).items()):
            if inspect.isfunction(member) and member.__module__ in owners:
                setattr(module, name, _on_meta(member))
                wrapped.append(f"{module.__name__}.{name}")
    return wrapped
