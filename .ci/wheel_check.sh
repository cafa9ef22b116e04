#!/usr/bin/env bash
# Build recursa's wheel, install it into a fresh virtual environment (no source tree on the
# path) and train the smoke example from the installed package:
#   pip wheel -> python -m venv -> CPU torch -> pip install recursa-*.whl -> recursa examples -> recursa train
# Usage: .ci/wheel_check.sh [WORK_DIR]   (default: a new temporary directory, removed at the end)
# PYTHON picks the interpreter (default python3); TORCH_SPEC the torch build (default: the CPU
# build, from /opt/wheels when that directory holds it, like the Makefile).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
WORK=${1:-$(mktemp -d)}
[ -n "${1:-}" ] || trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK"
if [ -z "${TORCH_SPEC:-}" ]; then
  if ls /opt/wheels/torch-${TORCH_VERSION}+cpu-*.whl >/dev/null 2>&1; then
    TORCH_SPEC="torch==${TORCH_VERSION} --find-links /opt/wheels"
  else
    TORCH_SPEC="torch==${TORCH_VERSION} --index-url https://download.pytorch.org/whl/cpu"
  fi
fi

# 1. The wheel, built from a copy of the tracked sources (nothing written into the checkout).
SRC="$WORK/src"; rm -rf "$SRC" "$WORK/dist"; mkdir -p "$SRC"
git -C "$REPO" ls-files -z --cached --others --exclude-standard -- pyproject.toml setup.py README.md LICENSE recursa examples \
  | (cd "$REPO" && xargs -0 cp --parents -t "$SRC")
"$PYTHON" -m venv "$WORK/build-venv"
"$WORK/build-venv/bin/python" -m pip install -q build
"$WORK/build-venv/bin/python" -m build -q --wheel --outdir "$WORK/dist" "$SRC"
WHEEL=$(ls "$WORK"/dist/recursa-*.whl)
echo "built $WHEEL"

# 2. A fresh venv: torch first (the CPU build unless TORCH_SPEC says otherwise), then the wheel.
rm -rf "$WORK/venv"
"$PYTHON" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
# shellcheck disable=SC2086
"$VPY" -m pip install -q $TORCH_SPEC
"$VPY" -m pip install -q "$WHEEL"

# 3. From a directory outside the checkout: copy the examples out of the package, train the smoke run.
RUN="$WORK/run"; rm -rf "$RUN"; mkdir -p "$RUN"
cd "$RUN"
"$WORK/venv/bin/recursa" examples ex
"$VPY" -c "import recursa, sys; assert not recursa.__file__.startswith('$REPO'), recursa.__file__; print('recursa from', recursa.__file__)"
"$WORK/venv/bin/recursa" train ex/smoke.toml --out runs/smoke
test -s runs/smoke/metrics.jsonl && test -s runs/smoke/eval/after.json
echo "wheel check passed: $(basename "$WHEEL") installed into a fresh venv trained examples/smoke.toml"
