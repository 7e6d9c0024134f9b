#!/bin/bash
# The device check, as one call of a lent GPU machine (it starts bare):
# build against that machine's torch, then the GPU benchmark, then
# tests/test_cuda.py (CUDA and Triton backends, several processes on one GPU).
# Everything it prints and writes lands in $OUT. Each stage has its own cap so
# one that hangs cannot eat the next one's time.
#   BUILD_S, BENCH_S, TEST_S, DEBUG_S: the caps in seconds (defaults below);
#   TOTAL_S: the whole call's cap (a device call ends at 600 s): no stage runs past it.
set -u
deadline=$(( $(date +%s) + ${TOTAL_S:-570} ))
cap() { local left=$(( deadline - $(date +%s) )); echo $(( $1 < left ? $1 : (left > 0 ? left : 1) )); }
OUT=${OUT:-/tmp/pyallreduce-gpu-check}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1
date -u
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

# One arch (the machine's) keeps the build short; 16 cores.
cc=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
export PYALLREDUCE_CUDA_ARCH_LIST=$cc MAX_JOBS=16 NVCC_THREADS=4
start=$(date +%s)
timeout "$(cap ${BUILD_S:-300})" python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . >"$OUT/build.txt" 2>&1
echo "build rc $? in $(( $(date +%s) - start )) s"
tail -20 "$OUT/build.txt"
python3 -c "from pyallreduce import _C; print('WITH_CUDA', _C.WITH_CUDA)" || { grep -n -B2 -A8 "error" "$OUT/build.txt" | head -150; exit 1; }
# The image's g++ finds only libstdc++.a: the extension must still share the process's libstdc++.
python3 -m pytest tests/test_cpu_build.py -q -p no:cacheprovider -k libstdcxx 2>&1 | tail -3

start=$(date +%s)
# From 256 B, eager and graph-replayed, with the floors (an empty kernel, a 16-byte all-reduce) in the same run.
timeout "$(cap ${BENCH_S:-90})" python3 bench/loopback_cuda.py --world-sizes 2,4,8 --sizes 256,4K,64K,256K,1M,4M,16M \
    --out "$OUT"
echo "bench rc $? in $(( $(date +%s) - start )) s"

start=$(date +%s)
timeout "$(cap ${TEST_S:-360})" python3 -m pytest tests/test_cuda.py -v -p no:cacheprovider --timeout 120 \
    --junitxml="$OUT/test_cuda.xml"
rc=$?
echo "tests rc $rc in $(( $(date +%s) - start )) s"
# A crash in native code shows only its Python frame: the first failing check
# again, rank 0 under cuda-gdb for the native backtrace.
if [ $rc -ne 0 ] && [ -f "$OUT/test_cuda.xml" ]; then
  failed=$(python3 -c "
import re, sys
xml = open(sys.argv[1]).read()
m = re.search(r'name=\"test_on_one_gpu\[(check_\w+)-(\d+)\]\"[^>]*>\s*<failure', xml)
print(f'{m.group(1)} {m.group(2)}' if m else '')" "$OUT/test_cuda.xml")
  if [ -n "$failed" ]; then
    echo "debugging: $failed"
    d=$(cap ${DEBUG_S:-90}); timeout "$d" python3 tests/gpu_debug.py $failed --timeout "$d" >"$OUT/debug.txt" 2>&1
    tail -80 "$OUT/debug.txt"
  fi
fi
date -u
