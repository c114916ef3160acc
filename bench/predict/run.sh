#!/usr/bin/env bash
# Runs the batch-prediction benchmark in a private network namespace when possible (root + unshare),
# so that nothing it starts (object store, Ray) is reachable from outside the machine.
# Usage: bash bench/predict/run.sh [run_bench.py args]
#        bash bench/predict/run.sh --sources [sources_bench.py args]   (the 1M-row Parquet benchmark)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
SCRIPT=bench/predict/run_bench.py
if [ "${1:-}" = --sources ]; then
  shift
  SCRIPT=bench/predict/sources_bench.py
  # the separate Ray environment is set up (from PyPI) before entering the namespace, which has no network
  case " $* " in *" --ray-python "*|*" --report "*) ;; *) "$PY" "$SCRIPT" --ensure-ray ;; esac
fi
if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && unshare --net true 2>/dev/null; then
  exec unshare --net sh -c 'ip link set lo up && exec "$@"' sh "$PY" "$SCRIPT" "$@"
fi
exec "$PY" "$SCRIPT" "$@"
