"""The one compile command of the host harness (tests/sim/harness.cpp), used by
tests/test_cuda_sim.py and tests/sim/mutants.py. g++ only: no torch, no GPU.

    python tests/sim/build.py [plain|asan|tsan|coverage] [OUTPUT]
    python tests/sim/build.py --cached FLAVOUR...   (what tests/test_cuda_sim.py runs)
"""
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The sanitizer suites run worlds of at most 4 ranks (harness.cpp, suites
# "quick" and "tsan"): their builds instantiate the kernels for those only,
# which halves the slowest compiles of the test suite.
SANITIZER_WORLDS = "-DPYALLREDUCE_KERNEL_WORLDS=4"
FLAVOURS = {
    "plain": ["-O2"],
    # UBSan stops at the first report so the harness fails on it.
    "asan": ["-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
             "-fno-omit-frame-pointer", SANITIZER_WORLDS],
    "tsan": ["-O1", "-fsanitize=thread", SANITIZER_WORLDS],
    "coverage": ["-O0", "--coverage", "-DSIM_COVERAGE"],
}


# What a harness binary is built from: a change to any of them rebuilds it.
SOURCES = [ROOT / "tests" / "sim" / "harness.cpp", ROOT / "tests" / "sim" / "cuda_shim.h", Path(__file__).resolve(),
           *sorted((ROOT / "csrc" / "cuda").glob("*.h")), *sorted((ROOT / "csrc" / "cuda").glob("*.cuh")),
           ROOT / "csrc" / "common" / "protocol.h", ROOT / "csrc" / "common" / "context.h"]


def cached_harness(flavour):
    """Where the harness of `flavour` built from today's sources is kept
    (build/sim, named by a hash of SOURCES and the flavour's flags)."""
    digest = hashlib.sha256()
    for path in SOURCES:
        digest.update(path.read_bytes())
    digest.update(" ".join(FLAVOURS[flavour]).encode())
    return ROOT / "build" / "sim" / f"harness_{flavour}_{digest.hexdigest()[:16]}"


def build_cached(flavour):
    """cached_harness(flavour), built first if it is not there. The binary
    appears whole (renamed into place), so a concurrent build is harmless."""
    exe = cached_harness(flavour)
    if not exe.exists():
        exe.parent.mkdir(parents=True, exist_ok=True)
        tmp = exe.with_name(f"{exe.name}.{os.getpid()}.tmp")
        compile_harness(tmp, flavour)
        tmp.replace(exe)
    return exe


def cuda_include():
    """The CUDA toolkit's include folder (NVIDIA's int4/__half/__nv_bfloat16
    host code), found as setup.py's find_cuda_home finds the toolkit."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(nvcc).resolve()
        candidates.append(str(real.parent.parent))
        try:
            candidates += re.findall(r"(/\S+?)/bin/nvcc", real.read_text(errors="ignore")[:4096])
        except OSError:
            pass
    candidates.append("/usr/local/cuda")
    for c in candidates:
        if c and (Path(c) / "include" / "cuda_fp16.h").is_file():
            return str(Path(c) / "include")
    return None


def command(output, flavour="plain", csrc=None, opt=None):
    flags = list(FLAVOURS[flavour])
    if opt is not None:
        flags = [opt if f.startswith("-O") else f for f in flags]
    include = cuda_include()
    if include is None:
        raise RuntimeError("no CUDA toolkit headers (set CUDA_HOME to the folder holding include/cuda_fp16.h)")
    # -g1: file and line in sanitizer reports and backtraces; full debug info
    # made each build a quarter slower.
    return ["g++", "-std=c++20", "-g1", *flags,
            # Bit-exact sums: no contraction into FMA (the GPU build passes -fmad=false).
            "-ffp-contract=off", "-fno-strict-aliasing",
            "-Wall", "-Wno-unknown-pragmas", "-Wno-clobbered",
            "-I", str(csrc or ROOT / "csrc"), "-I", include,
            str(ROOT / "tests" / "sim" / "harness.cpp"), "-o", str(output), "-lpthread"]


def compile_harness(output, flavour="plain", csrc=None, opt=None, timeout=900):
    cmd = command(output, flavour, csrc, opt)
    proc = subprocess.run(["nice", "-n", "5", *cmd], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"harness build failed:\n{' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    return output


def run_env(flavour):
    env = dict(os.environ)
    if flavour == "asan":
        # Fibers switch stacks: ASan is told (cuda_shim.h); leaks are not this test's concern.
        env["ASAN_OPTIONS"] = "detect_leaks=0:detect_stack_use_after_return=0:abort_on_error=0"
        env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    if flavour == "tsan":
        env["TSAN_OPTIONS"] = "halt_on_error=1:second_deadlock_stack=0:report_signal_unsafe=0"
    return env


if __name__ == "__main__":
    if sys.argv[1:2] == ["--cached"]:
        for flavour in sys.argv[2:]:
            print(build_cached(flavour))
        sys.exit(0)
    flavour = sys.argv[1] if len(sys.argv) > 1 else "plain"
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "build" / "sim" / f"harness_{flavour}"
    out.parent.mkdir(parents=True, exist_ok=True)
    print(compile_harness(out, flavour))
