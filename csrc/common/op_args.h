// Argument checks shared by every backend's op implementation. The Python
// Communicator validates first with friendlier messages; these are the last
// line, so a direct torch.ops call can never read or write out of bounds.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include "context.h"

namespace pyallreduce {

// Raises unless input/out are contiguous tensors of one supported dtype and
// fitting sizes (the same numel for all-reduce; W segments on one side for
// kReduceScatter/kAllGather), on the context's device, fitting the staging
// buffers, overlapping only as protocol.h allows, and algo is known.
void check_collective_args(const Context& ctx, const at::Tensor& input, const at::Tensor& out,
                           int64_t algo);

// Backends register one implementation; every op entry point shares it (algo:
// kOneShot, kTwoShot, kReduceScatter, kAllGather).
using CollectiveImpl = void (*)(Context& ctx, const at::Tensor& input, at::Tensor& out,
                               int64_t algo, bool average);

}  // namespace pyallreduce

namespace pyallreduce {

// Runs one collective: guards the context, checks the arguments, and marks the
// context broken if the implementation fails after it started signalling.
void run_collective(CollectiveImpl impl, int64_t handle, const at::Tensor& input, at::Tensor& out,
                    int64_t algo, bool average);

// The same Impls by device type, for the eager entry point that skips the
// dispatcher (pyallreduce._C.try_collective_eager; see csrc/module.cpp).
bool register_eager_impl(c10::DeviceType type, CollectiveImpl impl);

// Runs the call through that Impl if the tensors fit a kernel as they are
// (csrc/module.cpp); false, having done nothing, where they do not.
bool try_collective_eager(const at::Tensor& input, at::Tensor out, int64_t handle, int64_t algo, bool average);

// A backend's agreement round (protocol.h, kAgreeOnly): publishes `desc` (its
// epoch is filled in), meets the peers at the start barrier and throws
// CallMismatch unless every rank published the same; moves no data. Run by
// pyallreduce._C.agree before a call goes to torch.distributed, and for empty
// tensors, so that those calls too are checked against the peers' calls.
using AgreeImpl = void (*)(Context& ctx, CallDesc desc);
bool register_agree_impl(c10::DeviceType type, AgreeImpl impl);

// desc_kind's dtype field for a tensor's dtype.
inline uint32_t dtype_code(at::ScalarType t) { return static_cast<uint32_t>(t); }

// The op entry points (schemas in csrc/module.cpp) over one backend's Impl.
template <CollectiveImpl Impl>
struct OpEntryPoints {
  static at::Tensor all_reduce(const at::Tensor& input, int64_t handle, int64_t algo, bool average) {
    at::Tensor out = at::empty_like(input, at::MemoryFormat::Contiguous);
    run_collective(Impl, handle, input, out, algo, average);
    return out;
  }
  static void all_reduce_out(const at::Tensor& input, at::Tensor out, int64_t handle, int64_t algo,
                             bool average) {
    run_collective(Impl, handle, input, out, algo, average);
  }
  static void all_reduce_inplace(at::Tensor tensor, int64_t handle, int64_t algo, bool average) {
    run_collective(Impl, handle, tensor, tensor, algo, average);
  }
  static void reduce_scatter_out(const at::Tensor& input, at::Tensor out, int64_t handle, bool average) {
    run_collective(Impl, handle, input, out, kReduceScatter, average);
  }
  static void all_gather_out(const at::Tensor& input, at::Tensor out, int64_t handle) {
    run_collective(Impl, handle, input, out, kAllGather, false);
  }
};

}  // namespace pyallreduce

// Registers a backend's Impl for the dispatch key KEY (CPU or CUDA) and for the
// eager entry point on that device type.
#define PYALLREDUCE_REGISTER_BACKEND(KEY, IMPL)                                   \
  static const bool pyallreduce_eager_##KEY =                                     \
      ::pyallreduce::register_eager_impl(c10::DeviceType::KEY, IMPL);            \
  TORCH_LIBRARY_IMPL(pyallreduce, KEY, m) {                                       \
    using Entry = ::pyallreduce::OpEntryPoints<IMPL>;                             \
    m.impl("all_reduce", &Entry::all_reduce);                                     \
    m.impl("all_reduce_out", &Entry::all_reduce_out);                             \
    m.impl("all_reduce_", &Entry::all_reduce_inplace);                            \
    m.impl("reduce_scatter_out", &Entry::reduce_scatter_out);                     \
    m.impl("all_gather_out", &Entry::all_gather_out);                             \
  }
