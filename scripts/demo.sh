#!/usr/bin/env bash
# Sets up the environment and runs the demo: `bash scripts/demo.sh [demo args]`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1
exec python -m lightning_paro.demo "$@"
