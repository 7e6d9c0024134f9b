#!/usr/bin/env bash
# Sets up from nothing (scripts/setup.sh) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests -q --durations=15 "$@"
