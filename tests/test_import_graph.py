"""The package's modules import one another one way: no circle anywhere in ``lightning_paro``, imports under
``TYPE_CHECKING`` and inside functions included, read from the source with ``ast`` (so nothing is imported to check
it). A package's ``__init__`` re-exports what its modules define, so an import of a package counts for the module
it names inside it, if any, and otherwise for nothing."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_paro

ROOT = Path(lightning_paro.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """Module name -> the package's (non-``__init__``) modules it imports."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        if path.name == "__init__.py":
            continue
        package = name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in mods:
                    target = target.rsplit(".", 1)[0] if "." in target else ""
                if target and target != name and mods[target].name != "__init__.py":
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_in_the_package():
    graph = import_graph()
    assert len(graph) > 100 and graph["lightning_paro.strategy.engine"]  # the walk found the package
    assert circles(graph) == []


def test_the_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_the_engine_pieces_do_not_import_the_engine():
    """The engine is a facade over its pieces: none of them imports it back."""
    graph = import_graph()
    engine = "lightning_paro.strategy.engine"
    pieces = ["units", "schedule", "optimizer_shards", "evaluation", "export", "handback", "construction", "flat",
              "modes"]
    for piece in pieces:
        assert engine not in graph[f"lightning_paro.strategy.{piece}"], piece
