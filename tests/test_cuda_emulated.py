"""The GPU stack without a GPU: tests/test_cuda.py, unchanged, on the emulated
CUDA runtime (tests/emulated/cudart.cpp). torch's CUDA allocator and copies,
pyallreduce's CUDA glue (csrc/cuda/*.cpp), the CUDA IPC transport (with its
topology probe) and the Communicator's CUDA paths all run as they would on a
GPU, between processes; the kernels are csrc/cuda/kernels.cu over the host
shim. Device memory is closed to host code (PROT_NONE) except while device
work runs, so glue that dereferences a device pointer faults as on a GPU.

Work is asynchronous (a worker thread per stream, events, the legacy
stream's implicit synchronisation) and graph capture is emulated with the
rules that a misuse would otherwise hide (tests/emulated/cudart.cpp lists
them). Not emulated (test_cuda.py skips those checks here, and says so):
Triton's launches through the CUDA driver. Run alone:
`pytest tests -m cuda_emulated`.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "tests" / "emulated" / "build_emulated.py"
sys.path.insert(0, str(BUILD.parent))
import build_emulated  # noqa: E402

pytestmark = pytest.mark.cuda_emulated

if torch.version.cuda is None:  # the emulation runs torch's own CUDA code (libc10_cuda, the allocator)
    pytest.skip(f"the emulated GPU stack needs a CUDA build of torch (this is {torch.__version__})",
                allow_module_level=True)

_build = None


def start_background_compile(items):
    """conftest.py: the emulated runtime and extension build with the session."""
    global _build
    _build = subprocess.Popen(["nice", "-n", "19", sys.executable, str(BUILD)], cwd=ROOT, start_new_session=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return _build


@pytest.fixture(scope="module")
def emulated_env():
    proc = _build or start_background_compile([])
    out, _ = proc.communicate(timeout=1200)
    assert proc.returncode == 0, f"building the emulated GPU stack failed:\n{out[-6000:]}"
    return {**os.environ, **build_emulated.environment()}


def run_pytest_on_emulation(env, *args):
    proc = build_emulated.run_pytest(env, args, timeout=1500)
    return proc.returncode, proc.stdout + proc.stderr


def summary(out):
    passed = int(re.search(r"(\d+) passed", out).group(1))
    skips = re.findall(r"SKIPPED \[\d+\] [^:]+:\d+: (.*)", out)
    return passed, skips


def test_test_cuda_passes_on_the_emulated_runtime(emulated_env):
    rc, out = run_pytest_on_emulation(emulated_env, str(ROOT / "tests" / "test_cuda.py"))
    assert rc == 0, out[-8000:]
    passed, skips = summary(out)
    # Every CUDA-backend check (eager, graphs, registration, reduce-scatter and
    # all-gather, mismatches, two streams, back to back) at 2 and 4 ranks,
    # the deadline, the README snippet, the capture error, calls beside another
    # thread's capture, the torch.distributed backend on CUDA tensors,
    # unregistering at once, the DDP hook and the README's DDP snippet on a real
    # DDP, runtime failures and a kernel fault on one rank, a device other than
    # the current one, the Triton host side inside a capture; only the Triton
    # launches skipped.
    assert passed >= 42, out[-3000:]
    assert all("not emulated" in reason for reason in skips), out[-3000:]


def test_eager_checks_with_device_work_starting_late(emulated_env):
    """Every copy, memset and kernel starts up to 300 us after it could: host
    code that reads results, reuses buffers or tells peers to look without
    waiting for the device shows (check_back_to_back reuses inputs at once)."""
    env = {**emulated_env, "PYALLREDUCE_EMULATED_DELAY_US": "300"}
    rc, out = run_pytest_on_emulation(env, str(ROOT / "tests" / "test_cuda.py"), "-k",
                                      "on_one_gpu and (eager or back_to_back or graph_reads) and -2]")
    assert rc == 0, out[-8000:]
    assert summary(out)[0] == 3, out[-3000:]


def test_the_emulation_faults_on_host_access_to_device_memory_and_runs_no_torch_kernel(emulated_env):
    """The two rules that keep the emulation honest: host code that reads device
    memory faults (as on a GPU), and a torch kernel fails loudly instead of
    silently doing nothing."""
    probe = ("import ctypes, sys, torch\n"
             "x = torch.tensor([1.0, 2.0]).to('cuda')\n"
             "assert x.cpu().tolist() == [1.0, 2.0]\n"
             "try:\n"
             "    x.fill_(3.0); torch.cuda.synchronize()\n"
             "    sys.exit('a torch kernel ran')\n"
             "except RuntimeError as e:\n"
             "    assert 'invalid device function' in str(e), e\n"
             "print('read', flush=True)\n"
             "ctypes.c_float.from_address(x.data_ptr()).value\n"
             "sys.exit('host code read device memory')\n")
    proc = subprocess.run([sys.executable, "-P", "-c", probe], cwd=build_emulated.OUT, env=emulated_env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -11 and proc.stdout == "read\n", (proc.returncode, proc.stdout, proc.stderr[-3000:])


def test_the_emulated_runtime_keeps_cuda_rules(emulated_env, tmp_path):
    """tests/emulated/rules.cpp: each rule of the emulation (which devices get a
    context, capture modes and
    what they prohibit, the legacy stream, the ending thread, isolation,
    replays, unrecorded events, event times, frees, IPC and its reference
    counts, CUDA_VISIBLE_DEVICES and IPC handles of GPUs not visible, one
    importing context per peer GPU, the legacy stream's capture query, no
    device sync beside a capture, kernels and other devices' memory, sticky
    kernel faults, host access) against the return
    codes CUDA's Runtime API documents, through the runtime's C API alone."""
    exe = tmp_path / "rules"
    subprocess.run(["g++", "-std=c++20", "-O1", "-I", build_emulated.cuda_include(), str(BUILD.parent / "rules.cpp"),
                    "-L", str(build_emulated.LIB), "-lcudart_emulated", f"-Wl,-rpath,{build_emulated.LIB}",
                    "-lpthread", "-o", str(exe)], check=True, capture_output=True, text=True)
    for delay in ("0", "300"):  # and with device work starting up to 300 us late: a check that races shows
        proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYALLREDUCE_EMULATED_DELAY_US": delay})
        lines = proc.stdout.splitlines()
        assert proc.returncode == 0 and len(lines) == 22 and all(line.startswith("ok ") for line in lines), \
            f"delay {delay} us:\n{proc.stdout}{proc.stderr}"


def test_cuda_explorer_on_the_emulated_runtime(emulated_env):
    """tests/explorer.py's CudaExplorer (test_explorer.py::test_cuda_explorer):
    its seeds' random lifecycles of CUDA communicators on the emulation's two
    GPUs, ranks on either, with registration, capture and replay, calls
    beside another thread's capture, threads, close, a close racing another
    thread's call, abort, IPC imports CUDA refuses, and (CUDA_KILLED_RUNS) a
    rank killed at the end. Launches from other
    threads than the main one start up to 3 ms late (the emulation's launch
    jitter): a close racing such a call then meets it between its start and
    its launch at the step's drawn delays, not only in a few microseconds."""
    from test_explorer import CUDA_KILLED_RUNS, CUDA_RUNS

    rc, out = run_pytest_on_emulation({**emulated_env, **build_emulated.LAUNCH_JITTER},
                                      str(ROOT / "tests" / "test_explorer.py"), "-k", "cuda")
    assert rc == 0, out[-8000:]
    assert summary(out)[0] == len(CUDA_RUNS) + len(CUDA_KILLED_RUNS), out[-3000:]


def test_compare_nccl_runs_the_gpu_path_on_the_emulation(emulated_env, tmp_path):
    """bench/compare_nccl.py on the emulated runtime: the CUDA communicator, IPC
    and comm.capture() graphs (1 KiB is timed as graph replays) for every algo
    and op (fp32 only: every dtype runs in test_test_cuda_passes_on_the_emulated_runtime),
    a chunked size (256 KiB in 64 KiB runs) included, checked exactly against the
    expected sums and the reference (gloo through host copies there); its times
    are labelled as the emulation's."""
    out = tmp_path / "emulated.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "compare_nccl.py"), "--device", "cuda", "--nproc", "2",
                           "--sizes", "1K:256K", "--factor", "256", "--dtypes", "float32", "--ops", "sum,avg",
                           "--iters", "2", "--warmup", "1", "--max-bytes", "64K", "--graph-max-bytes", "1K",
                           "--json", str(out)],
                          cwd=tmp_path, env=emulated_env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "EMULATED CUDA runtime" in proc.stdout and "# wrong elements: 0 OK" in proc.stdout, proc.stdout[-3000:]
    report = json.loads(out.read_text())
    assert report["machine"]["emulated"] is True
    rows = report["rows"]
    assert len(rows) == 2 * 2 * 3 and all(r["wrong"] == 0 and r["backend"] == "cuda" for r in rows), rows


def test_loopback_cuda_small_calls_and_floors_on_the_emulation(emulated_env, tmp_path):
    """bench/loopback_cuda.py, which bench/gpu_check.sh runs on a lent GPU, on
    the emulated runtime: W ranks in one process on one GPU, from 256 B, and
    the 16-byte floor rows, each exact; its times labelled as the emulation's.
    Eager calls only: the emulation captures no graph forked across streams
    (the graph mode ran on the H100 and H200 of 2026-11-26), and it runs no
    torch kernel (no empty-kernel floor, no copy rate)."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "loopback_cuda.py"), "--world-sizes", "2,3",
                           "--sizes", "256,4K,64K", "--dtype", "bfloat16", "--nblocks", "2", "--iters", "2",
                           "--reps", "2", "--out", str(tmp_path)],
                          cwd=tmp_path, env=emulated_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "EMULATED CUDA runtime" in proc.stdout, proc.stdout[-3000:]
    (result,) = tmp_path.glob("loopback_cuda-*.json")
    report = json.loads(result.read_text())
    assert report["emulated"] is True and report["floors_us"] == {} and report["copy_GBps"] is None
    rows = report["rows"]
    # per world size: the floor (one_shot), then 3 sizes x 2 algos, eager
    assert len(rows) == 2 * (1 + 3 * 2) and {r["mode"] for r in rows} == {"eager"}, rows
    assert all(r["wrong"] == 0 for r in rows), [r for r in rows if r["wrong"]]
    assert {(r["world_size"], r["bytes"]) for r in rows if r["floor"]} == {(2, 16), (3, 16)}
    assert {r["bytes"] for r in rows} == {16, 256, 4096, 65536}
