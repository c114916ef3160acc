#!/usr/bin/env bash
# Runs the batch-prediction benchmark in a private network namespace when possible (root + unshare),
# so that nothing it starts (object store, Ray) is reachable from outside the machine.
# Usage: bash bench/predict/run.sh [run_bench.py args]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && unshare --net true 2>/dev/null; then
  exec unshare --net sh -c 'ip link set lo up && exec "$@"' sh "$PY" bench/predict/run_bench.py "$@"
fi
exec "$PY" bench/predict/run_bench.py "$@"
