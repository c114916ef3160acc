"""``_target_`` nodes: checked against the class they name before anything starts, then built with Hydra.

A node is a mapping whose ``_target_`` is the dotted name of a class (or function) and whose other keys are its
keyword arguments; values may be ``_target_`` nodes themselves (a dataset inside a DataLoader). The check imports
the target and compares the keys with its signature, so a typo in a class or argument name is one line naming the
key, not a traceback from inside a launched process.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import types
import typing
from typing import Any, Mapping, Optional, Sequence

from lightning_paro.cli.schema import ConfigError

HYDRA_KEYS = frozenset({"_target_", "_args_", "_partial_", "_recursive_", "_convert_"})
"""Keys of a node that are Hydra's, not arguments."""


def is_target_node(node: Any) -> bool:
    return isinstance(node, Mapping) and "_target_" in node


def locate(key: str, target: Any) -> Any:
    """The object ``target`` names, or a ConfigError naming ``key``."""
    if not isinstance(target, str) or not target.strip():
        raise ConfigError(f"{key}._target_", f"{target!r} must be the dotted name of a class, e.g. mymodule.MyModel")
    try:
        return _import(target.strip())
    except Exception as exc:  # ImportError, or whatever the module raised while being imported
        cause = exc.__cause__ or exc
        reason = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise ConfigError(
            f"{key}._target_",
            f"cannot import {target!r} ({type(cause).__name__}: {reason}); check the name, and that its module is"
            " importable from here (the working directory is on the import path; add other directories to"
            " PYTHONPATH)",
        ) from None


def _import(dotted: str) -> Any:
    """The object at ``dotted``: the longest prefix that is a module, then attributes (what Hydra's instantiate
    will look up)."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        module_name = ".".join(parts[:end])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
                continue  # no such module: the name goes on with attributes, or does not exist
            raise  # the module exists and failed to import something of its own
        break
    else:
        raise ModuleNotFoundError(f"No module named {parts[0]!r}", name=parts[0])
    for attribute in parts[end:]:
        if not hasattr(obj, attribute):
            raise ImportError(f"{'.'.join(parts[:end])!r} has no attribute {attribute!r}")
        obj = getattr(obj, attribute)
        end += 1
    return obj


def _name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _signature(obj: Any) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):  # some builtins have none: nothing to check against
        return None


def check_node(key: str, node: Any, base: Optional[type] = None, what: str = "") -> Any:
    """Checks one ``_target_`` node (and the nodes inside it); returns the located target.

    ``base``: the class the target must be (or, for a function, return: not checked); ``what`` names it in the error.
    """
    if not is_target_node(node):
        raise ConfigError(key, f"must be a mapping with a _target_ (the dotted name of {what or 'a class'}) and its"
                               f" arguments, got {node!r}")
    target = locate(key, node["_target_"])
    if base is not None and inspect.isclass(target) and not issubclass(target, base):
        raise ConfigError(f"{key}._target_", f"{_name(target)} is not {what or base.__name__}")
    arguments = {k: v for k, v in node.items() if k not in HYDRA_KEYS}
    positional = node.get("_args_") or ()
    signature = _signature(target)
    if signature is not None:
        _check_arguments(key, target, signature, arguments, len(positional), bool(node.get("_partial_")))
    for name, value in arguments.items():
        _check_nested(f"{key}.{name}", value)
    for index, value in enumerate(positional):
        _check_nested(f"{key}._args_[{index}]", value)
    return target


def _check_nested(key: str, value: Any) -> None:
    if is_target_node(value):
        check_node(key, value)
    elif isinstance(value, Mapping):
        for name, item in value.items():
            _check_nested(f"{key}.{name}", item)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_nested(f"{key}[{index}]", item)


def _check_arguments(key: str, target: Any, signature: inspect.Signature, arguments: Mapping[str, Any],
                     positional: int, partial: bool) -> None:
    params = list(signature.parameters.values())
    if inspect.isclass(target) and params and params[0].name == "self":  # a signature read from __init__
        params = params[1:]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not takes_any:
        known = {p.name for p in named}
        for name in arguments:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"did you mean {close[0]}? " if close else ""
                listed = ", ".join(p.name for p in named) or "none"
                raise ConfigError(f"{key}.{name}", f"{_name(target)} takes no argument {name!r}; {hint}its arguments"
                                                   f" are {listed}")
    _check_types(key, target, arguments)
    if partial:
        return
    by_position = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:positional]
    for p in params:
        required = p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        if required and p.name not in arguments and p not in by_position:
            raise ConfigError(f"{key}.{p.name}", f"{_name(target)} needs this argument; add +{key}.{p.name}=VALUE"
                                                 " or set it in the config")


def _type_hints(target: Any) -> dict[str, Any]:
    """The annotations of ``target``'s arguments (its ``__init__``'s for a class), resolved; none when they cannot
    be (a forward reference the module does not define): nothing is checked then."""
    try:
        return typing.get_type_hints(target.__init__ if inspect.isclass(target) else target)
    except Exception:  # noqa: BLE001  (annotations are the target's; an unresolvable one is not the user's error)
        return {}


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` (a YAML scalar, list or mapping) is of the annotated type, for the types a config value
    can be told apart by (bool, int, float, str, None and unions of them); any other annotation accepts it."""
    if hint is Any:
        return True
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True


def _type_text(hint: Any) -> str:
    """``int``, ``int or None``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_text(arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return "None"
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _check_types(key: str, target: Any, arguments: Mapping[str, Any]) -> None:
    """A value of the wrong type for an annotated argument (``model.dim=abc`` for ``dim: int``), named before the
    target is built."""
    hints = _type_hints(target)
    for name, value in arguments.items():
        if name in hints and not is_target_node(value) and not _fits(value, hints[name]):
            raise ConfigError(f"{key}.{name}", f"{value!r} is not {_type_text(hints[name])}: {_name(target)} takes"
                                               f" {name}: {_type_text(hints[name])}")


def instantiate(key: str, node: Mapping[str, Any]) -> Any:
    """The object a checked node describes. Nested containers reach it as plain dicts and lists (picklable, as the
    spawn start method needs), unless the node sets ``_convert_`` itself. A ValueError (an argument value the target
    refuses), a TypeError (an argument of a type it cannot take, where no annotation told) or an ImportError (a package
    it needs is missing) raised by the target becomes a ConfigError naming the key; anything else propagates with its
    traceback."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate

    spec = dict(node)
    spec.setdefault("_convert_", "all")
    try:
        return hydra_instantiate(spec)
    except InstantiationException as exc:
        cause = exc.__cause__
        if isinstance(cause, (ValueError, TypeError, ImportError)) and str(cause).strip():
            raise ConfigError(key, f"{node['_target_']}: {str(cause).strip().splitlines()[0]}") from cause
        raise


def check_nodes(key: str, nodes: Any, base: Optional[type], what: str) -> None:
    """A group of ``_target_`` nodes by name (callbacks, logger); a null entry is switched off."""
    if not isinstance(nodes, Mapping):
        raise ConfigError(key, f"must map names to {what} nodes (_target_ and arguments), got {nodes!r}")
    for name, node in nodes.items():
        if node is not None:
            check_node(f"{key}.{name}", node, base, what)


def instantiate_nodes(key: str, nodes: Mapping[str, Any]) -> list[Any]:
    return [instantiate(f"{key}.{name}", node) for name, node in nodes.items() if node is not None]


def closest(name: str, options: Sequence[str]) -> str:
    """``; did you mean X?`` for the option closest to ``name``, or nothing."""
    close = difflib.get_close_matches(name, list(options), n=1)
    return f"; did you mean {close[0]}?" if close else ""
