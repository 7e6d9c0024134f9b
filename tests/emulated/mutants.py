"""Deliberate bugs in the CUDA glue and the Python GPU stack, each of which a
test that CI runs must catch (on the emulated CUDA runtime, or on the stubs
of tests/test_lifetimes.py): a check that cannot fail proves nothing.

Each mutant is a set of textual changes (each must match exactly once, so a
mutant that no longer applies is reported, not skipped) applied to the
working tree in place (the emulated package links the repository's files;
ninja then rebuilds only the changed objects), then the tests that should
catch it run; every file is restored afterwards, also on an interrupt (not
if the runner itself is killed: `git status` then shows the mutated file). The
mutant is caught when those tests fail.

    python tests/emulated/mutants.py [--only NAME]

Prints a table (name, result, seconds) and exits 1 if any mutant survived.
Results are recorded in docs/verification.md.
"""
import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import build_emulated  # noqa: E402

ROOT = build_emulated.ROOT
TEST_CUDA = str(ROOT / "tests" / "test_cuda.py")
LATE = {"PYALLREDUCE_EMULATED_DELAY_US": "300"}  # device work starts up to 300 us late

LAZY_STATUS_RECORD = '''  if (own_record(ctx) == nullptr) {
    StatusRecord& rec = status_by_context[&ctx];
    void* host = nullptr;
    check_cuda(cudaHostAlloc(&host, sizeof(CallStatus), cudaHostAllocMapped), "cudaHostAlloc");
    std::memset(host, 0, sizeof(CallStatus));
    static_cast<CallStatus*>(host)->generation = 1;
    check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&rec.device), host, 0), "mapping");
    rec.host = static_cast<CallStatus*>(host);
    check_cuda(cudaMalloc(reinterpret_cast<void**>(&rec.claim), sizeof(uint32_t)), "cudaMalloc");
    check_cuda(cudaMemset(rec.claim, 0, sizeof(uint32_t)), "cudaMemset");
    check_cuda(cudaEventCreateWithFlags(&rec.launched, cudaEventDisableTiming), "cudaEventCreate");
    rec.own_region = ctx.own_region();
    return rec;
  }
  return *own_record(ctx);'''

# (name, [(file, original text, mutated text)], where ("emulated" or "host"), pytest arguments, extra env)
MUTANTS = [
    ("the status record made at the first kernel call (inside a capture: the review's bug 2)",
     [("csrc/cuda/adapter.cpp", "          prepare(*ctx, current_stream(ctx->device));", "          (void)ctx;"),
      ("csrc/cuda/glue.cpp",
       '''  StatusRecord* rec = own_record(ctx);
  require(rec != nullptr,
          "this CUDA communicator has no status record (_C.cuda_prepare was not called after create_context)");
  return *rec;''', LAZY_STATUS_RECORD)],
     "emulated", [TEST_CUDA, "-k", "readme_capture_snippet or check_graph_reads_inputs_in_place"], {}),
    ("no event wait between launches on two streams",
     [("csrc/cuda/glue.cpp", '''    check_cuda(cudaStreamWaitEvent(stream, rec.launched, 0), "cudaStreamWaitEvent");''', "")],
     "emulated", [TEST_CUDA, "-k", "check_two_streams"], LATE),
    ("a graph-table block allocated in global capture mode beside another thread's capture",
     [("csrc/cuda/glue.cpp", '''GraphBlock allocate_block(int device, int64_t n, cudaStream_t stream) {
  DeviceScope scope(device);''', '''GraphBlock allocate_block(int device, int64_t n, cudaStream_t stream) {
  check_cuda(cudaSetDevice(device), "cudaSetDevice");''')],
     "emulated", [TEST_CUDA, "-k", "beside_another_threads_capture"], {}),
    ("close()'s wait in global capture mode beside another thread's capture",
     [("csrc/cuda/runtime.cpp", '''void wait_until_unused(int device, cudaEvent_t launched, bool captured) {
  DeviceScope scope(device);''', '''void wait_until_unused(int device, cudaEvent_t launched, bool captured) {
  check_cuda(cudaSetDevice(device), "cudaSetDevice");''')],
     "emulated", [TEST_CUDA, "-k", "beside_another_threads_capture"], {}),
    ("close() waits for the whole device though none of its kernels was captured (a real H100 refused it)",
     [("csrc/cuda/runtime.cpp", "  if (!captured) {\n    if (launched",  "  if (false) {\n    if (launched")],
     "emulated", [TEST_CUDA, "-k", "beside_another_threads_capture"], {}),
    ("a close that could not wait frees the graph table and status record (unwaited: under a replay)",
     [("pyallreduce/engines/cuda.py", "                    self.unwaited = str(e)\n                else:\n",
       "                    self.unwaited = str(e)\n                if True:\n")],
     "emulated", [TEST_CUDA, "-k", "close_after_captures"], {}),
    ("a close that could not wait unmaps the peers (a replay reads them)",
     [("pyallreduce/transport/cuda_ipc.py",
       "            self._opened, self.regions = {}, []  # our kernels may still read them: they stay mapped",
       "            pass")],
     "emulated", [TEST_CUDA, "-k", "close_after_captures"], {}),
    ("comm.capture() left inside the graph capture not refused (registers there)",
     [("pyallreduce/engines/cuda.py", "            if stream_capturing(self.device):\n",
       "            if False:\n")],
     "emulated", [TEST_CUDA, "-k", "left_inside_the_graph_capture"], {}),
    ("comm.capture()'s exit writes graph entries though its wait for the kernels was refused",
     [("pyallreduce/engines/cuda.py",
       '            buffers = [f"waiting for the communicator\'s kernels failed: {e}"] * len(zero_copy)\n',
       "            pass\n")],
     "emulated", [TEST_CUDA, "-k", "capture_exit_beside"], {}),
    ("a peer's captured input stays mapped when mapping failed on another rank at comm.capture()'s exit",
     [("pyallreduce/transport/cuda_ipc.py",
       "            self._unuse([h for handles in used for h in handles])  # nothing will read them\n",
       "            pass\n")],
     "emulated", [TEST_CUDA, "-k", "mapping_a_captured_input_fails"], {}),
    ("the status record's failure on one rank not shared at construction",
     [("pyallreduce/engines/cuda.py", "        set_up_on_every_rank(self, group, lambda: _C.cuda_prepare(self.handle))",
       "        _C.cuda_prepare(self.handle)")],
     "emulated", [TEST_CUDA, "-k", "runtime_failures_on_one_rank"], {}),
    ("destroy_process_group closes the CUDA communicator without serving (the review's bug 1)",
     [("pyallreduce/backend.py", "                with self._scope(turn=False, serve=True):\n                    for comm in comms:",
       "                if True:\n                    for comm in comms:")],
     "emulated", [TEST_CUDA, "-k", "backend_with_cuda_tensors"], {}),
    ("captured inputs released at close before the peers unmapped",
     [("pyallreduce/engines/cuda.py", "                self.transport.keep(_C.cuda_clear_buffers(self.handle))",
       "                _C.cuda_clear_buffers(self.handle)")],
     "host", [str(ROOT / "tests" / "test_lifetimes.py"), "-k", "keeps_captured_inputs"], {}),
    ("a peer's mapping closed before its last kernel (unregister without the device wait)",
     [("pyallreduce/engines/cuda.py", "            self.wait_until_unused()\n"
       "            found = _C.cuda_unregister_buffer(self.handle, ptr)",
       "            found = _C.cuda_unregister_buffer(self.handle, ptr)")],
     "emulated", [TEST_CUDA, "-k", "unregister_right_after_calls"], LATE),
    ("a peer's handle opened again by each user (mapped twice, closed once)",
     [("pyallreduce/transport/cuda_ipc.py", "        if entry is None:\n            entry = self._opened[handle] = ",
       "        if True:\n            entry = self._opened[handle] = ")],
     "emulated", [TEST_CUDA, "-k", "unregister_right_after_calls or check_registered"], {}),
    ("the staging region allocated without making the communicator's device current",
     [("csrc/cuda/runtime.cpp", '  require(nbytes > 0, "region size must be positive");\n  DeviceScope scope(device);',
       '  require(nbytes > 0, "region size must be positive");\n  RelaxedCaptureScope relaxed;')],
     "emulated", [TEST_CUDA, "-k", "a_device_other_than_the_current_one"], {}),
    ("the backend's CUDA Work without its stream event (wait() on another stream orders nothing)",
     [("csrc/backend.cpp",
       "  if (result.is_cuda() && !cuda_current_stream_capturing(result.get_device())) devices.push_back(result.device());",
       "")],
     "emulated", [TEST_CUDA, "-k", "backend_with_cuda_tensors"], {}),
    ("the backend's synchronize() ordering nothing on a CUDA call",
     [("csrc/backend.cpp", "  void synchronize() override { future_->wait(); }", "  void synchronize() override {}")],
     "emulated", [TEST_CUDA, "-k", "backend_with_cuda_tensors"], {}),
    ("a Python-served call's synchronize() forwarded to torch's Python Work trampoline (orders nothing)",
     [("csrc/backend.cpp", "  void synchronize() override { work_->wait(); }", "  void synchronize() override { work_->synchronize(); }")],
     "emulated", [TEST_CUDA, "-k", "backend_with_cuda_tensors"], {}),
    ("torch's abort of a group closing its CUDA communicator collectively (with peers that never call it)",
     [("pyallreduce/backend.py", '_logged(comm.abort, "aborting its communicator")', 'comm.close()')],
     "emulated", [TEST_CUDA, "-k", "backend_abort"], {}),
    ("an abort that leaves a CUDA kernel waiting for a peer until its deadline (no cuda_interrupt)",
     [("csrc/module.cpp", "  if (end_kernels && ctx->is_cuda) cuda_interrupt(*ctx);\n", "")],
     "emulated", [TEST_CUDA, "-k", "abort_ends_waiting_kernels"], {}),
    ("an abort beside a close() on another thread not reaching the engine that close still holds",
     [("pyallreduce/communicator.py",
       "            if not sync:  # an abort (or exit) beside a close() that may wait for a call in flight\n"
       "                self._interrupt(end_kernels)\n", "")],
     "emulated", [TEST_CUDA, "-k", "abort_beside_a_close"], {}),
    ("the Triton status record and region table made at the first call, with no capture check (the review's bug 3)",
     [("pyallreduce/engines/triton.py", "lambda: triton_kernels.prepare(self.transport.regions, device))\n",
       "lambda: None)\n"),
      ("triton_kernels/__init__.py",
       "        if key[1].type == \"cuda\" and torch.cuda.is_current_stream_capturing():\n            raise",
       "        if False:\n            raise")],
     "emulated", [TEST_CUDA, "-k", "triton_capture"], {}),
    ("the agreement round of an empty call not skipped inside a capture (the review's bug 3)",
     [("pyallreduce/communicator.py",
       "        if self._engine is None or torch.compiler.is_compiling() or stream_capturing(self.device):",
       "        if self._engine is None or torch.compiler.is_compiling():")],
     "emulated", [TEST_CUDA, "-k", "triton_capture"], {}),
    ("close() frees the status record and buffers before sealing the communicator (the review's bug 2)",
     [("pyallreduce/engines/cuda.py",
       "                _C.seal_context(self.handle)\n",
       "                self.wait_until_unused()\n"
       "                self.transport.keep(_C.cuda_clear_buffers(self.handle))\n"
       "                _C.seal_context(self.handle)\n")],
     "emulated", [str(ROOT / "tests" / "test_explorer.py"), "-k", "cuda"], build_emulated.LAUNCH_JITTER),
    ("the Triton engine's allocations and waits in global capture mode beside another thread's capture",
     [("pyallreduce/engines/__init__.py", '    if device.type != "cuda" or not _C.WITH_CUDA:\n        yield\n',
       "    if True:\n        yield\n")],
     "emulated", [TEST_CUDA, "-k", "triton_beside"], {}),
    ("the DDP hook's side stream not waiting for the gradients' stream",
     [("pyallreduce/ddp.py", "        stream.wait_stream(torch.cuda.current_stream(self.device))\n", "")],
     "emulated", [TEST_CUDA, "-k", "ddp_hook"], LATE),
]


def build():
    """build_emulated.py in a process of its own (building loads the extension,
    and a process can load its op library only once); returns its environment."""
    proc = subprocess.run([sys.executable, str(HERE / "build_emulated.py")], capture_output=True, text=True,
                          check=True)
    return dict(line[len("export "):].split("=", 1) for line in proc.stdout.splitlines()
                if line.startswith("export "))


def run_mutant(edits, where, args, extra_env, timeout):
    originals = {}
    try:
        for path, old, new in edits:
            target = ROOT / path
            text = originals.setdefault(target, target.read_text())
            current = target.read_text()
            if current.count(old) != 1:
                return "DOES NOT APPLY", 0.0
            target.write_text(current.replace(old, new))
        t0 = time.monotonic()
        if where == "emulated":
            env = {**os.environ, **build(), **extra_env}
            proc = build_emulated.run_pytest(env, ["-x", *args], timeout=timeout)
        else:
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *args],
                                  cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        seconds = time.monotonic() - t0
    except subprocess.TimeoutExpired:
        return "caught (hang)", timeout
    finally:
        for target, text in originals.items():
            target.write_text(text)
    if proc.returncode == 0:
        return "SURVIVED", seconds
    out = proc.stdout + proc.stderr
    first = next((line.strip() for line in out.splitlines() if line.strip().startswith("E ") and "Error" in line), "")
    summary = (out.strip().splitlines() or [""])[-1]
    return f"caught: {summary[:80]} {first[:140]}", seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="run the mutants whose name contains this")
    parser.add_argument("--timeout", type=float, default=900)
    opts = parser.parse_args()
    survived = 0
    for name, edits, where, args, extra_env in MUTANTS:
        if opts.only and opts.only not in name:
            continue
        result, seconds = run_mutant(edits, where, args, extra_env, opts.timeout)
        survived += not result.startswith("caught")
        print(f"| {name} | {where} | {result} | {seconds:.0f} s |", flush=True)
    if any(where == "emulated" for _, _, where, _, _ in MUTANTS):
        build()  # the restored sources, so the next run starts from them
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
