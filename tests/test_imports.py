"""Every module of the package imports (the quick tier's way of touching each one), and the option types both the
strategy and the planner read live in a leaf module, so that neither imports the other for them."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import lightning_paro

PACKAGE = Path(lightning_paro.__file__).resolve().parent
MODULES = sorted(m.name for m in pkgutil.walk_packages([str(PACKAGE)], "lightning_paro.")
                 if not m.name.endswith("__main__"))  # the entry points run their command when imported


def _package_imports(path: Path) -> set[str]:
    """The ``lightning_paro`` modules a file imports, ``TYPE_CHECKING`` blocks and function bodies included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_paro"):
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("lightning_paro")}
    return found


def test_the_package_has_the_modules_the_walk_finds():
    assert len(MODULES) > 50 and "lightning_paro.options_base" in MODULES and "lightning_paro.compat" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_every_module_imports(name):
    assert importlib.import_module(name).__name__ == name


def test_the_option_types_are_a_leaf_that_strategy_and_planner_both_read():
    assert _package_imports(PACKAGE / "options_base.py") == set()
    job = _package_imports(PACKAGE / "planner" / "job.py")
    options = _package_imports(PACKAGE / "strategy" / "options.py")
    assert "lightning_paro.options_base" in job and "lightning_paro.options_base" in options
    assert not any(name.startswith("lightning_paro.strategy.options") for name in job)
    from lightning_paro.strategy import options

    assert options.OptionError is lightning_paro.OptionError  # one class, wherever it is imported from


def test_the_quick_tier_lists_existing_tests_and_imports_every_module():
    root = PACKAGE.parent
    listed = [line.strip() for line in (root / "tests" / "quick.txt").read_text().splitlines()
              if line.strip() and not line.lstrip().startswith("#")]
    assert "tests/test_imports.py" in listed  # every module, touched
    assert all((root / path.split("::")[0]).is_file() for path in listed), listed
    assert "--quick" in (root / "scripts" / "test.sh").read_text()
