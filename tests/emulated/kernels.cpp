// The extension's kernels for the emulated CUDA runtime: csrc/cuda/kernels.cu
// unchanged, compiled by g++ over the host shim, so a launch runs the real
// kernel source on host threads (and returns when it has finished).
#include "../sim/cuda_shim.h"
#include "../../csrc/cuda/kernels.cu"

// Device memory is open to the host only while device work runs (cudart.cpp).
// Weak: the extension also loads without the emulated runtime (its build loads it).
// Launches are enqueued on their stream's worker there. Weak: the extension
// also loads without the emulated runtime (its build loads it).
extern "C" __attribute__((weak)) void pyallreduce_emulated_device_work(int running);
extern "C" __attribute__((weak)) void pyallreduce_emulated_enqueue(cudaStream_t, void (*)(void*), void (*)(void*),
                                                                   void*);

namespace {
const bool hooked = [] {
  if (pyallreduce_emulated_device_work != nullptr) {
    sim::device_work_hook = [](bool running) { pyallreduce_emulated_device_work(running ? 1 : 0); };
  }
  if (pyallreduce_emulated_enqueue != nullptr) sim::stream_enqueue_hook = pyallreduce_emulated_enqueue;
  return true;
}();
}  // namespace

#ifdef PYALLREDUCE_EMULATED_COVERAGE
// gcov writes its counts at exit, but test ranks end with os._exit (as
// multiprocessing's children do): the emulated runtime's _exit runs this first.
extern "C" void __gcov_dump(void);
extern "C" __attribute__((weak)) void pyallreduce_emulated_before_exit(void (*)(void));

namespace {
const bool dumps_counts = [] {
  if (pyallreduce_emulated_before_exit != nullptr) pyallreduce_emulated_before_exit(__gcov_dump);
  return true;
}();
}  // namespace
#endif
