"""Builds the emulated GPU stack (tests/emulated/cudart.cpp explains it):

* build/emulated/lib/libcudart_emulated.so: the emulated runtime, plus a weak
  stub for every other CUDA runtime or driver symbol that torch and
  pyallreduce use (each names itself and fails: nothing silently reaches the
  real runtime); also installed as libcuda.so.1, which torch opens itself;
* build/emulated/pkg/pyallreduce: the package's Python files (links) with an
  extension built from the same sources as setup.py's, except that the kernels
  are csrc/cuda/kernels.cu over the host shim (tests/emulated/kernels.cpp);
  with --coverage, build/emulated/pkg-coverage, instrumented for gcov
  (tests/emulated/line_coverage.py).

    python tests/emulated/build_emulated.py [--coverage]   # prints the environment to run under

Rebuilt only when an input changed (content hash). environment() is what a
process needs to run on the emulation: LD_PRELOAD, LD_LIBRARY_PATH, PYTHONPATH.
"""
import functools
import hashlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@functools.cache
def cuda_include():
    """tests/sim/build.py's: the toolkit's include folder."""
    spec = importlib.util.spec_from_file_location("sim_build", ROOT / "tests" / "sim" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.cuda_include()


OUT = ROOT / "build" / "emulated"
LIB = OUT / "lib"
RUNTIME = LIB / "libcudart_emulated.so"
# Launches from threads other than the main one start up to 3 ms late
# (cudart.cpp): where the tests race a close() against another thread's call.
LAUNCH_JITTER = {"PYALLREDUCE_EMULATED_LAUNCH_JITTER_US": "3000"}
# setup.py's sources, with the kernels on the host shim.
EXTENSION_SOURCES = ["csrc/module.cpp", "csrc/backend.cpp", "csrc/cpu/shm.cpp", "csrc/cpu/all_reduce.cpp",
                     "csrc/cuda/adapter.cpp", "csrc/cuda/glue.cpp", "csrc/cuda/runtime.cpp", "tests/emulated/kernels.cpp"]
CXX_FLAGS = ["-O1", "-g1", "-std=c++20", "-ffp-contract=off", "-fno-strict-aliasing", "-DPYALLREDUCE_WITH_CUDA"]


def torch_lib():
    import torch

    return Path(torch.__file__).parent / "lib"


def imported_symbols():
    """The CUDA runtime symbols torch and the extension import, and the driver
    symbols torch looks up by name: each gets a weak stub."""
    lib = torch_lib()
    runtime = set()
    for so in ("libc10_cuda.so", "libtorch_cuda.so", "libtorch_python.so"):
        out = subprocess.run(["nm", "-D", "--undefined-only", str(lib / so)], capture_output=True, text=True,
                             check=True).stdout
        runtime |= {line.split()[-1].split("@")[0] for line in out.splitlines()
                    if line.split() and line.split()[-1].startswith("cuda")}
    strings = subprocess.run(["strings", str(lib / "libc10_cuda.so"), str(lib / "libtorch_cuda.so")],
                             capture_output=True, text=True, check=True).stdout
    driver = {s for s in strings.split() if re.fullmatch(r"cu[A-Z][A-Za-z0-9_]{5,}", s)}
    return sorted(runtime | driver)


def stubs_source(symbols):
    lines = ["#include <stdio.h>"]
    for s in symbols:
        lines.append(f'__attribute__((weak)) int {s}(void) {{ fprintf(stderr, "emulated cuda: {s} is not '
                     f'emulated\\n"); return 801; }}')
    return "\n".join(lines) + "\n"


def inputs_digest(paths, extra=""):
    h = hashlib.sha256(extra.encode())
    for p in paths:
        h.update(str(p).encode())
        h.update(Path(p).read_bytes())
    return h.hexdigest()


def build_runtime():
    include = cuda_include()
    symbols = imported_symbols()
    digest = inputs_digest([HERE / "cudart.cpp", Path(__file__)], " ".join(symbols) + include)
    stamp = LIB / "runtime.sha256"
    if RUNTIME.exists() and stamp.exists() and stamp.read_text() == digest:
        return
    LIB.mkdir(parents=True, exist_ok=True)
    stubs = LIB / "stubs.c"
    stubs.write_text(stubs_source(symbols))
    subprocess.run(["gcc", "-O1", "-fPIC", "-c", str(stubs), "-o", str(LIB / "stubs.o")], check=True)
    subprocess.run(["g++", "-shared", "-fPIC", "-O1", "-g1", "-std=c++20", "-I", include, str(HERE / "cudart.cpp"),
                    str(LIB / "stubs.o"), "-o", str(RUNTIME)], check=True)
    driver = LIB / "libcuda.so.1"
    driver.unlink(missing_ok=True)
    driver.symlink_to(RUNTIME.name)
    stamp.write_text(digest)


def extension_inputs():
    headers = sorted((ROOT / "csrc").rglob("*.h")) + sorted((ROOT / "csrc").rglob("*.cuh"))
    included = [ROOT / "csrc" / "cuda" / "kernels.cu", ROOT / "tests" / "sim" / "cuda_shim.h"]  # through kernels.cpp
    return [ROOT / s for s in EXTENSION_SOURCES] + headers + included + [Path(__file__)]


def objects(coverage=False):
    """Where the extension's objects are built (ninja: only what changed)."""
    return OUT / ("obj-coverage" if coverage else "obj")


def package(coverage=False):
    return OUT / ("pkg-coverage" if coverage else "pkg")


def build_extension(coverage=False):
    """The extension; with coverage, instrumented for gcov (-O0 --coverage),
    in a folder of its own."""
    include = cuda_include()
    # cpp_extension reads these when imported: the toolkit (for cuda_runtime.h
    # and linking libcudart, which the emulation overrides) and an arch list,
    # which nothing here compiles for (no nvcc) but which it asks a GPU for otherwise.
    os.environ.setdefault("CUDA_HOME", str(Path(include).parent))
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    import torch
    from torch.utils import cpp_extension

    flags = CXX_FLAGS + (["-O0", "--coverage", "-DPYALLREDUCE_EMULATED_COVERAGE"] if coverage else [])
    digest = inputs_digest(extension_inputs(), torch.__version__ + " ".join(flags))
    obj = objects(coverage)
    stamp = obj / "extension.sha256"
    target = package(coverage) / "pyallreduce" / f"_C{sysconfig_suffix()}"
    if target.exists() and stamp.exists() and stamp.read_text() == digest:
        return target
    obj.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name="_C", sources=[str(ROOT / s) for s in EXTENSION_SOURCES], build_directory=str(obj),
        extra_cflags=flags, extra_include_paths=[include, str(ROOT / "csrc")],
        extra_ldflags=["-lrt", f"-L{Path(include).parent / 'lib64'}", "-lcudart"] + (["--coverage"] if coverage else []),
        with_cuda=True, is_python_module=False, verbose=False)
    built = obj / "_C.so"
    make_package(built, target)
    stamp.write_text(digest)
    return target


def sysconfig_suffix():
    import sysconfig

    return sysconfig.get_config_var("EXT_SUFFIX")


def make_package(built, target):
    """build/emulated/pkg/pyallreduce: links to the package's files, the emulated extension."""
    pkg = target.parent
    pkg.mkdir(parents=True, exist_ok=True)
    for entry in pkg.iterdir():
        if entry.is_symlink() or entry.is_file():
            entry.unlink()
    for src in (ROOT / "pyallreduce").iterdir():
        if src.name.startswith("_C") or src.name == "__pycache__":
            continue
        (pkg / src.name).symlink_to(src)
    (pkg / "triton_kernels").symlink_to(ROOT / "triton_kernels")
    target.symlink_to(built)


def environment(coverage=False):
    """What a process needs to run on the emulation (added to os.environ by the caller)."""
    python_path = [str(package(coverage)), str(ROOT / "tests")]
    if os.environ.get("PYTHONPATH"):
        python_path.append(os.environ["PYTHONPATH"])
    ld_path = [str(LIB)] + ([os.environ["LD_LIBRARY_PATH"]] if os.environ.get("LD_LIBRARY_PATH") else [])
    # Two devices: code that does not make the communicator's device current shows
    # (test_cuda.py's test_a_device_other_than_the_current_one); the other tests use device 0.
    return {"LD_PRELOAD": str(RUNTIME), "LD_LIBRARY_PATH": ":".join(ld_path), "PYTHONPATH": ":".join(python_path),
            "PYALLREDUCE_EMULATED_DEVICES": "2"}


def run_pytest(env, args, timeout=None):
    """pytest on the emulation, in env (environment() added). -P and the cwd
    build/emulated: neither the test process nor the ranks' fork server may
    find the repository's own pyallreduce (the real extension) before the
    emulated package on PYTHONPATH."""
    cmd = [sys.executable, "-P", "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", *args]
    return subprocess.run(cmd, cwd=OUT, env=env, capture_output=True, text=True, timeout=timeout)


def build(coverage=False):
    build_runtime()
    build_extension(coverage)
    return environment(coverage)


if __name__ == "__main__":
    for key, value in build(coverage="--coverage" in sys.argv[1:]).items():
        print(f"export {key}={value}")
