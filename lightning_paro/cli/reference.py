"""docs/config.md's tables of the typed nodes, generated from their dataclasses (``schema.py``): the default column is
each field's default, the meaning its docstring or, for a key without one, the docstring of the library's option of
that name (``PaROOptions``, ``ElasticPredictConfig``). Regenerate with ``python -m lightning_paro.cli.reference
docs/config.md``; a test checks the committed file equals the generated one."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
from pathlib import Path

from lightning_paro.cli.schema import (
    BenchConfig,
    DDPStrategyConfig,
    FSDP2StrategyConfig,
    ParoStrategyConfig,
    PredictConfig,
    RunConfig,
)
from lightning_paro.predict.config import ElasticPredictConfig
from lightning_paro.strategy.options import PaROOptions

TABLES = {"strategy/paro": ("strategy", ParoStrategyConfig, PaROOptions),
          "strategy/ddp": ("strategy", DDPStrategyConfig, None), "strategy/fsdp2": ("strategy", FSDP2StrategyConfig, None),
          "predict": ("predict", PredictConfig, ElasticPredictConfig), "bench": ("bench", BenchConfig, None),
          "run": ("run", RunConfig, None)}
"""A marker's name -> the node's key, its dataclass and the library's options it passes on."""
MARKER = re.compile(r"(<!-- keys: ([\w/]+) -->\n).*?(<!-- /keys -->)", re.S)


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, joined into one line, in Markdown's backticks."""
    docs, body = {}, ast.parse(inspect.getsource(cls)).body[0].body
    for field, doc in zip(body, body[1:]):
        if isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
            docs[field.target.id] = " ".join(str(doc.value.value).replace("``", "`").split())
    return docs


def _yaml(value: object) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def table(name: str) -> str:
    key, cls, library = TABLES[name]
    docs = {**(field_docs(library) if library else {}), **field_docs(cls)}
    rows = ["| key | default | meaning |", "|---|---|---|"]
    rows += [f"| `{key}.{f.name}` | `{_yaml(f.default)}` | {docs.get(f.name, '')} |" for f in dataclasses.fields(cls)]
    return "\n".join(rows) + "\n"


def render(text: str) -> str:
    """``text`` with every ``<!-- keys: NAME -->`` ... ``<!-- /keys -->`` block generated afresh."""
    return MARKER.sub(lambda m: m.group(1) + table(m.group(2)) + m.group(3), text)


if __name__ == "__main__":
    for path in map(Path, sys.argv[1:]):
        path.write_text(render(path.read_text()))
