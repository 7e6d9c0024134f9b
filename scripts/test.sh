#!/usr/bin/env bash
# Sets up from nothing (scripts/setup.sh) and runs the whole test suite (the
# full tier, what CI runs). Arguments go to pytest: --quick runs the quick tier
# (tests marked quick, first parameter set each; tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The protocol model check (tests/test_protocol_model.py) needs Debian's spin;
# it skips, saying so, where spin cannot be installed (not root, no apt).
if ! command -v spin >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq spin) >/dev/null 2>&1 || echo "could not install spin" >&2
fi
# The benchmarks' MPI columns (tests/test_bench.py) need Debian's Open MPI and
# MPICH and mpi4py built against each (bench/mpi_setup.sh; kept once built);
# those tests skip, saying so, where that cannot be done.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  timeout 900 bash bench/mpi_setup.sh >/dev/null 2>&1 || echo "could not set up MPI (bench/mpi_setup.sh)" >&2
fi
exec .venv/bin/python -m pytest tests -q --durations=15 "$@"
