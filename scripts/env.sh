#!/usr/bin/env bash
# Creates (once) the project's virtual environment in .venv and installs the package into it.
# torch is pinned first and explicitly: an open range would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.lightning-paro-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip >/dev/null
  python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
  python -m pip install -q -e ".[test]"
  touch "$stamp"
fi
