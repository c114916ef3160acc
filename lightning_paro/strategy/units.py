"""Units: the repeated blocks of a model whose parameters are gathered, used and freed together; which submodules
they are (:func:`find_units`) and the unit the engine drives (:class:`Unit`)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable, Union

from torch import nn

from lightning_paro.comm.collectives import CommHandle
from lightning_paro.strategy.flat import FlatGroup
from lightning_paro.strategy.levels import Level

UnitPolicy = Union[str, Iterable[type], Callable[[str, nn.Module], bool], None]
"""``"auto"`` (or None), a collection of module classes, or a predicate ``(qualified_name, module) -> bool``."""


def find_units(model: nn.Module, policy: UnitPolicy = "auto") -> list[tuple[str, nn.Module]]:
    """Pick the submodules that become units, outermost first and in registration order.

    ``"auto"`` finds the module class that repeats (two or more instances, each holding parameters and submodules)
    and covers the most parameters: the transformer blocks of a transformer, the residual stages of a ResNet.
    A model without such a class has no units; all its parameters then live in the root unit.
    """
    if policy is None or policy == "auto":
        match = _auto_policy(model)
    elif isinstance(policy, str):
        raise ValueError(f"Unknown unit policy {policy!r}: use 'auto', a list of module classes or a predicate.")
    elif callable(policy) and not isinstance(policy, type):
        match = policy
    else:
        classes = tuple(policy)
        if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise TypeError(f"Unit policy must list nn.Module subclasses, got {classes!r}.")
        match = lambda _name, mod: isinstance(mod, classes)  # noqa: E731
    units: list[tuple[str, nn.Module]] = []
    for name, mod in model.named_modules():
        if mod is model or not name:
            continue
        if any(name.startswith(u + ".") for u, _ in units):
            continue  # nested inside a unit already taken: the outer one wins
        if match(name, mod):
            units.append((name, mod))
    return units


def _auto_policy(model: nn.Module) -> Callable[[str, nn.Module], bool]:
    by_class: dict[type, list[nn.Module]] = OrderedDict()
    for name, mod in model.named_modules():
        if mod is model or not name or not any(True for _ in mod.children()):
            continue
        if not any(True for _ in mod.parameters()):
            continue
        by_class.setdefault(type(mod), []).append(mod)
    best, best_cover = None, 0
    for cls, mods in by_class.items():
        if len(mods) < 2:
            continue
        cover = sum(p.numel() for p in {id(p): p for m in mods for p in m.parameters()}.values())
        if cover > best_cover:
            best, best_cover = cls, cover
    if best is None:
        return lambda _name, _mod: False
    return lambda _name, mod: type(mod) is best


class Unit:
    """A module whose parameters are gathered and freed together, with its flat groups."""

    def __init__(self, name: str, module: nn.Module, flats: list[FlatGroup]) -> None:
        self.name = name
        self.module = module
        self.flats = flats
        self.gather_handles: list[CommHandle] = []
        self.backward_started = False
        self.backward_done = False

    @property
    def sharded_params(self) -> bool:
        return any(f.spec.params != Level.N for f in self.flats)

    @property
    def trainable(self) -> bool:
        return any(f.trainable for f in self.flats)

    def wait_param_sync(self) -> None:
        for f in self.flats:
            f.wait_param_sync()

    def gather(self, async_op: bool) -> None:
        """Start (or finish) gathering this unit's parameters."""
        if not self.gather_handles and not all(f.gathered for f in self.flats):
            handles = [f.gather_params(async_op=True) for f in self.flats]
            self.gather_handles = [h for h in handles if h is not None]
        if not async_op:
            self.wait_gather()

    def wait_gather(self) -> None:
        # Each handle answers for its own collective: a failed gather raises here instead of leaving a flat group
        # marked gathered over memory that holds no parameters.
        handles, self.gather_handles = self.gather_handles, []
        for handle in handles:
            handle.wait()

    def ensure_ready(self) -> None:
        self.wait_param_sync()
        self.gather(async_op=False)

    def free(self) -> None:
        self.wait_gather()
        for f in self.flats:
            f.free_params()

    def pre_backward(self) -> None:
        if self.backward_started:
            return
        self.backward_started = True
        self.ensure_ready()
        for f in self.flats:
            f.prepare_grads()

    def post_backward(self, free: bool, previous: Unit | None = None) -> bool:
        """After this unit's backward: reduce its gradients (G != N) and free its parameters (``free``). Returns
        whether it ran (once per micro-step). ``previous``: the unit whose reduction was issued last; it is waited
        for first, so at most one unit's gradients are in flight while the next ones are flattened (a reduction
        slower than compute would otherwise pile up a full gradient per unit)."""
        if self.backward_done or not self.backward_started:
            return False
        self.backward_done = True
        if previous is not None and previous is not self:
            previous.wait_reduce()
        for f in self.flats:
            f.reduce_grads()
        if free:
            self.free()
        return True

    def wait_reduce(self) -> None:
        for f in self.flats:
            if f.pending_reduce is not None:
                f.pending_reduce.wait()
                f.pending_reduce = None


def wait_all(units: list[Unit]) -> None:
    """Wait for every collective of ``units`` in flight: parameter syncs, gathers and gradient reductions."""
    for unit in units:
        unit.wait_param_sync()
        unit.wait_gather()
        unit.wait_reduce()
