// The CUDA-runtime side of the glue that is not about one communicator:
// errors, capture-mode scopes, waits, the device scope, and the calls of the
// CUDA IPC transport and the topology probe (pyallreduce/transport/). Plain
// C++ on the CUDA runtime: no torch header, so it builds against any CUDA
// runtime, the emulated one of tests/emulated included. Errors are thrown as
// std::runtime_error with a "pyallreduce: ..." message; the torch adapter
// (adapter.cpp) passes them on as Python RuntimeErrors.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

namespace pyallreduce {
namespace cuda {

// Raises "pyallreduce: <what> failed: <error name> (<error string>)",
// clearing a non-sticky error first so later calls are not blamed for it.
[[noreturn]] void raise_cuda(cudaError_t err, const char* what);
inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) raise_cuda(err, what);
}
// Raises std::runtime_error("pyallreduce: " + message) unless ok.
inline void require(bool ok, const std::string& message) {
  if (!ok) throw std::runtime_error("pyallreduce: " + message);
}

// This thread's stream-capture mode is relaxed for the scope. The glue's
// setup and teardown (allocation, frees, IPC, copies it waits for, waits on
// its own event and streams) are "potentially unsafe API calls": in the
// default global mode they fail, and invalidate the capture, while another
// thread captures in global mode (torch.cuda.graph's default; CUDA Runtime
// API, cudaStreamBeginCapture and cudaThreadExchangeStreamCaptureMode). None
// of them touches a stream that another thread captures, so relaxed is safe.
class RelaxedCaptureScope {
 public:
  RelaxedCaptureScope() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCaptureScope() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCaptureScope(const RelaxedCaptureScope&) = delete;
  RelaxedCaptureScope& operator=(const RelaxedCaptureScope&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// How a thread's current device is switched and put back: torch's way. Since
// CUDA 12.0 cudaSetDevice creates the device's primary context (hundreds of MiB
// of its memory; refused in EXCLUSIVE_PROCESS mode when another process holds
// it), so torch puts back a device that has no context yet without setting it:
// it remembers it as the thread's device instead (c10::cuda::MaybeSetDevice),
// and torch.cuda.current_device() still names it. A plain cudaSetDevice back
// would create a context on GPU 0 in every rank whose thread never used GPU 0.
// The adapter sets these to torch's functions at import (set_device_switch);
// DeviceScope uses nothing else.
struct DeviceSwitch {
  int (*exchange)(int device);  // makes `device` current; returns the thread's device before
  void (*put_back)(int device);  // the thread's device again, creating no context
};
void set_device_switch(DeviceSwitch device_switch);

// `device` current for the scope (the thread's device put back after, by
// DeviceSwitch), with its primary context created (driver calls need a current
// context), in a RelaxedCaptureScope.
class DeviceScope {
 public:
  explicit DeviceScope(int device);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  RelaxedCaptureScope relaxed_;  // first: every call below is in it
  int previous_ = -1;
};

// Waits until the work enqueued so far on `stream` (and, first, `event`, if
// not null) has finished, and for nothing else: never cudaDeviceSynchronize,
// which waits for every stream of the device, NCCL's and the training's too.
// In a RelaxedCaptureScope. Every wait of a call goes through here.
cudaError_t wait_relaxed(cudaEvent_t event, cudaStream_t stream);

// The wait of teardown and of changes to what a communicator's kernels read
// (unregister, graph entries, close): until no kernel of it may still run.
// While none was ever captured, its eager kernels are all it has, and they all
// run before `launched` (its launch chain's event; null: nothing launched
// yet). Once one was captured, a graph holding it may replay on any stream, so
// every stream of the device is waited for, on purpose. CUDA forbids that
// device-wide wait while any stream of the device is being captured, in any
// capture mode ("Prohibited and Unhandled Operations": synchronising "a device
// or context handle" beside an active capture), so it then raises, saying
// to do this after that capture ends. In a DeviceScope (relaxed mode), so that
// another thread's global-mode capture neither fails the event wait nor is
// invalidated by it.
void wait_until_unused(int device, cudaEvent_t launched, bool captured);

// ---- regions and legacy IPC (pyallreduce/transport/cuda_ipc.py) ----------------

// A zeroed allocation of its own (not the caching allocator's: exportable with
// legacy IPC, freed exactly when the transport says), zeroed on `stream` and
// waited for: flags and epochs must be zero before any peer sees the handle.
int64_t alloc_region(int device, int64_t nbytes, cudaStream_t stream);
void free_region(int device, int64_t addr);
// The handle of the allocation that starts at addr (an allocation base: see
// address_range), as bytes to send to peers.
std::string ipc_handle(int device, int64_t addr);
// Maps a peer's allocation in this process. Another process's handle may be on
// the same device as ours (several ranks sharing one GPU) or on a peer device.
int64_t ipc_open(int device, const std::string& handle);
void ipc_close(int device, int64_t addr);
// (base, size) of the allocation holding addr: legacy IPC exports whole
// allocations, so a tensor from torch's caching allocator is exported as its
// segment's base plus the tensor's offset.
std::pair<int64_t, int64_t> address_range(int device, int64_t addr);
// Whether addr's allocation can be exported with cudaIpcGetMemHandle. Memory
// from cuMemCreate (torch's expandable segments) or from memory pools
// (cudaMallocAsync) cannot; the communicator then keeps the staging copy.
bool ipc_exportable(int device, int64_t addr);

// ---- topology (pyallreduce/transport/topology.py) ---------------------------------

bool can_access_peer(int device, int peer);
// "dddd:bb:dd.f": identifies a GPU across processes whatever CUDA_VISIBLE_DEVICES says.
std::string pci_bus_id(int device);
// This process's index of the GPU with that bus id, or -1 when it is not visible.
int device_by_pci_bus_id(const std::string& bus_id);
// Copy between any two addresses (host, own device, IPC-mapped peer memory)
// on `stream`, finished when it returns: the topology probe writes peers'
// memory with it and then tells them to look. cudaMemcpy alone does not wait
// for a device-to-device copy (CUDA's "API synchronization behavior"), and a
// peer then read its buffer before our bytes landed (seen on an H200, 2026-11-26).
void memcpy_sync(int device, int64_t dst, int64_t src, int64_t nbytes, cudaStream_t stream);

}  // namespace cuda
}  // namespace pyallreduce
