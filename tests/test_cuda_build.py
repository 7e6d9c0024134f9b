"""Checks the CUDA kernels of the built extension (no GPU needed), as the
compiler left them in pyallreduce._C: every kernel in every cubin (sm_80,
sm_90), no register spills, no local memory, at most 128 registers (cuobjdump's
resource usage), and in the sm_90 PTX: 16-byte vector accesses, the
system-scope release/acquire flags, the %globaltimer deadline and no trap (a
missed deadline or a mismatch is recorded in the status record and the kernel
returns: the CUDA context stays usable).

csrc/cuda/kernels.cu instantiates every kernel (3 dtypes x world sizes 1..8 x
one-shot/two-shot x with/without a graph-table entry; reduce-scatter for the 3
dtypes and all-gather for its 4 word sizes x world sizes 1..8) behind the
launchers the glue calls. Reading the built binary instead of compiling it a
second time checks exactly what ships, and costs seconds.
"""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parent.parent
DTYPES = ("float", "__half", "__nv_bfloat16")
WORLD_SIZES = range(1, 9)
ALGOS = ("one_shot", "two_shot")
GRAPH_ENTRY = (False, True)  # the kernels' kGraphEntry template argument
MAX_REGISTERS = 128  # 65536 registers / 512 threads: __launch_bounds__(512, 1)


def find_nvcc():
    """The same search as setup.py's find_cuda_home: CUDA_HOME, CUDA_PATH, the
    toolkit behind the nvcc on PATH (also through a wrapper script), /usr/local/cuda."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(nvcc).resolve()
        candidates.append(real.parent.parent)
        try:
            text = real.read_text(errors="ignore")[:4096]
            candidates += re.findall(r"(/\S+?)/bin/nvcc", text)
        except OSError:
            pass
    candidates.append("/usr/local/cuda")
    for c in candidates:
        if c and (Path(c) / "bin" / "nvcc").is_file():
            return str(Path(c) / "bin" / "nvcc")
    return None


def mangled(algo, dtype, world, graph_entry):
    type_code = {"float": "f", "__half": "6__half", "__nv_bfloat16": "13__nv_bfloat16"}[dtype]
    name = f"{algo}_kernel"
    return f"_ZN11pyallreduce4cuda{len(name)}{name}I{type_code}Li{world}ELb{int(graph_entry)}EEEvNS0_10KernelArgsE"


ALL_GATHER_WORDS = ("h", "t", "j", "m")  # uint8_t, uint16_t, uint32_t, uint64_t


def mangled_segment_kernel(name, type_code, world):
    return f"_ZN11pyallreduce4cuda{len(name)}{name}I{type_code}Li{world}EEEvNS0_10KernelArgsE"


ALL_REDUCE_KERNELS = [mangled(a, d, w, g) for a in ALGOS for d in DTYPES for w in WORLD_SIZES for g in GRAPH_ENTRY]
REDUCE_SCATTER_KERNELS = [mangled_segment_kernel("reduce_scatter_kernel", code, w)
                          for code in ("f", "6__half", "13__nv_bfloat16") for w in WORLD_SIZES]
ALL_GATHER_KERNELS = [mangled_segment_kernel("all_gather_kernel", code, w)
                      for code in ALL_GATHER_WORDS for w in WORLD_SIZES]
KERNELS = ALL_REDUCE_KERNELS + REDUCE_SCATTER_KERNELS + ALL_GATHER_KERNELS


def find_cuobjdump():
    """The toolkit's cuobjdump (beside nvcc), else the one Triton bundles."""
    nvcc = find_nvcc()
    candidates = [Path(nvcc).parent / "cuobjdump"] if nvcc else []
    try:
        import triton

        candidates.append(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    except ImportError:
        pass
    return next((str(c) for c in candidates if c.is_file()), None)


@pytest.fixture(scope="module")
def build():
    """What the installed extension carries: {arch: {kernel: (registers, stack
    bytes, local bytes)}} for each cubin, and its PTX."""
    from pyallreduce import _C

    if not _C.WITH_CUDA:
        pytest.skip("pyallreduce._C was built without CUDA kernels: " +
                    ("the CPU-only flavour was asked for (PYALLREDUCE_SKIP_CUDA=1)" if _C.CUDA_SKIPPED_ON_REQUEST
                     else "no CUDA toolkit or a CPU-only torch at build time"))
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump (neither beside nvcc nor in Triton's bundle)")

    def dump(flag):
        proc = subprocess.run([cuobjdump, flag, _C.__file__], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"cuobjdump {flag} failed:\n{proc.stderr}"
        return proc.stdout

    usage, arch, kernel = {}, None, None
    for line in dump("-res-usage").splitlines():
        if m := re.match(r"arch = (sm_\d+)", line.strip()):
            arch = m.group(1)
        elif m := re.match(r"\s*Function (\w+):", line):
            kernel = m.group(1)
        elif (m := re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", line)) and kernel:
            usage.setdefault(arch, {})[kernel] = tuple(int(x) for x in m.groups())
            kernel = None
    return usage, dump("-ptx")


def ptx_entries(ptx):
    """{kernel: body} of every .entry in the PTX."""
    parts = re.split(r"^\.visible \.entry (\w+)\(", ptx, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def test_nvcc_reports_no_spills(build):
    usage, _ = build
    assert "sm_90" in usage, f"the build has cubins for {sorted(usage)}, not sm_90 (the target)"
    for arch, props in sorted(usage.items()):
        assert sorted(props) == sorted(KERNELS), f"{arch}: kernels built: {sorted(props)}"
        # No local memory at all (spills live there): the kernels print nothing
        # (failures go to the status record), and arguments copied to local
        # memory (a runtime index into them) would show as a stack frame.
        local = {k: p for k, p in props.items() if p[1] or p[2]}
        assert not local, f"{arch}: kernels with a stack frame or local memory (regs, stack, local): {local}"
        too_many = {k: p[0] for k, p in props.items() if p[0] > MAX_REGISTERS}
        assert not too_many, f"{arch}: kernels above {MAX_REGISTERS} registers: {too_many}"


@pytest.mark.parametrize("kernel", KERNELS)
def test_ptx_has_intended_instructions(build, kernel):
    _, ptx = build
    body = ptx_entries(ptx).get(kernel)
    assert body is not None, f"{kernel} missing from the PTX"
    # 16-byte vector accesses: the 4 x 32-bit or 2 x 64-bit forms of a 128-bit load/store.
    assert re.search(r"ld\.global(\.nc)?\.v4\.(u32|b32|f32)|ld\.global(\.nc)?\.v2\.(u64|b64)", body), \
        "no 128-bit global load"
    assert re.search(r"st\.global\.v4\.(u32|b32|f32)|st\.global\.v2\.(u64|b64)", body), \
        "no 128-bit global store"
    assert "st.release.sys.global.u32" in body, "flags must be stored with release, system scope"
    assert "ld.acquire.sys.global.u32" in body, "flags must be polled with acquire, system scope"
    assert "%globaltimer" in body, "spin loops must read %globaltimer for their deadline"
    assert "trap;" not in body, "no trap: a trap leaves the process's CUDA context unusable"
    assert "vprintf" not in body, "no printf: failures go to the status record"
    # The status record: the first failing block claims it with an atomicMax on
    # a word in device memory (no atomic on mapped host memory: kernel_api.h),
    # then publishes the code with a system-scope release (the host polls it).
    assert re.search(r"atom\.global\.max\.u32", body), "the status record must be claimed with atomicMax"
    assert not re.search(r"atom\.global\.cas", body), "no CAS: the claim is an atomicMax on a device word"
    # Bitwise agreement with the CPU and Triton backends: adds only (no FMA
    # contraction) and "avg" as an IEEE division, not a reciprocal multiply.
    assert not re.search(r"\bfma\.", body), "fused multiply-add found (build with -fmad=false)"
    if kernel not in ALL_GATHER_KERNELS:  # all-gather copies; it divides nothing
        assert "div.rn.f32" in body, "avg must divide with div.rn.f32"
    assert not re.search(r"div\.(approx|full)\.f32|rcp\.approx", body), "approximate division found"


@pytest.mark.parametrize("source", ["glue.cpp", "runtime.cpp"])
def test_the_cuda_glue_compiles_without_torch(source):
    """csrc/cuda/glue.cpp and runtime.cpp (registrations, graph table, status
    record, launch order, IPC) build against the CUDA runtime alone: only
    adapter.cpp touches torch, so the glue can be compiled against any CUDA
    runtime (the emulated one of tests/emulated included). With torch's
    headers out of reach, a torch include fails the compile."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sim_build", ROOT / "tests" / "sim" / "build.py")
    sim_build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim_build)
    include = sim_build.cuda_include()
    if include is None:
        pytest.skip("no CUDA toolkit (its cuda_runtime_api.h is what the glue needs)")
    proc = subprocess.run(["g++", "-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-I", str(include),
                           str(ROOT / "csrc" / "cuda" / source)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr
