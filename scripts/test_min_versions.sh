#!/usr/bin/env bash
# Runs a fast part of the test suite against the lowest versions pyproject.toml declares for the runtime
# dependencies: `bash scripts/test_min_versions.sh [pytest args]`.
#
# The environment (.venv-min) is layered on the project's .venv: a .pth file makes .venv's packages visible, and the
# lowest versions are installed into .venv-min itself, which Python searches first. torch is not reinstalled: its
# lower bound is the version scripts/env.sh installs (2.13, a large wheel), which the layered environment sees.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
BASE=.venv/bin/python
MIN=.venv-min

# the lower bounds, read from pyproject.toml: NAME>=VERSION -> NAME==VERSION
mapfile -t PINS < <("$BASE" - <<'EOF'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
for dep in deps:
    m = re.match(r"^([A-Za-z0-9_.-]+)>=([0-9][^,;\s]*)", dep)
    if m and m.group(1) != "torch":
        print(f"{m.group(1)}=={m.group(2)}")
EOF
)
TORCH_FLOOR=$("$BASE" -c "import re, tomllib; print(next(re.match(r'torch>=([^,;]+)', d).group(1) for d in tomllib.load(open('pyproject.toml','rb'))['project']['dependencies'] if d.startswith('torch>=')))")
TORCH_HERE=$("$BASE" -c "import torch; print(torch.__version__.split('+')[0])")
case "$TORCH_HERE" in
  "$TORCH_FLOOR"|"$TORCH_FLOOR".*) ;;
  *) echo "torch $TORCH_HERE in .venv is not the declared lower bound $TORCH_FLOOR: run with TORCH_VERSION=$TORCH_FLOOR" >&2
     exit 1 ;;
esac

rm -rf "$MIN"
"$BASE" -m venv --without-pip "$MIN"
SITE=$("$MIN/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$BASE" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$SITE/_project_venv.pth"
echo "installing into $MIN: ${PINS[*]}"
"$BASE" -m pip --python "$MIN/bin/python" install -q --no-deps "${PINS[@]}"
"$BASE" -m pip --python "$MIN/bin/python" install -q --no-deps --no-build-isolation -e .
"$MIN/bin/python" - <<'EOF'
import importlib.metadata as md
names = ["torch", "lightning", "torchmetrics", "hydra-core", "omegaconf", "pyarrow", "typing_extensions"]
print("versions under test:", ", ".join(f"{n} {md.version(n)}" for n in names))
EOF

export OMP_NUM_THREADS=1
exec "$MIN/bin/python" -m pytest -q -p no:cacheprovider \
  tests/test_compat.py tests/cli/test_config.py tests/cli/test_progress.py tests/strategy/test_levels.py \
  tests/strategy/test_errors.py tests/predict/test_predict_end_to_end.py tests/predict/test_predict_open_formats.py \
  "tests/cli/test_cli_end_to_end.py::test_fit_checkpoint_predict" "$@"
