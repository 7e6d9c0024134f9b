// The emulated CUDA runtime's rules, one check each, against what CUDA's
// Runtime API documentation says the runtime returns (each check cites the
// section). The emulation is trusted for what these show and no more:
// tests/test_cuda_emulated.py compiles this with g++ against the CUDA headers
// alone, links it to build/emulated/lib/libcudart_emulated.so and runs it.
// Prints "ok <rule>" or "FAIL <rule>: <why>" per rule; exits 1 on any failure.
#include <cuda.h>  // cuDevicePrimaryCtxGetState: the emulated library has it too
#include <cuda_runtime_api.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

// The emulation's own, for tests: the peer mappings open; a kernel's start and
// end (what the host shim reports); a launch on a stream (tests/emulated/kernels.cpp).
extern "C" int pyallreduce_emulated_peer_mappings();
extern "C" void pyallreduce_emulated_device_work(int running);
extern "C" void pyallreduce_emulated_enqueue(cudaStream_t, void (*)(void*), void (*)(void*), void*);
extern "C" void pyallreduce_emulated_fail(const char* function, int n);

namespace {

int failures = 0;

void report(const char* rule, const std::string& why) {
  if (why.empty()) {
    std::printf("ok %s\n", rule);
  } else {
    std::printf("FAIL %s: %s\n", rule, why.c_str());
    ++failures;
  }
}

// "" when got == want, else what differs.
std::string expect(cudaError_t got, cudaError_t want, const char* what) {
  if (got == want) return "";
  return std::string(what) + " returned " + cudaGetErrorName(got) + ", expected " + cudaGetErrorName(want);
}

// Runs fn in a child process and returns its wait status (fn may exit the
// child early with _exit(step)).
int in_child(const std::function<void()>& fn) {
  const pid_t pid = fork();
  if (pid == 0) {
    fn();
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return status;
}

// Runs fn in a child process; true when the child died of SIGSEGV.
bool faults(const std::function<void()>& fn) {
  const int status = in_child(fn);
  return WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV;
}

// Runs steps in a child process, which exits with the number of the step that
// failed; "" when none did, else which one (steps: what each number means).
std::string child_steps(const std::function<void()>& fn, const std::string& steps) {
  const int status = in_child(fn);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return "";
  return "the child failed at step " + std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : -1) + " (" +
         steps + ")";
}

cudaStream_t new_stream() {
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  return s;
}

// Ends the capture of s; the status of cudaStreamEndCapture.
cudaError_t end_capture(cudaStream_t s) {
  cudaGraph_t graph = nullptr;
  const cudaError_t err = cudaStreamEndCapture(s, &graph);
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaGetLastError();
  return err;
}

// cudaThreadExchangeStreamCaptureMode: "cudaStreamCaptureModeGlobal: ... if
// the local thread has an ongoing capture sequence that was not initiated with
// cudaStreamCaptureModeRelaxed ... this thread is prohibited from potentially
// unsafe API calls"; a prohibited call fails and invalidates the capture
// (cudaStreamEndCapture: cudaErrorStreamCaptureInvalidated).
std::string unsafe_call_in_own_global_capture() {
  cudaStream_t s = new_stream();
  cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
  void* p = nullptr;
  std::string why = expect(cudaMalloc(&p, 256), cudaErrorStreamCaptureUnsupported, "cudaMalloc while capturing");
  if (why.empty()) why = expect(end_capture(s), cudaErrorStreamCaptureInvalidated, "cudaStreamEndCapture");
  cudaStreamDestroy(s);
  return why;
}

// Same section: "... or if any other thread has a concurrent capture sequence
// initiated with cudaStreamCaptureModeGlobal, this thread is prohibited";
// "cudaStreamCaptureModeRelaxed: the local thread is not prohibited".
std::string unsafe_call_beside_another_threads_global_capture() {
  cudaStream_t s = new_stream();
  cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
  cudaError_t global = cudaSuccess, relaxed = cudaErrorUnknown;
  std::thread other([&] {
    void* p = nullptr;
    global = cudaMalloc(&p, 256);
    cudaGetLastError();
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode);
    relaxed = cudaMalloc(&p, 256);
    cudaThreadExchangeStreamCaptureMode(&mode);
    if (relaxed == cudaSuccess) cudaFree(p);
  });
  other.join();
  std::string why = expect(global, cudaErrorStreamCaptureUnsupported, "another thread's cudaMalloc (global mode)");
  if (why.empty()) why = expect(relaxed, cudaSuccess, "another thread's cudaMalloc (relaxed mode)");
  if (why.empty()) why = expect(end_capture(s), cudaErrorStreamCaptureInvalidated, "cudaStreamEndCapture");
  cudaStreamDestroy(s);
  return why;
}

// "cudaStreamCaptureModeThreadLocal: if the local thread has an ongoing
// capture sequence not initiated with cudaStreamCaptureModeRelaxed, it is
// prohibited": other threads are not.
std::string thread_local_capture_leaves_other_threads_free() {
  cudaStream_t s = new_stream();
  cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
  cudaError_t err = cudaErrorUnknown;
  std::thread other([&] {
    void* p = nullptr;
    err = cudaMalloc(&p, 256);
    if (err == cudaSuccess) cudaFree(p);
  });
  other.join();
  std::string why = expect(err, cudaSuccess, "another thread's cudaMalloc");
  if (why.empty()) why = expect(end_capture(s), cudaSuccess, "cudaStreamEndCapture");
  cudaStreamDestroy(s);
  return why;
}

// "cudaStreamCaptureModeRelaxed: the local thread is not prohibited from
// potentially unsafe API calls."
std::string relaxed_capture_allows_its_own_unsafe_calls() {
  cudaStream_t s = new_stream();
  cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed);
  void* p = nullptr;
  std::string why = expect(cudaMalloc(&p, 256), cudaSuccess, "cudaMalloc in a relaxed capture");
  if (why.empty()) why = expect(end_capture(s), cudaSuccess, "cudaStreamEndCapture");
  cudaFree(p);
  cudaStreamDestroy(s);
  return why;
}

// cudaStreamBeginCapture: "Capture may not be initiated if stream is cudaStreamLegacy."
std::string no_capture_on_the_legacy_stream() {
  const std::string why = expect(cudaStreamBeginCapture(cudaStreamLegacy, cudaStreamCaptureModeGlobal),
                                 cudaErrorStreamCaptureUnsupported, "cudaStreamBeginCapture(cudaStreamLegacy)");
  cudaGetLastError();
  return why;
}

// cudaStreamEndCapture: "If the capture was initiated with a mode other than
// cudaStreamCaptureModeRelaxed, it must be ended on the same thread"
// (cudaErrorStreamCaptureWrongThread).
std::string a_global_capture_ends_on_its_own_thread() {
  cudaStream_t s = new_stream();
  cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
  cudaError_t err = cudaSuccess;
  std::thread other([&] { err = end_capture(s); });
  other.join();
  std::string why = expect(err, cudaErrorStreamCaptureWrongThread, "cudaStreamEndCapture on another thread");
  if (why.empty()) why = expect(end_capture(s), cudaSuccess, "cudaStreamEndCapture on the beginning thread");
  cudaStreamDestroy(s);
  return why;
}

// A capture may not wait on an event recorded outside it: the dependency
// "crosses the capture sequence boundary" (cudaErrorStreamCaptureIsolation,
// Runtime API "Data types": cudaError), and the capture is invalidated.
std::string no_wait_on_an_event_recorded_outside_the_capture() {
  cudaStream_t a = new_stream(), b = new_stream();
  cudaEvent_t e = nullptr;
  cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  cudaEventRecord(e, a);
  cudaStreamBeginCapture(b, cudaStreamCaptureModeGlobal);
  std::string why = expect(cudaStreamWaitEvent(b, e, 0), cudaErrorStreamCaptureIsolation, "cudaStreamWaitEvent");
  cudaGetLastError();
  if (why.empty()) why = expect(end_capture(b), cudaErrorStreamCaptureInvalidated, "cudaStreamEndCapture");
  cudaEventDestroy(e);
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
  return why;
}

// cudaStreamSynchronize of a stream being captured is prohibited
// (cudaErrorStreamCaptureUnsupported) and invalidates its capture.
std::string no_sync_of_a_capturing_stream() {
  cudaStream_t s = new_stream();
  cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed);  // even relaxed: it conflicts with the capture
  std::string why = expect(cudaStreamSynchronize(s), cudaErrorStreamCaptureUnsupported, "cudaStreamSynchronize");
  cudaGetLastError();
  if (why.empty()) why = expect(end_capture(s), cudaErrorStreamCaptureInvalidated, "cudaStreamEndCapture");
  cudaStreamDestroy(s);
  return why;
}

// Synchronising the device while one of its streams is being captured is
// invalid in any mode ("Prohibited and Unhandled Operations": "synchronize a
// broader handle which encompasses an active stream capture, such as a device
// or context handle"): relaxed mode on this thread does not make it legal, and
// another device's capture does not matter.
std::string no_device_sync_beside_a_capture() {
  cudaSetDevice(0);
  cudaStream_t s = new_stream();
  cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
  cudaError_t relaxed = cudaSuccess, other_device = cudaErrorUnknown;
  std::thread other([&] {
    cudaSetDevice(0);
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode);
    relaxed = cudaDeviceSynchronize();
    cudaGetLastError();
    cudaSetDevice(1);
    other_device = cudaDeviceSynchronize();
    cudaThreadExchangeStreamCaptureMode(&mode);
  });
  other.join();
  std::string why = expect(relaxed, cudaErrorStreamCaptureUnsupported, "cudaDeviceSynchronize (relaxed mode)");
  if (why.empty()) why = expect(other_device, cudaSuccess, "cudaDeviceSynchronize of another device");
  end_capture(s);
  cudaStreamDestroy(s);
  return why;
}

// cudaGraphLaunch: the captured work runs at every launch, with the arguments
// it was captured with.
std::string captured_work_replays() {
  cudaStream_t s = new_stream();
  void* p = nullptr;
  cudaMalloc(&p, 64);
  cudaMemset(p, 0, 64);
  cudaStreamSynchronize(nullptr);
  cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
  cudaMemsetAsync(p, 7, 64, s);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  std::string why = expect(cudaStreamEndCapture(s, &graph), cudaSuccess, "cudaStreamEndCapture");
  unsigned char host[64] = {};
  cudaMemcpy(host, p, 64, cudaMemcpyDeviceToHost);
  if (why.empty() && host[0] != 0) why = "the captured memset ran at capture";
  if (why.empty()) why = expect(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess, "cudaGraphInstantiate");
  for (int replay = 0; replay < 2 && why.empty(); ++replay) {
    cudaMemset(p, 0, 64);  // on the legacy stream, which s (non-blocking) does not wait for:
    cudaStreamSynchronize(nullptr);
    why = expect(cudaGraphLaunch(exec, s), cudaSuccess, "cudaGraphLaunch");
    cudaStreamSynchronize(s);
    cudaMemcpy(host, p, 64, cudaMemcpyDeviceToHost);
    if (why.empty() && (host[0] != 7 || host[63] != 7)) why = "a replay did not write the captured value";
  }
  if (exec != nullptr) cudaGraphExecDestroy(exec);
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaFree(p);
  cudaStreamDestroy(s);
  return why;
}

// cudaStreamWaitEvent: "If cudaEventRecord() has not been called on event,
// this call acts as if the record has already completed, and so is a
// functional no-op"; cudaEventSynchronize: "If cudaEventRecord() has not been
// called on event, cudaSuccess is returned immediately."
std::string an_unrecorded_event_is_complete() {
  cudaStream_t s = new_stream();
  cudaEvent_t e = nullptr;
  cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  std::string why = expect(cudaStreamWaitEvent(s, e, 0), cudaSuccess, "cudaStreamWaitEvent");
  if (why.empty()) why = expect(cudaEventSynchronize(e), cudaSuccess, "cudaEventSynchronize");
  if (why.empty()) why = expect(cudaStreamSynchronize(s), cudaSuccess, "cudaStreamSynchronize");
  cudaEventDestroy(e);
  cudaStreamDestroy(s);
  return why;
}

// cudaSetDevice, since CUDA 12.0: "this function will now explicitly initialize
// the runtime", i.e. create the device's primary context (device memory); a
// device no call has used has none (cuDevicePrimaryCtxGetState). Runs first:
// no rule before it has used device 1.
std::string set_device_creates_a_context_and_only_it() {
  unsigned int flags = 0;
  int active = -1;
  cuDevicePrimaryCtxGetState(1, &flags, &active);
  if (active != 0) return "device 1 has a primary context before any call used it";
  std::thread([] { cudaSetDevice(1); }).join();
  cuDevicePrimaryCtxGetState(1, &flags, &active);
  if (active != 1) return "cudaSetDevice(1) created no primary context";
  return "";
}

// cudaFree: "cudaErrorInvalidValue ... if devPtr was not returned by an earlier
// cudaMalloc"; cudaGetLastError: "Returns the last error ... and resets it to
// cudaSuccess" (a non-sticky error).
std::string free_of_an_interior_pointer_fails_and_the_error_clears() {
  void* p = nullptr;
  cudaMalloc(&p, 4096);
  std::string why = expect(cudaFree(static_cast<char*>(p) + 256), cudaErrorInvalidValue, "cudaFree(interior)");
  if (why.empty()) why = expect(cudaGetLastError(), cudaErrorInvalidValue, "cudaGetLastError");
  if (why.empty()) why = expect(cudaGetLastError(), cudaSuccess, "cudaGetLastError again");
  if (why.empty()) why = expect(cudaFree(p), cudaSuccess, "cudaFree(base)");
  return why;
}

// cudaIpcGetMemHandle exports device allocations only (cudaErrorInvalidValue
// for host memory); cudaIpcOpenMemHandle "cannot be used to open a handle in
// the process that created it".
std::string ipc_exports_device_memory_and_not_to_itself() {
  void* p = nullptr;
  cudaMalloc(&p, 4096);
  cudaIpcMemHandle_t handle;
  std::string why = expect(cudaIpcGetMemHandle(&handle, p), cudaSuccess, "cudaIpcGetMemHandle(device)");
  void* opened = nullptr;
  if (why.empty()) {
    why = expect(cudaIpcOpenMemHandle(&opened, handle, cudaIpcMemLazyEnablePeerAccess),
                 cudaErrorDeviceUninitialized, "cudaIpcOpenMemHandle(own handle)");
  }
  cudaGetLastError();
  std::vector<char> host(64);
  if (why.empty()) why = expect(cudaIpcGetMemHandle(&handle, host.data()), cudaErrorInvalidValue,
                                "cudaIpcGetMemHandle(host memory)");
  cudaGetLastError();
  cudaFree(p);
  return why;
}

// "If the memory handle has already been opened by the current context, the
// reference count on the handle is incremented by 1 and the existing device
// pointer is returned" (cudaIpcOpenMemHandle); "Decrements the reference count
// of the memory returned by cudaIpcOpenMemHandle by 1. When the reference count
// reaches 0, this API unmaps the memory" (cudaIpcCloseMemHandle). Opened in a
// child process (a process cannot open its own handle).
std::string ipc_opens_are_reference_counted() {
  void* p = nullptr;
  cudaMalloc(&p, 4096);
  cudaIpcMemHandle_t handle;
  cudaIpcGetMemHandle(&handle, p);
  const std::string why = child_steps(
      [&handle] {
        void *a = nullptr, *b = nullptr;
        if (cudaIpcOpenMemHandle(&a, handle, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) _exit(2);
        if (cudaIpcOpenMemHandle(&b, handle, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess || b != a) _exit(3);
        if (pyallreduce_emulated_peer_mappings() != 1) _exit(4);
        if (cudaIpcCloseMemHandle(a) != cudaSuccess || pyallreduce_emulated_peer_mappings() != 1) _exit(5);
        if (cudaIpcCloseMemHandle(a) != cudaSuccess || pyallreduce_emulated_peer_mappings() != 0) _exit(6);
        if (cudaIpcCloseMemHandle(a) != cudaErrorInvalidValue) _exit(7);
      },
      "2 open, 3 second open not the same pointer, 4 not one mapping, 5 first close, 6 second close, "
      "7 a third close did not fail");
  cudaFree(p);
  return why;
}

// CUDA_VISIBLE_DEVICES (CUDA Programming Guide, "CUDA Environment Variables"):
// the ordinals number the visible GPUs alone, and cudaDeviceGetByPCIBusId
// finds no other; legacy IPC still opens a handle of a GPU the process cannot
// see ("cudaIpcOpenMemHandle can open handles to devices that may not be
// visible in the process calling the API"). The child sees GPU 1 only; the
// handle is of GPU 0.
std::string visible_devices_hide_gpus_but_not_their_ipc_handles() {
  cudaSetDevice(0);
  void* p = nullptr;
  cudaMalloc(&p, 4096);
  cudaIpcMemHandle_t handle;
  cudaIpcGetMemHandle(&handle, p);
  char gpu0[32] = {};
  cudaDeviceGetPCIBusId(gpu0, sizeof(gpu0), 0);
  const std::string why = child_steps(
      [&] {
        setenv("CUDA_VISIBLE_DEVICES", "1", 1);
        int n = 0, d = -1;
        char bus[32] = {};
        void* a = nullptr;
        if (cudaGetDeviceCount(&n) != cudaSuccess || n != 1) _exit(2);
        if (cudaDeviceGetPCIBusId(bus, sizeof(bus), 0) != cudaSuccess || std::strcmp(bus, gpu0) == 0) _exit(3);
        if (cudaDeviceGetByPCIBusId(&d, gpu0) != cudaErrorInvalidDevice) _exit(4);
        cudaGetLastError();
        if (cudaIpcOpenMemHandle(&a, handle, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) _exit(5);
        if (cudaIpcCloseMemHandle(a) != cudaSuccess) _exit(6);
      },
      "2 not one device, 3 ordinal 0 has GPU 0's bus id, 4 GPU 0's bus id has an ordinal, 5 open, 6 close");
  cudaFree(p);
  return why;
}

// cudaIpcOpenMemHandle: "cudaIpcMemHandles from each device in a given process
// may only be opened by one context per device per other process": once device
// 0's context opened a handle of the parent's GPU 0, device 1's may not open
// one (another allocation's too); device 0's still may.
std::string ipc_handles_of_a_gpu_open_in_one_context() {
  cudaSetDevice(0);
  void *p = nullptr, *q = nullptr;
  cudaMalloc(&p, 4096);
  cudaMalloc(&q, 4096);
  cudaIpcMemHandle_t hp, hq;
  cudaIpcGetMemHandle(&hp, p);
  cudaIpcGetMemHandle(&hq, q);
  const std::string why = child_steps(
      [&] {
        void *a = nullptr, *b = nullptr;
        cudaSetDevice(0);
        if (cudaIpcOpenMemHandle(&a, hp, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) _exit(2);
        cudaSetDevice(1);
        if (cudaIpcOpenMemHandle(&b, hq, cudaIpcMemLazyEnablePeerAccess) == cudaSuccess) _exit(3);
        cudaGetLastError();
        cudaSetDevice(0);
        if (cudaIpcOpenMemHandle(&b, hq, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) _exit(4);
        if (cudaIpcCloseMemHandle(a) != cudaSuccess || cudaIpcCloseMemHandle(b) != cudaSuccess) _exit(5);
      },
      "2 open on device 0, 3 device 1 opened it too, 4 a second open on device 0, 5 close");
  cudaFree(p);
  cudaFree(q);
  return why;
}

// cudaEventElapsedTime: "If cudaEventRecord() has not been called on either
// event, then cudaErrorInvalidResourceHandle is returned"; between two
// completed events in stream order, a time >= 0.
std::string elapsed_time_needs_recorded_events() {
  cudaEvent_t start = nullptr, end = nullptr;
  cudaEventCreate(&start);
  cudaEventCreate(&end);
  float ms = -1.0f;
  std::string why = expect(cudaEventElapsedTime(&ms, start, end), cudaErrorInvalidResourceHandle,
                           "cudaEventElapsedTime(unrecorded events)");
  cudaGetLastError();
  void* p = nullptr;
  cudaMalloc(&p, 1 << 20);
  cudaStream_t s = new_stream();
  cudaEventRecord(start, s);
  cudaMemsetAsync(p, 0, 1 << 20, s);
  cudaEventRecord(end, s);
  cudaStreamSynchronize(s);
  if (why.empty()) why = expect(cudaEventElapsedTime(&ms, start, end), cudaSuccess, "cudaEventElapsedTime");
  if (why.empty() && !(ms >= 0.0f)) why = "a negative time between events in stream order";
  cudaStreamDestroy(s);
  cudaFree(p);
  cudaEventDestroy(start);
  cudaEventDestroy(end);
  return why;
}

// cudaStreamIsCapturing: "if this is called on cudaStreamLegacy (the "null
// stream") while a blocking stream in the same device is capturing, it will
// return cudaErrorStreamCaptureImplicit ... The blocking stream capture is not
// invalidated." A non-blocking stream's capture (torch.cuda.graph's) leaves the
// query alone.
std::string legacy_stream_query_beside_a_blocking_capture() {
  std::string why;
  cudaStream_t blocking = nullptr;
  cudaStreamCreate(&blocking);
  cudaStream_t nonblocking = new_stream();
  cudaStreamCaptureStatus status;
  cudaStreamBeginCapture(nonblocking, cudaStreamCaptureModeRelaxed);
  why = expect(cudaStreamIsCapturing(nullptr, &status), cudaSuccess, "cudaStreamIsCapturing(legacy) beside a "
                                                                     "non-blocking stream's capture");
  end_capture(nonblocking);
  cudaStreamBeginCapture(blocking, cudaStreamCaptureModeRelaxed);
  if (why.empty()) {
    why = expect(cudaStreamIsCapturing(nullptr, &status), cudaErrorStreamCaptureImplicit,
                 "cudaStreamIsCapturing(legacy) beside a blocking stream's capture");
  }
  cudaGetLastError();
  if (why.empty()) why = expect(end_capture(blocking), cudaSuccess, "ending the blocking capture (not invalidated)");
  cudaStreamDestroy(blocking);
  cudaStreamDestroy(nonblocking);
  return why;
}

// "Peer-to-Peer Memory Access" (CUDA C++ Programming Guide): a kernel on one
// device dereferences memory of another only once peer access is enabled
// (cudaDeviceEnablePeerAccess, or an IPC mapping made in its own context). A
// kernel that reads memory another device allocated faults here; its own
// device's memory it reads. (Allocation on device 1, kernels on each device's
// stream, in child processes.)
std::string a_kernel_reads_only_its_devices_memory() {
  cudaSetDevice(1);
  void* p = nullptr;
  cudaMalloc(&p, 4096);
  cudaMemset(p, 0, 4096);
  cudaDeviceSynchronize();  // nothing running when the children fork (its locks would stay held there)
  cudaSetDevice(0);
  const auto kernel_on = [p](int device) {
    cudaSetDevice(device);
    cudaStream_t s = new_stream();
    const auto read = [](void* at) {
      pyallreduce_emulated_device_work(1);
      std::printf("%d\n", *static_cast<volatile int*>(at));
      pyallreduce_emulated_device_work(0);
    };
    pyallreduce_emulated_enqueue(s, read, [](void*) {}, p);
    cudaStreamSynchronize(s);
  };
  std::string why;
  if (faults([&] { kernel_on(1); })) why = "a kernel faulted on its own device's memory";
  if (why.empty() && !faults([&] { kernel_on(0); })) why = "a kernel read another device's memory";
  cudaSetDevice(1);
  cudaFree(p);
  cudaSetDevice(0);
  return why;
}

// A fault in a kernel is a sticky error: "cudaErrorIllegalAddress ... This
// leaves the process in an inconsistent state and any further CUDA work will
// return the same error. To continue using CUDA, the process must be
// terminated and relaunched." The wait for the faulting kernel returns it,
// cudaGetLastError returns it without clearing it, and later calls fail with
// it; a non-sticky error is cleared (free_of_an_interior_pointer_...). In a
// child process, whose CUDA it ruins.
std::string a_kernel_fault_is_sticky() {
  return child_steps(
      [] {
        cudaStream_t s = new_stream();
        pyallreduce_emulated_fail("kernel", 1);
        pyallreduce_emulated_enqueue(s, [](void*) {}, [](void*) {}, nullptr);
        if (cudaStreamSynchronize(s) != cudaErrorIllegalAddress) _exit(2);
        if (cudaGetLastError() != cudaErrorIllegalAddress || cudaGetLastError() != cudaErrorIllegalAddress) _exit(3);
        void* p = nullptr;
        if (cudaMalloc(&p, 64) != cudaErrorIllegalAddress) _exit(4);
      },
      "2 the wait did not return the fault, 3 cudaGetLastError cleared it, 4 a later call succeeded");
}

// The emulation's own honesty rules (what a GPU does): host code that reads
// device memory faults, and so does a read past an allocation's end.
std::string host_reads_of_device_memory_fault() {
  void* p = nullptr;
  cudaMalloc(&p, 4096);
  cudaStreamSynchronize(nullptr);
  std::string why;
  if (!faults([p] { std::printf("%d\n", *static_cast<volatile int*>(p)); })) why = "a host read did not fault";
  cudaFree(p);
  return why;
}

}  // namespace

int main() {
  setenv("PYALLREDUCE_EMULATED_DEVICES", "2", 1);  // two devices for the peer-access rule
  const std::vector<std::pair<const char*, std::function<std::string()>>> rules = {
      {"set_device_creates_a_context_and_only_it", set_device_creates_a_context_and_only_it},  // first
      {"unsafe_call_in_own_global_capture", unsafe_call_in_own_global_capture},
      {"unsafe_call_beside_another_threads_global_capture", unsafe_call_beside_another_threads_global_capture},
      {"thread_local_capture_leaves_other_threads_free", thread_local_capture_leaves_other_threads_free},
      {"relaxed_capture_allows_its_own_unsafe_calls", relaxed_capture_allows_its_own_unsafe_calls},
      {"no_capture_on_the_legacy_stream", no_capture_on_the_legacy_stream},
      {"a_global_capture_ends_on_its_own_thread", a_global_capture_ends_on_its_own_thread},
      {"no_wait_on_an_event_recorded_outside_the_capture", no_wait_on_an_event_recorded_outside_the_capture},
      {"no_sync_of_a_capturing_stream", no_sync_of_a_capturing_stream},
      {"no_device_sync_beside_a_capture", no_device_sync_beside_a_capture},
      {"captured_work_replays", captured_work_replays},
      {"an_unrecorded_event_is_complete", an_unrecorded_event_is_complete},
      {"free_of_an_interior_pointer_fails_and_the_error_clears", free_of_an_interior_pointer_fails_and_the_error_clears},
      {"ipc_exports_device_memory_and_not_to_itself", ipc_exports_device_memory_and_not_to_itself},
      {"ipc_opens_are_reference_counted", ipc_opens_are_reference_counted},
      {"visible_devices_hide_gpus_but_not_their_ipc_handles", visible_devices_hide_gpus_but_not_their_ipc_handles},
      {"ipc_handles_of_a_gpu_open_in_one_context", ipc_handles_of_a_gpu_open_in_one_context},
      {"elapsed_time_needs_recorded_events", elapsed_time_needs_recorded_events},
      {"legacy_stream_query_beside_a_blocking_capture", legacy_stream_query_beside_a_blocking_capture},
      {"a_kernel_reads_only_its_devices_memory", a_kernel_reads_only_its_devices_memory},
      {"a_kernel_fault_is_sticky", a_kernel_fault_is_sticky},
      {"host_reads_of_device_memory_fault", host_reads_of_device_memory_fault},
  };
  for (const auto& [name, check] : rules) report(name, check());
  return failures == 0 ? 0 : 1;
}
