#!/usr/bin/env bash
# The checks one GPU can run (under 10 minutes; see scripts/gpu_check.py): bf16-mixed and bf16-true fit with sharded
# save and resume under NCCL, the default backend, the engine's device placement, elastic predict on CUDA.
# Prints one line per check and a last summary line: "gpu_check: PASS 5/5 ..." or "gpu_check: FAIL <checks> ...".
#
# Runs with the first Python that has a CUDA build of torch: $PYTHON, else .venv/bin/python, else python3. The
# package is taken from this checkout (PYTHONPATH), so it needs torch, lightning, pyarrow and hydra-core installed,
# not the package itself. Extra arguments go to the Python script (--cpu runs the same checks on the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
has_cuda_torch() { "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for candidate in .venv/bin/python python3; do
    if command -v "$candidate" >/dev/null && has_cuda_torch "$candidate"; then PY=$candidate; break; fi
  done
  PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONWARNINGS=ignore
exec timeout 600 "$PY" scripts/gpu_check.py "$@"
