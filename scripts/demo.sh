#!/usr/bin/env bash
# Sets up from nothing and runs the main job: an all-reduce across local ranks,
# validated against the reference collective (NCCL on GPU, gloo on CPU) and timed,
# nccl-tests style. Extra arguments go to bench/compare_nccl.py (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python bench/compare_nccl.py --nproc "${NPROC:-2}" --sizes 256:16M --dtypes float32 --ops sum "$@"
