// The CUDA-runtime calls of csrc/cuda/runtime.h.
//
// Driver functions (address ranges, pointer attributes) are reached through
// the runtime's driver entry point lookup (driver_function below): the
// extension does not link libcuda, so it imports on a machine without an
// NVIDIA driver and only these calls fail there, with a Python exception.
#include "runtime.h"

#include <cuda.h>  // driver types only; nothing from libcuda is linked

#include <cstring>
#include <string>

namespace pyallreduce {
namespace cuda {

void raise_cuda(cudaError_t err, const char* what) {
  cudaGetLastError();  // clear a non-sticky error so later calls are not blamed for it
  throw std::runtime_error(std::string("pyallreduce: ") + what + " failed: " + cudaGetErrorName(err) + " (" +
                           cudaGetErrorString(err) + ")");
}

namespace {
DeviceSwitch device_switch{};
}  // namespace

void set_device_switch(DeviceSwitch s) { device_switch = s; }

DeviceScope::DeviceScope(int device) {
  require(device_switch.exchange != nullptr, "the CUDA device switch was not set (the adapter sets it at import)");
  int count = 0;
  check_cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  require(device >= 0 && device < count,
          "CUDA device " + std::to_string(device) + " does not exist (" + std::to_string(count) + " visible)");
  previous_ = device_switch.exchange(device);
  check_cuda(cudaFree(nullptr), "initialising CUDA on the device");
}

DeviceScope::~DeviceScope() {
  if (previous_ >= 0) device_switch.put_back(previous_);
}

cudaError_t wait_relaxed(cudaEvent_t event, cudaStream_t stream) {
  RelaxedCaptureScope relaxed;
  cudaError_t err = cudaSuccess;
  if (event != nullptr) err = cudaEventSynchronize(event);  // never recorded: returns at once
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  return err;
}

void wait_until_unused(int device, cudaEvent_t launched, bool captured) {
  DeviceScope scope(device);
  if (!captured) {
    if (launched != nullptr) check_cuda(cudaEventSynchronize(launched), "waiting for the communicator's kernels");
    return;
  }
  const cudaError_t err = cudaDeviceSynchronize();
  if (err == cudaErrorStreamCaptureUnsupported) {
    cudaGetLastError();
    require(false, "a CUDA graph holding this communicator's kernels may be replaying on any stream, and CUDA "
                   "cannot wait for the whole device while one of its streams is being captured (another "
                   "thread's torch.cuda.graph?): do this after that capture ends");
  }
  check_cuda(err, "cudaDeviceSynchronize");
}

namespace {

// A driver function through the runtime. Which lookup depends on the CUDA
// major version, because the extension must build with every toolkit that
// torch>=2.4 admits (12.1 on) and import with the libcudart torch ships, whose
// minor version may be older than the toolkit's (torch only insists on the
// same major):
//  - CUDA 13+: cudaGetDriverEntryPointByVersion (every 13.x libcudart has it;
//    the old call is deprecated there), pinned to the CUDA 12.0 ABI of the
//    symbol, which is what the typedefs at the call sites are written for.
//  - CUDA 12.x: cudaGetDriverEntryPoint(symbol, fn, flags, status), in every
//    12.x libcudart. Not ...ByVersion even when building with 12.5+ headers:
//    it is missing from torch's libcudart 12.1-12.4, and one undefined symbol
//    makes the whole _C (the CPU backend too) fail to import. It returns the
//    symbol's version for the running 12.x runtime; cuGetErrorString,
//    cuMemGetAddressRange(_v2) and cuPointerGetAttribute have one ABI across
//    12.x. Deprecated from 12.5, hence the silenced warnings.
// scripts/check_old_cuda.sh compiles this file with CUDA 12.4's nvcc.
template <typename Fn>
Fn driver_function(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 13000
  cudaError_t err = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found);
  if (err != cudaSuccess) raise_cuda(err, "cudaGetDriverEntryPointByVersion");
#else
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#pragma nv_diag_suppress 1444  // nvcc's front end: "declared deprecated"
  cudaError_t err = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &found);
#pragma nv_diag_default 1444
#pragma GCC diagnostic pop
  if (err != cudaSuccess) raise_cuda(err, "cudaGetDriverEntryPoint");
#endif
  require(found == cudaDriverEntryPointSuccess && fn != nullptr,
          std::string("the CUDA driver does not provide ") + name + " (driver too old for CUDA 12 entry points?)");
  return reinterpret_cast<Fn>(fn);
}

void check_driver(CUresult res, const char* what) {
  if (res == CUDA_SUCCESS) return;
  using GetErrorString = CUresult (*)(CUresult, const char**);
  static auto get_error_string = driver_function<GetErrorString>("cuGetErrorString");
  const char* msg = nullptr;
  if (get_error_string(res, &msg) != CUDA_SUCCESS || msg == nullptr) msg = "unknown driver error";
  throw std::runtime_error(std::string("pyallreduce: ") + what + " failed: CUresult " +
                           std::to_string(static_cast<int>(res)) + " (" + msg + ")");
}

}  // namespace

// ---- regions and legacy IPC ---------------------------------------------------------

int64_t alloc_region(int device, int64_t nbytes, cudaStream_t stream) {
  require(nbytes > 0, "region size must be positive");
  DeviceScope scope(device);
  void* ptr = nullptr;
  check_cuda(cudaMalloc(&ptr, static_cast<size_t>(nbytes)), "cudaMalloc of the region");
  cudaError_t err = cudaMemsetAsync(ptr, 0, static_cast<size_t>(nbytes), stream);
  if (err == cudaSuccess) err = wait_relaxed(nullptr, stream);
  if (err != cudaSuccess) {
    cudaFree(ptr);
    raise_cuda(err, "zeroing the region");
  }
  return reinterpret_cast<int64_t>(ptr);
}

void free_region(int device, int64_t addr) {
  DeviceScope scope(device);
  check_cuda(cudaFree(reinterpret_cast<void*>(addr)), "cudaFree of the region");
}

std::string ipc_handle(int device, int64_t addr) {
  DeviceScope scope(device);
  cudaIpcMemHandle_t handle;
  check_cuda(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(addr)), "cudaIpcGetMemHandle");
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

int64_t ipc_open(int device, const std::string& bytes) {
  cudaIpcMemHandle_t handle;
  require(bytes.size() == sizeof(handle), "an IPC handle has " + std::to_string(sizeof(handle)) + " bytes, got " +
                                              std::to_string(bytes.size()));
  std::memcpy(&handle, bytes.data(), sizeof(handle));
  DeviceScope scope(device);
  void* ptr = nullptr;
  check_cuda(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess),
             "cudaIpcOpenMemHandle (is the peer on this host, its GPU a peer of this one? CUDA lets one GPU "
             "of a process open a given peer GPU's handles: did this process open them on another of its GPUs?)");
  return reinterpret_cast<int64_t>(ptr);
}

void ipc_close(int device, int64_t addr) {
  DeviceScope scope(device);
  check_cuda(cudaIpcCloseMemHandle(reinterpret_cast<void*>(addr)), "cudaIpcCloseMemHandle");
}

std::pair<int64_t, int64_t> address_range(int device, int64_t addr) {
  DeviceScope scope(device);
  using MemGetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static auto get_range = driver_function<MemGetAddressRange>("cuMemGetAddressRange");
  CUdeviceptr base = 0;
  size_t size = 0;
  check_driver(get_range(&base, &size, static_cast<CUdeviceptr>(addr)), "cuMemGetAddressRange");
  return {static_cast<int64_t>(base), static_cast<int64_t>(size)};
}

bool ipc_exportable(int device, int64_t addr) {
  DeviceScope scope(device);
  using PointerGetAttribute = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);
  static auto get_attribute = driver_function<PointerGetAttribute>("cuPointerGetAttribute");
  int capable = 0;
  check_driver(get_attribute(&capable, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                             static_cast<CUdeviceptr>(addr)),
               "cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE)");
  return capable != 0;
}

// ---- topology ----------------------------------------------------------------------

bool can_access_peer(int device, int peer) {
  DeviceScope scope(device);
  int can = 0;
  check_cuda(cudaDeviceCanAccessPeer(&can, device, peer), "cudaDeviceCanAccessPeer");
  return can != 0;
}

std::string pci_bus_id(int device) {
  char id[64] = {};
  check_cuda(cudaDeviceGetPCIBusId(id, sizeof(id), device), "cudaDeviceGetPCIBusId");
  return id;
}

int device_by_pci_bus_id(const std::string& bus_id) {
  int device = -1;
  cudaError_t err = cudaDeviceGetByPCIBusId(&device, bus_id.c_str());
  if (err == cudaErrorInvalidValue || err == cudaErrorInvalidDevice) {
    cudaGetLastError();
    return -1;
  }
  check_cuda(err, "cudaDeviceGetByPCIBusId");
  return device;
}

void memcpy_sync(int device, int64_t dst, int64_t src, int64_t nbytes, cudaStream_t stream) {
  DeviceScope scope(device);
  check_cuda(cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                             static_cast<size_t>(nbytes), cudaMemcpyDefault, stream),
             "cudaMemcpyAsync");
  check_cuda(wait_relaxed(nullptr, stream), "waiting for the copy");
}

}  // namespace cuda
}  // namespace pyallreduce
