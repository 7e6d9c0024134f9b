#!/usr/bin/env bash
# Sets up everything from nothing: .venv with torch (PyTorch's CUDA 13.0 build,
# which also serves CPU-only machines) and the build of pyallreduce._C.
# Re-running it is cheap: what is installed and built is checked, not redone;
# after a source change ninja recompiles only what changed (setup.py keeps the
# objects in build/temp).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, pybind11, ninja, numpy, pytest, setuptools, wheel
assert torch.__version__.split('+')[0] == '2.14.1' and int(setuptools.__version__.split('.')[0]) >= 77" 2>/dev/null; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.14.1" pybind11 ninja numpy pytest "setuptools>=77" wheel
fi
# The build's inputs: a change to any of them (sources, build switches, torch)
# rebuilds; nothing changed and the extension imports: nothing to do.
inputs=$( (cat setup.py pyproject.toml; find csrc -type f | sort | xargs cat
           .venv/bin/python -c "import torch; print(torch.__version__)"
           env | grep -E '^(PYALLREDUCE_SKIP_CUDA|PYALLREDUCE_CUDA_ARCH_LIST|CUDA_HOME|CUDA_PATH|NVCC_THREADS)=' | sort || true
          ) | sha256sum | cut -d' ' -f1)
stamp=build/setup-inputs.sha256
if [ "$(cat "$stamp" 2>/dev/null)" = "$inputs" ] && .venv/bin/python -c "import pyallreduce._C" 2>/dev/null; then
  echo "pyallreduce: the build is up to date (nothing to compile)"
else
  # CUDA kernels are built whenever a toolkit is found (setup.py finds the real CUDA
  # home behind a wrapper nvcc); no GPU is needed to build or import.
  # The stamp only after a build that succeeded (pipefail: pip's status, not grep's).
  mkdir -p build && rm -f "$stamp"
  MAX_JOBS=${MAX_JOBS:-2} .venv/bin/python -m pip install -q --no-build-isolation -e . 2>&1 | { grep -v "^ *$" || true; }
  echo "$inputs" > "$stamp"
fi
.venv/bin/python -c "import pyallreduce, pyallreduce._C as C; print('pyallreduce built; CUDA kernels:', C.WITH_CUDA)"
