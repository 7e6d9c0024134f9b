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
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SIM = ROOT / "tests" / "sim"
sys.path.insert(0, str(SIM))
import build  # noqa: E402

CAN_BUILD = shutil.which("g++") is not None and build.cuda_include() is not None
pytestmark = pytest.mark.skipif(not CAN_BUILD, reason="needs g++ and the CUDA toolkit's headers (CUDA_HOME)")

# The harness flavour each test runs.
FLAVOUR_OF_TEST = {"test_harness_plain": "plain", "test_harness_asan_ubsan": "asan",
                   "test_harness_tsan_threads": "tsan"}
_background_build = None


def start_background_compile(items):
    """Builds the flavours the selected tests need and the cache lacks, in
    one process at the lowest priority, while the other tests run (conftest.py
    runs these tests last). ~1 minute of one core per flavour."""
    global _background_build
    flavours = [FLAVOUR_OF_TEST[item.originalname] for item in items if item.originalname in FLAVOUR_OF_TEST]
    missing = [f for f in dict.fromkeys(flavours) if not build.cached_harness(f).exists()]
    if not CAN_BUILD or not missing:
        return None
    _background_build = subprocess.Popen(["nice", "-n", "19", sys.executable, str(SIM / "build.py"), "--cached",
                                          *missing], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True)
    return _background_build


def harness(flavour):
    """The harness binary of flavour for today's sources (build.cached_harness):
    the background build's, once it is there, or built now (which also
    raises a failed background build's compile error)."""
    exe = build.cached_harness(flavour)
    while not exe.exists() and _background_build is not None and _background_build.poll() is None:
        time.sleep(0.2)
    return build.build_cached(flavour)


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
