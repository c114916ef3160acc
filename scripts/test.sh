#!/usr/bin/env bash
# Sets up the environment and runs the whole test suite: `bash scripts/test.sh [pytest args]`.
# `bash scripts/test.sh --quick [pytest args]`: only the quick tier, the tests listed in tests/quick.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1
if [ "${1:-}" = "--quick" ]; then
  shift
  mapfile -t quick < <(grep -v '^\s*\(#\|$\)' tests/quick.txt)
  exec python -m pytest -q "${quick[@]}" "$@"
fi
exec python -m pytest -q "$@"
