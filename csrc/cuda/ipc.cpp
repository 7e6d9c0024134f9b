// CUDA IPC and topology helpers for pyallreduce/transport/cuda_ipc.py.
//
// Driver functions (address ranges, pointer attributes) are reached through
// the runtime's driver entry point lookup (driver_function below): the
// extension does not link libcuda, so it imports on a machine without an
// NVIDIA driver and only these calls fail there, with a Python exception.
#include "ipc.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda.h>  // driver types only; nothing from libcuda is linked
#include <cuda_runtime.h>
// Host code only, so g++ compiles it (nvcc would run its passes over these
// headers once per GPU architecture); pybind11 alone, not torch/extension.h.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>
#include <tuple>

namespace pyallreduce {
namespace {

namespace py = pybind11;

[[noreturn]] void raise_cuda(cudaError_t err, const char* what) {
  cudaGetLastError();  // clear a non-sticky error so later calls are not blamed for it
  TORCH_CHECK(false, "pyallreduce: ", what, " failed: ", cudaGetErrorName(err), " (",
              cudaGetErrorString(err), ")");
}

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) raise_cuda(err, what);
}

// Makes `device` current for the scope, with its primary context created (the
// driver calls below need a current context), in a RelaxedCaptureScope.
class DeviceScope {
 public:
  explicit DeviceScope(int64_t device) : guard_(checked(device)) {
    check_cuda(cudaFree(nullptr), "initialising CUDA on the device");
  }

 private:
  static c10::DeviceIndex checked(int64_t device) {
    int count = 0;
    check_cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
    TORCH_CHECK(device >= 0 && device < count, "pyallreduce: CUDA device ", device,
                " does not exist (", count, " visible)");
    return static_cast<c10::DeviceIndex>(device);
  }
  RelaxedCaptureScope relaxed_;  // first: every call below is in it
  c10::cuda::CUDAGuard guard_;
};

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
  TORCH_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr,
              "pyallreduce: the CUDA driver does not provide ", name,
              " (driver too old for CUDA 12 entry points?)");
  return reinterpret_cast<Fn>(fn);
}

void check_driver(CUresult res, const char* what) {
  if (res == CUDA_SUCCESS) return;
  using GetErrorString = CUresult (*)(CUresult, const char**);
  static auto get_error_string = driver_function<GetErrorString>("cuGetErrorString");
  const char* msg = nullptr;
  if (get_error_string(res, &msg) != CUDA_SUCCESS || msg == nullptr) msg = "unknown driver error";
  TORCH_CHECK(false, "pyallreduce: ", what, " failed: CUresult ", static_cast<int>(res), " (", msg,
              ")");
}

// ---- regions -------------------------------------------------------------------

// A zeroed allocation of its own (not the caching allocator's: exportable with
// legacy IPC, freed exactly when the transport says). Flags and epochs must be
// zero before any peer can see the handle, hence the wait (on the current
// stream, where the zeroing runs: wait_relaxed).
int64_t alloc_region(int64_t device, int64_t nbytes) {
  TORCH_CHECK(nbytes > 0, "pyallreduce: region size must be positive");
  DeviceScope scope(device);
  void* ptr = nullptr;
  check_cuda(cudaMalloc(&ptr, static_cast<size_t>(nbytes)), "cudaMalloc of the region");
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));
  cudaError_t err = cudaMemsetAsync(ptr, 0, static_cast<size_t>(nbytes), stream);
  if (err == cudaSuccess) err = wait_relaxed(nullptr, stream);
  if (err != cudaSuccess) {
    cudaFree(ptr);
    raise_cuda(err, "zeroing the region");
  }
  return reinterpret_cast<int64_t>(ptr);
}

void free_region(int64_t device, int64_t addr) {
  DeviceScope scope(device);
  check_cuda(cudaFree(reinterpret_cast<void*>(addr)), "cudaFree of the region");
}

// ---- legacy IPC ------------------------------------------------------------------

// The handle of the allocation that starts at addr (an allocation base: see
// address_range), as bytes to send to peers.
py::bytes ipc_handle(int64_t device, int64_t addr) {
  DeviceScope scope(device);
  cudaIpcMemHandle_t handle;
  check_cuda(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(addr)), "cudaIpcGetMemHandle");
  return py::bytes(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

// Maps a peer's allocation in this process. Another process's handle may be on
// the same device as ours (several ranks sharing one GPU) or on a peer device.
int64_t ipc_open(int64_t device, const py::bytes& handle_bytes) {
  const std::string bytes = handle_bytes;
  cudaIpcMemHandle_t handle;
  TORCH_CHECK(bytes.size() == sizeof(handle), "pyallreduce: an IPC handle has ", sizeof(handle),
              " bytes, got ", bytes.size());
  std::memcpy(&handle, bytes.data(), sizeof(handle));
  DeviceScope scope(device);
  void* ptr = nullptr;
  check_cuda(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess),
             "cudaIpcOpenMemHandle (is the peer on this host, with its GPU visible here?)");
  return reinterpret_cast<int64_t>(ptr);
}

void ipc_close(int64_t device, int64_t addr) {
  DeviceScope scope(device);
  check_cuda(cudaIpcCloseMemHandle(reinterpret_cast<void*>(addr)), "cudaIpcCloseMemHandle");
}

// (base, size) of the allocation holding addr: legacy IPC exports whole
// allocations, so a tensor from torch's caching allocator is exported as its
// segment's base plus the tensor's offset.
std::tuple<int64_t, int64_t> address_range(int64_t device, int64_t addr) {
  DeviceScope scope(device);
  using MemGetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static auto get_range = driver_function<MemGetAddressRange>("cuMemGetAddressRange");
  CUdeviceptr base = 0;
  size_t size = 0;
  check_driver(get_range(&base, &size, static_cast<CUdeviceptr>(addr)), "cuMemGetAddressRange");
  return {static_cast<int64_t>(base), static_cast<int64_t>(size)};
}

// Whether addr's allocation can be exported with cudaIpcGetMemHandle. Memory
// from cuMemCreate (torch's expandable segments) or from memory pools
// (cudaMallocAsync) cannot; the communicator then keeps the staging copy.
bool ipc_exportable(int64_t device, int64_t addr) {
  DeviceScope scope(device);
  using PointerGetAttribute = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);
  static auto get_attribute = driver_function<PointerGetAttribute>("cuPointerGetAttribute");
  int capable = 0;
  check_driver(get_attribute(&capable, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                             static_cast<CUdeviceptr>(addr)),
               "cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE)");
  return capable != 0;
}

// ---- topology --------------------------------------------------------------------

bool can_access_peer(int64_t device, int64_t peer) {
  DeviceScope scope(device);
  int can = 0;
  check_cuda(cudaDeviceCanAccessPeer(&can, static_cast<int>(device), static_cast<int>(peer)),
             "cudaDeviceCanAccessPeer");
  return can != 0;
}

// "dddd:bb:dd.f": identifies a GPU across processes whatever CUDA_VISIBLE_DEVICES says.
std::string pci_bus_id(int64_t device) {
  char id[64] = {};
  check_cuda(cudaDeviceGetPCIBusId(id, sizeof(id), static_cast<int>(device)),
             "cudaDeviceGetPCIBusId");
  return id;
}

// This process's index of the GPU with that bus id, or -1 when it is not visible.
int64_t device_by_pci_bus_id(const std::string& bus_id) {
  int device = -1;
  cudaError_t err = cudaDeviceGetByPCIBusId(&device, bus_id.c_str());
  if (err == cudaErrorInvalidValue || err == cudaErrorInvalidDevice) {
    cudaGetLastError();
    return -1;
  }
  check_cuda(err, "cudaDeviceGetByPCIBusId");
  return device;
}

// Copy between any two addresses (host, own device, IPC-mapped peer memory)
// that has finished when it returns: the topology probe writes peers' memory
// with it and then tells them to look. cudaMemcpy alone does not wait for a
// device-to-device copy (CUDA's "API synchronization behavior"), and a peer
// then read its buffer before our bytes landed (seen on an H200, 2026-11-26).
void memcpy_sync(int64_t device, int64_t dst, int64_t src, int64_t nbytes) {
  DeviceScope scope(device);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));
  check_cuda(cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                             static_cast<size_t>(nbytes), cudaMemcpyDefault, stream),
             "cudaMemcpyAsync");
  check_cuda(wait_relaxed(nullptr, stream), "waiting for the copy");
}

// The device-wide wait of teardown and of changes to what captured kernels
// read (unregister, graph entries, close): any stream may replay a graph of
// ours, so every stream is waited for, on purpose. In a RelaxedCaptureScope
// (DeviceScope), so that another thread's global-mode capture neither fails
// this nor is invalidated by it; that capture's stream holds no work to wait for.
void synchronize_device(int64_t device) {
  DeviceScope scope(device);
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

}  // namespace

cudaError_t wait_relaxed(cudaEvent_t event, cudaStream_t stream) {
  RelaxedCaptureScope relaxed;
  cudaError_t err = cudaSuccess;
  if (event != nullptr) err = cudaEventSynchronize(event);  // never recorded: returns at once
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  return err;
}

void bind_cuda_ipc(pybind11::module_& m) {
  m.def("cuda_alloc_region", &alloc_region, py::arg("device"), py::arg("nbytes"),
        "cudaMalloc + zero + synchronise; returns the device address");
  m.def("cuda_free_region", &free_region, py::arg("device"), py::arg("addr"));
  m.def("cuda_ipc_handle", &ipc_handle, py::arg("device"), py::arg("addr"),
        "legacy IPC handle (bytes) of the allocation starting at addr");
  m.def("cuda_ipc_open", &ipc_open, py::arg("device"), py::arg("handle"),
        "maps a peer's handle in this process; returns the address");
  m.def("cuda_ipc_close", &ipc_close, py::arg("device"), py::arg("addr"));
  m.def("cuda_address_range", &address_range, py::arg("device"), py::arg("addr"),
        "(base, size) of the allocation holding addr");
  m.def("cuda_ipc_exportable", &ipc_exportable, py::arg("device"), py::arg("addr"),
        "whether addr's allocation can be exported with legacy CUDA IPC");
  m.def("cuda_can_access_peer", &can_access_peer, py::arg("device"), py::arg("peer"));
  m.def("cuda_pci_bus_id", &pci_bus_id, py::arg("device"));
  m.def("cuda_device_by_pci_bus_id", &device_by_pci_bus_id, py::arg("bus_id"));
  m.def("cuda_synchronize", &synchronize_device, py::arg("device"),
        "waits for every stream of the device (legal beside another thread's capture)");
  m.def("cuda_memcpy", &memcpy_sync, py::arg("device"), py::arg("dst"), py::arg("src"),
        py::arg("nbytes"));
  m.def("cuda_register_buffer", &register_cuda_buffer, py::arg("handle"), py::arg("ptr"),
        py::arg("nbytes"), py::arg("peer_ptrs"),
        "zero-copy: read every rank's corresponding buffer in place for inputs inside it");
  m.def("cuda_prepare", &cuda_prepare, py::arg("handle"),
        "makes the communicator's status record and launch-order event (outside any capture)");
  m.def("cuda_resident_blocks", &cuda_resident_blocks, py::arg("device"), py::arg("world_size"));
  m.def("cuda_unregister_buffer", &unregister_cuda_buffer, py::arg("handle"), py::arg("ptr"));
  m.def("cuda_is_registered", &is_cuda_buffer_registered, py::arg("handle"), py::arg("ptr"),
        py::arg("nbytes"));
  m.def("cuda_graph_capture_begin", &graph_capture_begin, py::arg("handle"),
        py::arg("block_entries"),
        "opens the graph table for a comm.capture() (allocating a zeroed block when needed)");
  m.def(
      "cuda_graph_capture_end",
      [](int64_t handle) {
        GraphCapture c = graph_capture_end(handle);
        return std::make_tuple(c.calls, c.calls_without_entry);
      },
      py::arg("handle"),
      "closes it: ([(slot or -1, input, nbytes, in_place, algo, dtype, average)] per captured "
      "call, calls_without_entry)");
  m.def("cuda_graph_set_entries", &graph_set_entries, py::arg("handle"), py::arg("slots"),
        py::arg("peer_ptrs"), "makes those captured calls zero copy");
  m.def("cuda_graph_reset_entries", &graph_reset_entries, py::arg("handle"), py::arg("slots"));
  m.def("cuda_graph_entry_modes", &graph_entry_modes, py::arg("handle"));
}

}  // namespace pyallreduce
