#!/usr/bin/env bash
# The torch version matrix (issue 39), beside the pinned torch that
# scripts/setup.sh installs in .venv: each row below gets its own virtual
# environment under build/matrix/, a CPU-only build of a copy of this tree
# (so its objects never mix with .venv's build), and the tests of the four
# faces of the product: the quick tier (the Communicator), then the
# torch.distributed backend, the custom ops under torch.compile, the DDP hook
# and the Work contract in full. CI runs it beside scripts/test.sh (.ci/run).
#
# CI's rows: the oldest torch supported (2.4.1: the backend as a Python
# ProcessGroup, Triton 3.0) and the newest on PyPI (2.15.0), each with its
# CUDA libraries (2.5-4 GB: about 1.5 minutes to install here). By hand,
# PYALLREDUCE_TORCH_ROWS="2.13.0 2.11.0" (any row of EXTRAS): 2.13.0 is a CPU
# build on this machine's disk (/opt/wheels), with Triton 3.6.0, the newest
# torch whose c10d names predate 2.14's (csrc/backend.cpp's other branch).
# numpy < 2.4 with Triton < 3.8: Triton 3.6's interpreter cannot run with
# numpy 2.4 (importing the kernels says so: pyallreduce/triton_requirements.py).
#
# The machine's pip caps torch at 2.14.1 with a constraints file users do not
# have: the rows install with PIP_CONSTRAINT=/dev/null (an empty one; an
# empty variable leaves the file's), and each checks after the build that its
# torch was not swapped under it (an extension built against one torch and
# imported with another fails on undefined c10d symbols).
#
#   bash scripts/torch_matrix.sh [--prepare | --test | --ci] [pytest args for every row]
#
# --ci is how CI runs it, beside scripts/test.sh (.ci/run): a row is installed
# and built while the previous row's tests run (their ranks mostly wait on
# each other), and deleted after its own tests, with no pip cache, so the disk
# holds .venv and at most two rows (5 GB each), not every row and its
# downloads twice (a CI run once stopped at "No space left on device"). Where
# unshare can (root), a row's tests run in a network and mount namespace of
# their own: their gloo groups and stores cannot meet the main suite's on a
# port both drew (seen: "Gloo connectFullMesh failed ... Connection closed by
# peer"), and their /dev/shm, which every test checks it leaves empty of
# segments, is not the main suite's.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
declare -A EXTRAS=(
  [2.13.0]="triton==3.6.0 numpy<2.4"
  [2.12.1]="numpy<2.4"
  [2.11.0]="numpy<2.4"  # its Triton is 3.6
  [2.10.0]="numpy<2.4"
  [2.9.1]="numpy<2.4"
  [2.8.0]=""            # its Triton is 3.4: refused as 2.4's
  [2.7.1]=""            # Triton 3.3
  [2.6.0]=""            # Triton 3.2
  [2.5.1]=""            # Triton 3.1
  [2.4.1]=""            # its Triton is 3.0, which the Triton engine refuses (>= 3.6)
  [2.15.0]=""
)
ROWS=()
for v in ${PYALLREDUCE_TORCH_ROWS:-2.4.1 2.15.0}; do
  [ -n "${EXTRAS[$v]+set}" ] || { echo "no row for torch $v: add its extras to EXTRAS" >&2; exit 2; }
  ROWS+=("$v|${EXTRAS[$v]}")
done
phase=all  # --prepare: install and build only (needs the network); --test: the tests of prepared rows
case "${1:-}" in --prepare | --test | --ci) phase=${1#--}; shift ;; esac
export PIP_CONSTRAINT=/dev/null
if [ "$phase" = ci ]; then
  export PIP_NO_CACHE_DIR=1
  isolate=(sh -c 'ip link set lo up && mount -t tmpfs -o size=50% tmpfs /dev/shm && exec "$@"' sh)
  if unshare -mn "${isolate[@]}" true 2>/dev/null; then
    isolate=(unshare -mn "${isolate[@]}")
  else
    echo "unshare -mn is not allowed here: the matrix's tests share the network and /dev/shm with the main suite"
    isolate=()
  fi
  versions=()
  for row in "${ROWS[@]}"; do versions+=("${row%%|*}"); done
  mkdir -p build/matrix
  prepare() { PYALLREDUCE_TORCH_ROWS=$1 bash "$0" --prepare > "build/matrix/prepare-$1.log" 2>&1; }
  prepare "${versions[0]}" &
  preparing=$!
  failed=0
  for i in "${!versions[@]}"; do
    v=${versions[$i]}
    prepared=1
    wait "$preparing" || prepared=0
    cat "build/matrix/prepare-$v.log"
    if [ $((i + 1)) -lt ${#versions[@]} ]; then
      prepare "${versions[$((i + 1))]}" &
      preparing=$!
    fi
    if [ "$prepared" = 1 ]; then
      PYALLREDUCE_TORCH_ROWS=$v "${isolate[@]}" bash "$0" --test "$@" || failed=1
    else
      echo "== torch $v: FAILED to install or build"
      failed=1
    fi
    rm -rf "build/matrix/torch-$v/venv"
    df -h . | awk 'NR == 2 {print "== disk after the row: " $4 " free of " $2}'
  done
  exit "$failed"
fi
failed=0
for row in "${ROWS[@]}"; do
  torch_version=${row%%|*}
  extras=${row#*|}
  dir=build/matrix/torch-$torch_version
  venv=$PWD/$dir/venv
  row_start=$SECONDS
  if [ "$phase" != test ]; then
    echo "== torch $torch_version ($extras): install and build"
    [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
    # numpy: torch.distributed's object collectives need it, and torch >= 2.5 does not pull it in.
    # shellcheck disable=SC2086  # extras is a list of requirement specs
    "$venv/bin/python" -m pip install -q "torch==$torch_version" numpy $extras pybind11 ninja pytest \
      "setuptools>=77" wheel 2>&1 | { grep -v "^WARNING: Location" || true; }
    # A copy of the tracked files (mtimes kept: ninja recompiles only what changed).
    mkdir -p "$dir/src"
    git ls-files -z | xargs -0 cp -p --parents -t "$dir/src"
    (cd "$dir/src" && PYALLREDUCE_SKIP_CUDA=1 MAX_JOBS=${MAX_JOBS:-2} \
       "$venv/bin/python" -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | { grep -v "^ *$" || true; })
    (cd "$dir/src" && "$venv/bin/python" -c "
import torch, pyallreduce.backend as B
assert torch.__version__.split('+')[0] == '$torch_version', f'torch {torch.__version__} was installed under the row for $torch_version'
print('torch', torch.__version__, '- the torch.distributed backend:', 'C++ fast path' if B.SERVES_IN_CPP else 'served in Python')")
  fi
  if [ "$phase" != prepare ]; then
    echo "== torch $torch_version ($extras): tests"
    # The quick tier of every other file, then the four faces' files in full.
    faces=(tests/test_backend.py tests/test_torch_op.py tests/test_ddp.py tests/test_work_contract.py)
    if ! (cd "$dir/src" && "$venv/bin/python" -m pytest tests -q -p no:cacheprovider --quick \
            "${faces[@]/#/--ignore=}" "$@" &&
          "$venv/bin/python" -m pytest -q -p no:cacheprovider "${faces[@]}" "$@"); then
      echo "== torch $torch_version: FAILED"
      failed=1
    fi
  fi
  echo "== torch $torch_version: $((SECONDS - row_start)) s"
done
exit "$failed"
