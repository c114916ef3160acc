"""Units: the repeated blocks of a model whose parameters are gathered, used and freed together."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable, Union

from torch import nn

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
