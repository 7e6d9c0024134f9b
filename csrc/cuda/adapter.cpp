// The torch adapter of the CUDA backend: tensors to the pointers, sizes and
// dtype codes of the glue (glue.h), the current stream and device, the
// temporaries of a misaligned call through torch's allocator, the tensors a
// graph entry keeps alive, and the cuda_* functions of pyallreduce._C. The
// CUDA-runtime work itself is in glue.cpp and runtime.cpp, which include no
// torch header. Argument checks common to every backend already ran
// (run_collective in csrc/module.cpp).
#include "adapter.h"

#include <c10/cuda/CUDAFunctions.h>  // ExchangeDevice, MaybeSetDevice
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // not ATen/cuda/CUDAContext.h: that one needs cuBLAS/cuSPARSE headers
#include <torch/extension.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "../common/op_args.h"
#include "glue.h"
#include "runtime.h"

namespace pyallreduce {
namespace {

namespace py = pybind11;

cudaStream_t current_stream(int device) {
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));
}

// The kernels' element type of a reduction's dtype; false for a dtype without kernels.
bool element_of(at::ScalarType dtype, cuda::Element& element) {
  switch (dtype) {
    case at::kFloat: element = cuda::Element::kFloat32; return true;
    case at::kHalf: element = cuda::Element::kFloat16; return true;
    case at::kBFloat16: element = cuda::Element::kBFloat16; return true;
    default: return false;
  }
}

// The op implementation registered for CUDA tensors (every entry point).
void cuda_collective(Context& ctx, const at::Tensor& input, at::Tensor& out, int64_t algo, bool average) {
  if (input.numel() == 0) return;  // same size on every rank: nobody signals, epochs stay in step
  c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(ctx.device));
  cudaStream_t stream = current_stream(ctx.device);
  cuda::StatusRecord& rec = cuda::record_of(ctx);  // once per call: every step below uses it
  cuda::raise_deadline(ctx, rec, stream);
  const bool segmented = algo == kReduceScatter || algo == kAllGather;
  const at::Tensor& segment = algo == kReduceScatter ? out : input;
  cuda::CallArgs args{static_cast<const char*>(input.data_ptr()), static_cast<char*>(out.data_ptr()),
                      static_cast<int64_t>(segmented ? segment.nbytes() : input.nbytes()), algo, average,
                      dtype_code(input.scalar_type()), false, cuda::Element::kFloat32};
  args.reduces = element_of(input.scalar_type(), args.element);
  bool launched;
  if (segmented) {
    launched = cuda::launch_segment(ctx, rec, stream, args);
  } else {
    cuda::AllReduceCall c = cuda::plan_all_reduce(ctx, rec, stream, args);
    at::Tensor input_tmp, out_tmp;
    const char* in_ptr = args.input;
    char* out_ptr = args.out;
    if (c.plan.copy_input) {
      input_tmp = input.clone(at::MemoryFormat::Contiguous);
      in_ptr = static_cast<const char*>(input_tmp.data_ptr());
    }
    if (c.plan.copy_out) {
      // A copy of out, not empty_like: a call the kernels skip (mismatch) must
      // leave out as it was after the copy back below.
      out_tmp = out.clone(at::MemoryFormat::Contiguous);
      out_ptr = static_cast<char*>(out_tmp.data_ptr());
    }
    // A graph entry keeps the input alive until close() (peers map it).
    const cuda::MakeKeep keep = [&input] { return std::make_shared<at::Tensor>(input); };
    launched = cuda::launch_all_reduce(ctx, rec, stream, c, in_ptr, out_ptr, args, keep);
    if (launched && out_tmp.defined()) out.copy_(out_tmp);
  }
  TORCH_CHECK(launched, "pyallreduce: no CUDA kernel for dtype ", input.scalar_type(), " and world size ",
              ctx.world_size);
  cuda::raise_recorded(ctx, rec, stream);
}

void cuda_agree(Context& ctx, CallDesc desc) {
  c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(ctx.device));
  cuda::agree(ctx, desc, current_stream(ctx.device));
}

std::shared_ptr<Context> cuda_context(int64_t handle) {
  std::shared_ptr<Context> ctx = get_context(handle);
  TORCH_CHECK(ctx->is_cuda, "pyallreduce: this needs a CUDA communicator");
  return ctx;
}

at::Tensor kept_tensor(const cuda::Keep& keep) { return *std::static_pointer_cast<at::Tensor>(keep); }

}  // namespace

void cuda_check(Context& ctx) {
  c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(ctx.device));
  cuda::check(ctx, current_stream(ctx.device));
}

void cuda_interrupt(const Context& ctx) { cuda::interrupt(ctx); }

bool cuda_current_stream_capturing(int device) { return cuda::is_capturing(current_stream(device)); }

// torch's own switch (see DeviceSwitch): the thread's device as torch keeps it,
// and put back only where it has a context.
int torch_exchange_device(int device) { return c10::cuda::ExchangeDevice(static_cast<c10::DeviceIndex>(device)); }
void torch_put_back_device(int device) {  // from a destructor: nothing may escape
  try {
    if (c10::cuda::MaybeSetDevice(static_cast<c10::DeviceIndex>(device)) != cudaSuccess) cudaGetLastError();
  } catch (const std::exception&) {
    cudaGetLastError();  // the thread keeps the scope's device, as a failed cudaSetDevice back would
  }
}

void bind_cuda(py::module_& m) {
  using namespace cuda;
  set_device_switch({&torch_exchange_device, &torch_put_back_device});
  // Regions, IPC and topology (pyallreduce/transport/): device indices and addresses.
  m.def("cuda_alloc_region", [](int device, int64_t nbytes) {
          return alloc_region(device, nbytes, current_stream(device));
        }, py::arg("device"), py::arg("nbytes"), "cudaMalloc + zero + wait; returns the device address");
  m.def("cuda_free_region", &free_region, py::arg("device"), py::arg("addr"));
  m.def("cuda_ipc_handle", [](int device, int64_t addr) { return py::bytes(ipc_handle(device, addr)); },
        py::arg("device"), py::arg("addr"), "legacy IPC handle (bytes) of the allocation starting at addr");
  m.def("cuda_ipc_open", [](int device, const py::bytes& handle) { return ipc_open(device, handle); },
        py::arg("device"), py::arg("handle"), "maps a peer's handle in this process; returns the address");
  m.def("cuda_ipc_close", &ipc_close, py::arg("device"), py::arg("addr"));
  m.def("cuda_address_range", [](int device, int64_t addr) {
          const auto [base, size] = address_range(device, addr);
          return std::make_tuple(base, size);
        }, py::arg("device"), py::arg("addr"), "(base, size) of the allocation holding addr");
  m.def("cuda_ipc_exportable", &ipc_exportable, py::arg("device"), py::arg("addr"),
        "whether addr's allocation can be exported with legacy CUDA IPC");
  m.def("cuda_can_access_peer", &can_access_peer, py::arg("device"), py::arg("peer"));
  m.def("cuda_pci_bus_id", &pci_bus_id, py::arg("device"));
  m.def("cuda_current_stream_capturing", &cuda_current_stream_capturing, py::arg("device"),
        "whether torch's current stream of this device is being captured into a CUDA graph");
  m.def("cuda_device_by_pci_bus_id", &device_by_pci_bus_id, py::arg("bus_id"));
  m.def("cuda_exchange_capture_mode", [](int mode) {
          auto exchanged = static_cast<cudaStreamCaptureMode>(mode);
          check_cuda(cudaThreadExchangeStreamCaptureMode(&exchanged), "cudaThreadExchangeStreamCaptureMode");
          return static_cast<int>(exchanged);
        }, py::arg("mode"), "sets this thread's CUDA graph capture mode; returns the one it had");
  m.attr("CUDA_CAPTURE_MODE_RELAXED") = static_cast<int>(cudaStreamCaptureModeRelaxed);
  m.def("cuda_wait_for_launches", [](int device, int64_t launched, bool captured) {
          wait_until_unused(device, reinterpret_cast<cudaEvent_t>(launched), captured);
        }, py::arg("device"), py::arg("launched_event"), py::arg("captured"),
        py::call_guard<py::gil_scoped_release>(),  // up to the kernels' deadline: other threads run meanwhile
        "waits until no kernel of a communicator may still run: the event its last eager launch recorded "
        "(0: none), or every stream of the device once its kernels were captured");
  m.def("cuda_memcpy", [](int device, int64_t dst, int64_t src, int64_t nbytes) {
          memcpy_sync(device, dst, src, nbytes, current_stream(device));
        }, py::arg("device"), py::arg("dst"), py::arg("src"), py::arg("nbytes"));
  m.def("cuda_resident_blocks", &resident_blocks, py::arg("device"), py::arg("world_size"));

  // One communicator's state: by handle.
  m.def("cuda_prepare", [](int64_t handle) {
          std::shared_ptr<Context> ctx = cuda_context(handle);
          prepare(*ctx, current_stream(ctx->device));
        }, py::arg("handle"), "makes the communicator's status record and launch-order event (outside any capture)");
  m.def("cuda_launch_chain", [](int64_t handle) {
          const auto [launched, captured] = launch_chain(*cuda_context(handle));
          return std::make_tuple(reinterpret_cast<int64_t>(launched), captured);
        }, py::arg("handle"), "(the event of the last eager launch, whether a kernel was ever captured)");
  m.def("cuda_register_buffer", [](int64_t handle, int64_t ptr, int64_t nbytes, const std::vector<int64_t>& peers) {
          register_buffer(cuda_context(handle), ptr, nbytes, peers);
        }, py::arg("handle"), py::arg("ptr"), py::arg("nbytes"), py::arg("peer_ptrs"),
        "zero-copy: read every rank's corresponding buffer in place for inputs inside it");
  m.def("cuda_unregister_buffer", [](int64_t handle, int64_t ptr) {
          return unregister_buffer(*get_context(handle), ptr);
        }, py::arg("handle"), py::arg("ptr"));
  m.def("cuda_is_registered", [](int64_t handle, int64_t ptr, int64_t nbytes) {
          return is_registered(*get_context(handle), ptr, nbytes);
        }, py::arg("handle"), py::arg("ptr"), py::arg("nbytes"));
  m.def("cuda_clear_buffers", [](int64_t handle) {
          std::vector<at::Tensor> tensors;
          for (const Keep& keep : clear_buffers(*get_context(handle))) tensors.push_back(kept_tensor(keep));
          return tensors;
        }, py::arg("handle"), "drops the communicator's registrations; returns the captured inputs peers may map");
  m.def("cuda_graph_capture_begin", [](int64_t handle, int64_t block_entries) {
          std::shared_ptr<Context> ctx = cuda_context(handle);
          graph_capture_begin(ctx, block_entries, current_stream(ctx->device));
        }, py::arg("handle"), py::arg("block_entries"),
        "opens the graph table for a comm.capture() (allocating a zeroed block when needed)");
  m.def("cuda_graph_capture_end", [](int64_t handle) {
          const GraphCapture c = graph_capture_end(*get_context(handle));
          std::vector<std::tuple<int64_t, int64_t, int64_t, bool, int64_t, std::string, bool>> calls;
          for (const CapturedCall& k : c.calls) {
            calls.emplace_back(k.slot, k.input, k.nbytes, k.in_place, k.algo,
                               c10::toString(static_cast<at::ScalarType>(k.dtype)), k.average);
          }
          return std::make_tuple(calls, c.calls_without_entry);
        }, py::arg("handle"),
        "closes it: ([(slot or -1, input, nbytes, in_place, algo, dtype, average)] per captured call, "
        "calls_without_entry)");
  m.def("cuda_graph_set_entries", [](int64_t handle, const std::vector<int64_t>& slots,
                                     const std::vector<std::vector<int64_t>>& peers) {
          std::shared_ptr<Context> ctx = get_context(handle);
          graph_set_entries(*ctx, slots, peers, current_stream(ctx->device));
        }, py::arg("handle"), py::arg("slots"), py::arg("peer_ptrs"), "makes those captured calls zero copy");
  m.def("cuda_graph_reset_entries", [](int64_t handle, const std::vector<int64_t>& slots) {
          std::shared_ptr<Context> ctx = get_context(handle);
          graph_reset_entries(*ctx, slots, current_stream(ctx->device));
        }, py::arg("handle"), py::arg("slots"));
  m.def("cuda_graph_entry_modes", [](int64_t handle) {
          std::shared_ptr<Context> ctx = get_context(handle);
          return graph_entry_modes(*ctx, current_stream(ctx->device));
        }, py::arg("handle"));
}

}  // namespace pyallreduce

PYALLREDUCE_REGISTER_BACKEND(CUDA, ::pyallreduce::cuda_collective)
static const bool pyallreduce_agree_cuda =
    ::pyallreduce::register_agree_impl(c10::DeviceType::CUDA, &::pyallreduce::cuda_agree);
