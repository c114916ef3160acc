"""The planner's modules import one another one way: no circle, ``TYPE_CHECKING`` imports included."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_paro.planner

PACKAGE = Path(lightning_paro.planner.__file__).parent


def _imports(path: Path) -> set[str]:
    """The planner modules ``path`` imports, by module name (``choose``), wherever the import stands."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_paro.planner."):
            found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[2] for a in node.names if a.name.startswith("lightning_paro.planner."))
    return found


def test_no_import_circle_among_the_planner_modules():
    graph = {p.stem: _imports(p) for p in PACKAGE.glob("*.py") if p.stem != "__init__"}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    circles = sorted(m for m in graph if reaches(m, m, {m}))
    assert not circles, f"planner modules in an import circle: {circles}"
    assert "report" not in graph["choose"]  # the plan is made without its text
