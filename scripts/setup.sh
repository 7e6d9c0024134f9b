#!/usr/bin/env bash
# Sets up everything from nothing: .venv with torch (PyTorch's CUDA 13.0 build,
# which also serves CPU-only machines) and the build of pyallreduce._C.
# Re-running it is cheap: pip skips what is installed, ninja rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.14.1" pybind11 ninja numpy pytest setuptools wheel
# CUDA kernels are built whenever a toolkit is found (setup.py finds the real CUDA
# home behind a wrapper nvcc); no GPU is needed to build or import.
MAX_JOBS=${MAX_JOBS:-2} .venv/bin/python -m pip install -q --no-build-isolation -e . 2>&1 | grep -v "^ *$" || true
.venv/bin/python -c "import pyallreduce, pyallreduce._C as C; print('pyallreduce built; CUDA kernels:', C.WITH_CUDA)"
