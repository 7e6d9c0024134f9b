"""Compiles the CUDA kernels with the real nvcc (no GPU needed) and checks the
compiler's own report: no register spills, no local memory, 16-byte vector
accesses, the system-scope release/acquire flags, the %globaltimer deadline
and no trap (a missed deadline or a mismatch is recorded in the status record
and the kernel returns: the CUDA context stays usable).

tests/cuda_kernels.cu instantiates every kernel (3 dtypes x world sizes 1..8 x
one-shot/two-shot x with/without a graph-table entry; reduce-scatter for the 3
dtypes and all-gather for its 4 word sizes x world sizes 1..8) through the
launchers that csrc/cuda/all_reduce.cu uses.
Only sm_90 (the target) is compiled, to keep this fast on a small CI machine.
"""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

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


def torch_nvcc_flags():
    """The flags torch's CUDAExtension adds to every nvcc call (the real build has them)."""
    try:
        from torch.utils.cpp_extension import COMMON_NVCC_FLAGS
    except ImportError:
        return []
    return list(COMMON_NVCC_FLAGS)


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


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("no CUDA toolkit (set CUDA_HOME to the folder holding bin/nvcc)")
    out = tmp_path_factory.mktemp("cuda_build")
    cmd = [nvcc, "-std=c++20", "-O3", "-fmad=false", "-Xptxas=-v", "--threads", "1",
           "-arch=sm_90", "--keep", "--keep-dir", str(out), *torch_nvcc_flags(),
           "-I", str(ROOT / "csrc"), "-c", str(ROOT / "tests" / "cuda_kernels.cu"),
           "-o", str(out / "cuda_kernels.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"nvcc failed:\n{' '.join(cmd)}\n{report}"
    ptx_files = list(out.glob("*.ptx"))
    assert len(ptx_files) == 1, f"expected one kept .ptx file in {out}, found {ptx_files}"
    return report, ptx_files[0].read_text()


def ptxas_properties(report):
    """{kernel: (registers, stack_bytes, spill_store_bytes, spill_load_bytes)} for sm_90."""
    props, current, frame = {}, None, None
    for line in report.splitlines():
        m = re.search(r"Compiling entry function '(\w+)' for 'sm_90'", line)
        if m:
            current, frame = m.group(1), None
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current:
            frame = tuple(int(x) for x in m.groups())
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and current and frame:
            props[current] = (int(m.group(1)), *frame)
            current = None
    return props


def ptx_entries(ptx):
    """{kernel: body} of every .entry in the PTX."""
    parts = re.split(r"^\.visible \.entry (\w+)\(", ptx, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def test_nvcc_reports_no_spills(build):
    report, _ = build
    props = ptxas_properties(report)
    assert sorted(props) == sorted(KERNELS), f"kernels compiled: {sorted(props)}"
    spilling = {k: p for k, p in props.items() if p[2] or p[3]}
    assert not spilling, f"kernels spill registers (regs, stack, spill st, spill ld): {spilling}"
    # No local memory at all: the kernels print nothing (failures go to the
    # status record), and arguments copied to local memory (a runtime index
    # into them) would show as a stack frame.
    frames = {k: p[1] for k, p in props.items() if p[1]}
    assert not frames, f"kernels with a stack frame (bytes): {frames}"
    too_many = {k: p[0] for k, p in props.items() if p[0] > MAX_REGISTERS}
    assert not too_many, f"kernels above {MAX_REGISTERS} registers: {too_many}"


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
    # The status record: the first failing block claims it with a CAS, then
    # publishes the code with a system-scope release (the host polls it).
    assert re.search(r"atom\.global\.cas\.b32", body), "the status record must be claimed with atomicCAS"
    # Bitwise agreement with the CPU and Triton backends: adds only (no FMA
    # contraction) and "avg" as an IEEE division, not a reciprocal multiply.
    assert not re.search(r"\bfma\.", body), "fused multiply-add found (build with -fmad=false)"
    if kernel not in ALL_GATHER_KERNELS:  # all-gather copies; it divides nothing
        assert "div.rn.f32" in body, "avg must divide with div.rn.f32"
    assert not re.search(r"div\.(approx|full)\.f32|rcp\.approx", body), "approximate division found"
