"""Runs the real CUDA kernels (csrc/cuda/all_reduce.cuh: all-reduce,
reduce-scatter, all-gather) on the host through the CUDA shim (tests/sim):
W = 1..8 ranks as threads and as processes, every mode, graph entries, the
three collectives mixed on one communicator, mismatched calls, deadlines and
the epoch wrap, every output bit against a reference; then the sanitizer
subsets (ASan+UBSan, TSan).
g++ and the CUDA toolkit's headers only: no torch build, no GPU.

The mutants (deliberate kernel bugs the harness must catch) run with
PYALLREDUCE_MUTANTS=1; they rebuild the harness once per mutant.
"""
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SIM = ROOT / "tests" / "sim"
sys.path.insert(0, str(SIM))
import build  # noqa: E402

SOURCES = [SIM / "harness.cpp", SIM / "cuda_shim.h", SIM / "build.py",
           *sorted((ROOT / "csrc" / "cuda").glob("*.h")), *sorted((ROOT / "csrc" / "cuda").glob("*.cuh")),
           ROOT / "csrc" / "common" / "protocol.h"]

pytestmark = pytest.mark.skipif(shutil.which("g++") is None or build.cuda_include() is None,
                                reason="needs g++ and the CUDA toolkit's headers (CUDA_HOME)")


def harness(flavour):
    """The harness binary for flavour, built once per source version under build/sim."""
    digest = hashlib.sha256()
    for path in SOURCES:
        digest.update(path.read_bytes())
    digest.update(" ".join(build.FLAVOURS[flavour]).encode())
    exe = ROOT / "build" / "sim" / f"harness_{flavour}_{digest.hexdigest()[:16]}"
    if not exe.exists():
        exe.parent.mkdir(parents=True, exist_ok=True)
        tmp = exe.with_suffix(".tmp")
        build.compile_harness(tmp, flavour)
        tmp.replace(exe)
    return exe


def run_harness(flavour, args, timeout):
    proc = subprocess.run([str(harness(flavour)), *args], capture_output=True, text=True, timeout=timeout,
                          env=build.run_env(flavour))
    assert proc.returncode == 0, f"harness ({flavour}) failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


@pytest.mark.quick
def test_harness_plain(request):
    # The quick tier runs the sanitizer suites' worlds (W <= 4, threads only):
    # every collective, mode, mismatch, deadline and the wrap, in seconds.
    suite = ["--suite", "quick", "--mode", "threads"] if request.config.getoption("--quick") else \
        ["--suite", "plain", "--mode", "both"]
    out = run_harness("plain", suite, timeout=600)
    assert "0 failed" in out


def test_harness_asan_ubsan():
    run_harness("asan", ["--suite", "quick", "--mode", "both"], timeout=900)


def test_harness_tsan_threads():
    run_harness("tsan", ["--suite", "tsan", "--mode", "threads"], timeout=900)


@pytest.mark.skipif(os.environ.get("PYALLREDUCE_MUTANTS") != "1", reason="set PYALLREDUCE_MUTANTS=1 (slow)")
def test_mutants_are_caught():
    proc = subprocess.run([sys.executable, str(SIM / "mutants.py")], capture_output=True, text=True, timeout=7200)
    assert proc.returncode == 0, f"mutants survived:\n{proc.stdout}\n{proc.stderr[-4000:]}"
