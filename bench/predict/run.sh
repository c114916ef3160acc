#!/usr/bin/env bash
# Runs the batch-prediction benchmark in a private network namespace when possible (root + unshare),
# so that nothing it starts (object store, Ray) is reachable from outside the machine.
# Usage: bash bench/predict/run.sh [run_bench.py args]          (Ray Data anchor included unless --no-ray)
#        bash bench/predict/run.sh --sources [sources_bench.py args]   (the 1M-row Parquet benchmark)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
SCRIPT=bench/predict/run_bench.py
ARGS=()
if [ "${1:-}" = --sources ]; then
  shift
  SCRIPT=bench/predict/sources_bench.py
  # the separate Ray environment is set up (from PyPI) before entering the namespace, which has no network
  case " $* " in *" --ray-python "*|*" --report "*) ;; *) "$PY" "$SCRIPT" --ensure-ray ;; esac
  ARGS=("$@")
else
  NO_RAY=0
  for a in "$@"; do [ "$a" = --no-ray ] && NO_RAY=1 || ARGS+=("$a"); done
  case " $* " in
    *" --ray-python "*) ;;
    *) if [ "$NO_RAY" = 0 ]; then
         "$PY" bench/predict/sources_bench.py --ensure-ray
         ARGS+=(--ray-python bench/predict/.ray-venv/bin/python)
       fi ;;
  esac
fi
if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && unshare --net true 2>/dev/null; then
  exec unshare --net sh -c 'ip link set lo up && exec "$@"' sh "$PY" "$SCRIPT" ${ARGS[@]+"${ARGS[@]}"}
fi
exec "$PY" "$SCRIPT" ${ARGS[@]+"${ARGS[@]}"}
