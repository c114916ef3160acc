"""docs/config.md's tables of the typed nodes, generated from their dataclasses (``schema.py``): the default column is
each field's default, the meaning its docstring (for a ``predict`` key without one, ElasticPredict's). Regenerate with
``python -m lightning_paro.cli.reference docs/config.md``; a test checks the committed file equals the generated one."""

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

TABLES = {"strategy/paro": ("strategy", ParoStrategyConfig), "strategy/ddp": ("strategy", DDPStrategyConfig),
          "strategy/fsdp2": ("strategy", FSDP2StrategyConfig), "predict": ("predict", PredictConfig),
          "bench": ("bench", BenchConfig), "run": ("run", RunConfig)}
"""A marker's name -> the node's key and its dataclass."""
MARKER = re.compile(r"(<!-- keys: ([\w/]+) -->\n).*?(<!-- /keys -->)", re.S)


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, joined into one line."""
    docs, body = {}, ast.parse(inspect.getsource(cls)).body[0].body
    for field, doc in zip(body, body[1:]):
        if isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
            docs[field.target.id] = " ".join(str(doc.value.value).split())
    return docs


def _yaml(value: object) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def table(name: str) -> str:
    key, cls = TABLES[name]
    docs = {**(field_docs(ElasticPredictConfig) if cls is PredictConfig else {}), **field_docs(cls)}
    rows = ["| key | default | meaning |", "|---|---|---|"]
    rows += [f"| `{key}.{f.name}` | `{_yaml(f.default)}` | {docs.get(f.name, '')} |" for f in dataclasses.fields(cls)]
    return "\n".join(rows) + "\n"


def render(text: str) -> str:
    """``text`` with every ``<!-- keys: NAME -->`` ... ``<!-- /keys -->`` block generated afresh."""
    return MARKER.sub(lambda m: m.group(1) + table(m.group(2)) + m.group(3), text)


if __name__ == "__main__":
    for path in map(Path, sys.argv[1:]):
        path.write_text(render(path.read_text()))
