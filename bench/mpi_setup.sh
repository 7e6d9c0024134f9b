#!/usr/bin/env bash
# Debian's Open MPI and MPICH, and mpi4py built against each one into
# build/mpi/<name> (the two cannot share one build: their ABIs differ), for
# bench/compare_nccl.py --mpi. Idempotent: what is there is kept.
#   bash bench/mpi_setup.sh        (after scripts/setup.sh, which makes .venv)
set -euo pipefail  # pipefail: pip's status, not grep's
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
MPI4PY=${MPI4PY:-mpi4py==4.1.1}
if ! command -v mpiexec.openmpi >/dev/null || ! command -v mpiexec.mpich >/dev/null; then
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null ||
    { echo "mpi_setup.sh: install Debian's openmpi-bin libopenmpi-dev mpich libmpich-dev (needs root)" >&2; exit 1; }
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev mpich libmpich-dev >/dev/null
fi
for mpi in openmpi mpich; do
  if [ ! -d "build/mpi/$mpi/mpi4py" ]; then
    echo "== mpi4py against $mpi"
    # From source (no binary wheel, which brings an MPI of its own), with this MPI's compiler wrapper.
    MPICC=mpicc.$mpi "$PY" -m pip install -q --no-cache-dir --no-binary mpi4py --target "build/mpi/$mpi" "$MPI4PY" \
      2>&1 | { grep -v "^WARNING: Location" || true; }
  fi
  lib=$(ldd build/mpi/"$mpi"/mpi4py/MPI.*.so | grep -oE 'lib(mpi|mpich)\.so[.0-9]*' | head -1)
  echo "build/mpi/$mpi: mpi4py linked against $lib"
done
