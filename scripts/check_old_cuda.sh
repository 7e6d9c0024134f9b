#!/usr/bin/env bash
# Builds the CUDA sources with an OLD CUDA toolkit (issue 12 item 7, issue 13
# item 1): pyproject.toml admits torch>=2.4, whose wheels were built with CUDA
# 12.1-12.4, and an extension built for them must compile with those
# toolkits. The machine's own toolkit (13.x) cannot tell: a call added in
# CUDA 12.5 (cudaGetDriverEntryPointByVersion) once broke the build there, and
# with it the CPU backend (one module, _C). No GPU is needed.
#
# What it installs (nothing system-wide, nothing into any venv; everything
# under $OLD_CUDA_ROOT, default ~/.cache/pyallreduce/old-cuda, reused next time):
#  * CUDA 12.4 toolkit, about 110 MB downloaded, assembled as a CUDA_HOME in
#    $OLD_CUDA_ROOT/cuda-12.4:
#    - from PyPI (pip download, no install): nvidia-cuda-runtime-cu12 12.4.127
#      (cuda_runtime*.h, cuda.h, libcudart), nvidia-cuda-nvcc-cu12 12.4.131
#      (crt headers, ptxas, libdevice), nvidia-cuda-cccl-cu12 12.4.127.post1
#      (12.4.127 itself is yanked: it lacks <nv/target>);
#    - from Debian trixie non-free (apt-get download with a private apt
#      configuration under $OLD_CUDA_ROOT; the system's sources are not
#      touched): nvidia-cuda-toolkit 12.4.131 for the compiler driver and
#      its passes (nvcc, cudafe++, cicc, fatbinary, nvlink). NVIDIA's PyPI
#      wheels before 12.5 carry ptxas but no nvcc.
#  * CUDA 12.1 headers from PyPI: nvidia-cuda-runtime-cu12 12.1.105 and
#    nvidia-cuda-nvcc-cu12 12.1.105 (crt headers), about 21 MB.
#
# What it compiles (one compiler at a time, `nice`), the flags setup.py and
# torch's CUDAExtension give the real build:
#  1. csrc/cuda/kernels.cu (every kernel) with CUDA 12.4's nvcc for sm_80 and
#     sm_90;
#  2. the host code g++ compiles in the real build, csrc/cuda/adapter.cpp,
#     glue.cpp and runtime.cpp, against the CUDA 12.1 headers (-fsyntax-only: the
#     runtime API calls and driver entry-point types they use must exist in 12.1).
# Both need torch's and pybind11's headers: PYTHON (default: .venv's
# python when there is one, else python3) must import torch and pybind11.
# torch's headers are the installed torch's (2.14 here), not 2.4's.
#
# Exit status 0 when everything compiled. Environment:
#   OLD_CUDA_ROOT=DIR   where the toolkits go (default ~/.cache/pyallreduce/old-cuda)
#   PYTHON=python       the interpreter with torch and pybind11
#   NVCC_THREADS=N      nvcc --threads (default 2)
#   OLD_CUDA_ARCHS="80 90"
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OLD=${OLD_CUDA_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/pyallreduce/old-cuda}
CUDA124=$OLD/cuda-12.4
INC121=$OLD/cuda-12.1-include
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
THREADS=${NVCC_THREADS:-2}
ARCHS=${OLD_CUDA_ARCHS:-80 90}
NICE="nice -n 5"
mkdir -p "$OLD"
log() { echo "check_old_cuda: $*" >&2; }

pip_download() {  # DEST SPEC...: wheels only, no dependencies, nothing installed
  local dest=$1; shift
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: \
    --platform manylinux2014_x86_64 --python-version 3.12 -d "$dest" "$@"
}

unpack_wheels() {  # DIR: every wheel in DIR into DIR/x
  local w
  for w in "$1"/*.whl; do "$PYTHON" -m zipfile -e "$w" "$1/x"; done
}

fetch_cuda124() {
  [ -x "$CUDA124/bin/nvcc" ] && "$CUDA124/bin/nvcc" --version | grep -q "release 12.4" && return 0
  log "fetching CUDA 12.4 into $CUDA124"
  local tmp=$OLD/tmp-12.4
  rm -rf "$tmp" "$CUDA124"
  mkdir -p "$tmp/pypi" "$tmp/deb"
  pip_download "$tmp/pypi" nvidia-cuda-runtime-cu12==12.4.127 nvidia-cuda-nvcc-cu12==12.4.131 \
    nvidia-cuda-cccl-cu12==12.4.127.post1
  unpack_wheels "$tmp/pypi"
  # A private apt configuration: Debian trixie's non-free index, in $tmp only.
  local apt=$tmp/apt
  mkdir -p "$apt/etc/apt.conf.d" "$apt/etc/preferences.d" "$apt/etc/sources.list.d" \
    "$apt/lists/partial" "$apt/cache/archives/partial"
  touch "$apt/status"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie non-free" \
    >"$apt/etc/sources.list"
  cat >"$apt/apt.conf" <<EOF
Dir::Etc "$apt/etc";
Dir::Etc::sourcelist "$apt/etc/sources.list";
Dir::Etc::sourceparts "$apt/etc/sources.list.d";
Dir::Etc::parts "$apt/etc/apt.conf.d";
Dir::Etc::preferencesparts "$apt/etc/preferences.d";
Dir::State "$apt";
Dir::State::Lists "$apt/lists";
Dir::State::status "$apt/status";
Dir::Cache "$apt/cache";
APT::Architecture "amd64";
APT::Sandbox::User "root";
Acquire::Languages "none";
EOF
  export APT_CONFIG=$apt/apt.conf
  $NICE apt-get update -qq >/dev/null
  (cd "$tmp/deb" && $NICE apt-get download -qq nvidia-cuda-toolkit >/dev/null)
  unset APT_CONFIG
  dpkg-deb -x "$tmp"/deb/nvidia-cuda-toolkit_*.deb "$tmp/deb/x"
  # A CUDA_HOME laid out as NVIDIA's installer does.
  local deb=$tmp/deb/x/usr pypi=$tmp/pypi/x/nvidia h=$CUDA124.part
  rm -rf "$h"
  mkdir -p "$h/bin" "$h/nvvm/bin" "$h/nvvm/libdevice" "$h/include" "$h/lib64"
  cp -a "$deb/lib/nvidia-cuda-toolkit/bin/nvcc" "$deb/lib/nvidia-cuda-toolkit/bin/crt" "$h/bin/"
  cp -a "$deb"/bin/{cudafe++,fatbinary,nvlink,bin2c} "$pypi/cuda_nvcc/bin/ptxas" "$h/bin/"
  cp -a "$deb/lib/nvidia-cuda-toolkit/bin/cicc" "$h/nvvm/bin/"
  cp -a "$pypi/cuda_nvcc/nvvm/libdevice/." "$h/nvvm/libdevice/"
  cp -a "$pypi/cuda_runtime/include/." "$pypi/cuda_nvcc/include/." "$pypi/cuda_cccl/include/." "$h/include/"
  cp -a "$pypi/cuda_runtime/lib/libcudart.so.12" "$h/lib64/"
  ln -s libcudart.so.12 "$h/lib64/libcudart.so"
  cat >"$h/bin/nvcc.profile" <<'EOF'
TOP              = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
LD_LIBRARY_PATH += $(TOP)/lib64:
PATH            += $(TOP)/nvvm/bin:$(_HERE_):
INCLUDES        +=  "-I$(TOP)/include" $(_SPACE_)
LIBRARIES        =+ $(_SPACE_) "-L$(TOP)/lib64"
CUDAFE_FLAGS    +=
PTXAS_FLAGS     +=
EOF
  "$h/bin/nvcc" --version | grep -q "release 12.4" || { log "the assembled nvcc is not 12.4"; exit 1; }
  mv "$h" "$CUDA124"
  rm -rf "$tmp"
}

fetch_cuda121_headers() {
  grep -qs "define CUDART_VERSION  12010" "$INC121/cuda_runtime_api.h" && return 0
  log "fetching CUDA 12.1 headers into $INC121"
  local tmp=$OLD/tmp-12.1
  rm -rf "$tmp" "$INC121"
  pip_download "$tmp" nvidia-cuda-runtime-cu12==12.1.105 nvidia-cuda-nvcc-cu12==12.1.105
  unpack_wheels "$tmp"
  mkdir -p "$INC121.part"
  cp -a "$tmp/x/nvidia/cuda_runtime/include/." "$tmp/x/nvidia/cuda_nvcc/include/." "$INC121.part/"
  mv "$INC121.part" "$INC121"
  rm -rf "$tmp"
}

start=$(date +%s)
fetch_cuda124
fetch_cuda121_headers
log "toolkits ready after $(($(date +%s) - start)) s"

# torch's and pybind11's include folders, Python's, and the flags torch's
# CUDAExtension adds to every nvcc call.
mapfile -t INCS < <("$PYTHON" - <<'EOF'
import sysconfig, pybind11
from torch.utils.cpp_extension import include_paths
for p in include_paths() + [sysconfig.get_paths()["include"], pybind11.get_include()]:
    print(p)
EOF
)
TORCH_NVCC=$("$PYTHON" -c "from torch.utils.cpp_extension import COMMON_NVCC_FLAGS as f; print(' '.join(f))" 2>/dev/null)
INCFLAGS=(-I "$ROOT/csrc")
for p in "${INCS[@]}"; do INCFLAGS+=(-I "$p"); done
GENCODE=()
for a in $ARCHS; do GENCODE+=(-gencode "arch=compute_$a,code=sm_$a"); done
HOSTCC=()
gcc_major=$(g++ -dumpversion | cut -d. -f1)
if [ "$gcc_major" -gt 13 ]; then HOSTCC=(-allow-unsupported-compiler); fi  # 12.4 supports g++ <= 13
# setup.py's nvcc flags (less -Xptxas=-v) and torch's.
NVCC=("$CUDA124/bin/nvcc" -std=c++20 -O3 -fmad=false --threads "$THREADS" "${HOSTCC[@]}"
      $TORCH_NVCC -DPYALLREDUCE_WITH_CUDA -Xcompiler -fPIC "${INCFLAGS[@]}")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
failed=0
run() {  # NAME CMD...
  local name=$1 t0; shift
  t0=$(date +%s)
  if $NICE "$@" >"$out/log" 2>&1; then
    log "OK   $name ($(($(date +%s) - t0)) s)"
    grep -iE "csrc/.*warning" "$out/log" >&2 || true  # our files only
  else
    log "FAIL $name"
    cat "$out/log" >&2
    failed=1
  fi
}
run "CUDA 12.4 nvcc: csrc/cuda/kernels.cu for sm_${ARCHS// /, sm_}" \
  "${NVCC[@]}" "${GENCODE[@]}" -c csrc/cuda/kernels.cu -o "$out/kernels.o"
for f in adapter.cpp glue.cpp runtime.cpp; do
  run "CUDA 12.1 headers, g++: csrc/cuda/$f" \
    g++ -std=c++20 -fsyntax-only -DPYALLREDUCE_WITH_CUDA -I "$INC121" "${INCFLAGS[@]}" "csrc/cuda/$f"
done
log "done in $(($(date +%s) - start)) s"
if [ "$failed" = 0 ]; then log "all compiled"; fi
exit "$failed"
