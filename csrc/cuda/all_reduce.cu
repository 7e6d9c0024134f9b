// CUDA backend of the pyallreduce ops: picks the source mode (staged or
// zero-copy registered), builds the kernel arguments and launches
// csrc/cuda/all_reduce.cuh on the current stream. Argument checks common to
// every backend already ran (run_collective in csrc/module.cpp).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // not ATen/cuda/CUDAContext.h: that one needs cuBLAS/cuSPARSE headers

#include <array>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "../common/op_args.h"
#include "all_reduce.cuh"
#include "ipc.h"

namespace pyallreduce {
namespace {

// ---- zero-copy registrations ------------------------------------------------------
// Per context: registered local buffers by start address. The key is the
// Context's address (the op implementation receives a Context&, not its
// handle); the weak_ptr detects a destroyed context whose address was reused.

struct Registration {
  int64_t nbytes = 0;
  std::array<int64_t, kMaxRanks> peers{};  // every rank's buffer as mapped here
};

struct ContextBuffers {
  std::weak_ptr<Context> owner;
  std::map<int64_t, Registration> by_start;
};

std::mutex buffers_mutex;
std::unordered_map<const Context*, ContextBuffers> buffers_by_context;

// The live table of ctx, or nullptr. Caller holds buffers_mutex.
ContextBuffers* buffers_of(const Context* ctx) {
  auto it = buffers_by_context.find(ctx);
  if (it == buffers_by_context.end()) return nullptr;
  if (it->second.owner.lock().get() != ctx) {  // stale: that context is gone
    buffers_by_context.erase(it);
    return nullptr;
  }
  return &it->second;
}

// If [ptr, ptr + nbytes) lies inside a registered buffer at a 16-byte aligned
// offset, fills every rank's corresponding address. Every rank registered
// buffers of equal size at 16-byte aligned addresses and calls with the same
// offset, so every rank reaches the same answer here.
bool find_registered(const Context& ctx, int64_t ptr, int64_t nbytes, char* (&peers)[kMaxRanks]) {
  std::lock_guard<std::mutex> lock(buffers_mutex);
  ContextBuffers* table = buffers_of(&ctx);
  if (table == nullptr) return false;
  auto it = table->by_start.upper_bound(ptr);
  if (it == table->by_start.begin()) return false;
  --it;
  const int64_t offset = ptr - it->first;
  if (offset + nbytes > it->second.nbytes || offset % cuda::kVecBytes != 0) return false;
  for (int q = 0; q < ctx.world_size; ++q) {
    peers[q] = reinterpret_cast<char*>(it->second.peers[q] + offset);
  }
  return true;
}

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % cuda::kVecBytes == 0; }

}  // namespace

void register_cuda_buffer(int64_t handle, int64_t local_ptr, int64_t nbytes,
                          const std::vector<int64_t>& peer_ptrs) {
  std::shared_ptr<Context> ctx = get_context(handle);
  TORCH_CHECK(ctx->is_cuda, "pyallreduce: register needs a CUDA communicator");
  TORCH_CHECK(nbytes > 0, "pyallreduce: cannot register an empty buffer");
  TORCH_CHECK(static_cast<int>(peer_ptrs.size()) == ctx->world_size, "pyallreduce: register got ",
              peer_ptrs.size(), " peer addresses for world size ", ctx->world_size);
  TORCH_CHECK(peer_ptrs[ctx->rank] == local_ptr,
              "pyallreduce: register: this rank's entry must be the local buffer itself");
  Registration reg;
  reg.nbytes = nbytes;
  for (int q = 0; q < ctx->world_size; ++q) {
    TORCH_CHECK(peer_ptrs[q] != 0 && peer_ptrs[q] % cuda::kVecBytes == 0, "pyallreduce: rank ", q,
                "'s registered buffer is not ", cuda::kVecBytes, "-byte aligned");
    reg.peers[q] = peer_ptrs[q];
  }
  std::lock_guard<std::mutex> lock(buffers_mutex);
  for (auto it = buffers_by_context.begin(); it != buffers_by_context.end();) {  // drop stale tables
    it = it->second.owner.expired() ? buffers_by_context.erase(it) : std::next(it);
  }
  ContextBuffers& table = buffers_by_context[ctx.get()];
  table.owner = ctx;
  auto next = table.by_start.lower_bound(local_ptr);
  if (next != table.by_start.end() && next->first == local_ptr && next->second.nbytes == nbytes &&
      next->second.peers == reg.peers) {
    return;  // registering the same buffer again is a no-op
  }
  const bool overlaps_next = next != table.by_start.end() && next->first < local_ptr + nbytes;
  const bool overlaps_prev = next != table.by_start.begin() &&
                             std::prev(next)->first + std::prev(next)->second.nbytes > local_ptr;
  TORCH_CHECK(!overlaps_next && !overlaps_prev, "pyallreduce: buffer at 0x", std::hex, local_ptr,
              " overlaps a buffer already registered with this communicator");
  table.by_start.emplace(local_ptr, reg);
}

bool unregister_cuda_buffer(int64_t handle, int64_t local_ptr) {
  std::shared_ptr<Context> ctx = get_context(handle);
  std::lock_guard<std::mutex> lock(buffers_mutex);
  ContextBuffers* table = buffers_of(ctx.get());
  return table != nullptr && table->by_start.erase(local_ptr) > 0;
}

void clear_cuda_buffers(int64_t handle) {
  std::shared_ptr<Context> ctx = get_context(handle);
  std::lock_guard<std::mutex> lock(buffers_mutex);
  buffers_by_context.erase(ctx.get());
}

bool is_cuda_buffer_registered(int64_t handle, int64_t ptr, int64_t nbytes) {
  std::shared_ptr<Context> ctx = get_context(handle);
  char* peers[kMaxRanks] = {};
  return find_registered(*ctx, ptr, nbytes, peers);
}

void cuda_all_reduce(Context& ctx, const at::Tensor& input, at::Tensor& out, int64_t algo,
                     bool average) {
  const int64_t bytes = static_cast<int64_t>(input.nbytes());
  if (bytes == 0) return;  // same size on every rank: nobody signals, epochs stay in step
  c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(ctx.device));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(ctx.device));

  cuda::Call call{};
  for (int q = 0; q < ctx.world_size; ++q) call.regions[q] = ctx.regions[q];
  call.bytes = bytes;
  call.max_bytes = ctx.max_bytes;
  call.timeout_ns = ctx.timeout_ns;
  call.rank = ctx.rank;
  call.average = average;

  const auto* in_ptr = static_cast<const char*>(input.data_ptr());
  auto* out_ptr = static_cast<char*>(out.data_ptr());
  const bool in_place = in_ptr == out_ptr;
  const bool disjoint = out_ptr + bytes <= in_ptr || in_ptr + bytes <= out_ptr;
  call.mode = cuda::kStaged;
  if ((in_place || disjoint) &&
      find_registered(ctx, reinterpret_cast<int64_t>(in_ptr), bytes, call.registered)) {
    call.mode = in_place ? cuda::kRegisteredInPlace : cuda::kRegistered;
  }

  // The kernels access input and out in 16-byte vectors. Tensors from the
  // allocator are aligned; a view at an odd offset goes through an aligned
  // temporary (registered buffers at such offsets were not matched above).
  at::Tensor input_tmp, out_tmp;
  if (call.mode == cuda::kStaged) {
    if (!aligned(in_ptr)) {
      input_tmp = input.clone(at::MemoryFormat::Contiguous);
      in_ptr = static_cast<const char*>(input_tmp.data_ptr());
    }
    if (!aligned(out_ptr)) {
      out_tmp = at::empty_like(out, at::MemoryFormat::Contiguous);
      out_ptr = static_cast<char*>(out_tmp.data_ptr());
    }
  }
  call.input = in_ptr;
  call.out = out_ptr;

  bool launched = false;
  switch (input.scalar_type()) {
    case at::kFloat:
      launched = cuda::launch_all_reduce<float>(ctx.world_size, algo, call, ctx.nblocks, stream);
      break;
    case at::kHalf:
      launched = cuda::launch_all_reduce<__half>(ctx.world_size, algo, call, ctx.nblocks, stream);
      break;
    case at::kBFloat16:
      launched =
          cuda::launch_all_reduce<__nv_bfloat16>(ctx.world_size, algo, call, ctx.nblocks, stream);
      break;
    default:
      break;
  }
  TORCH_CHECK(launched, "pyallreduce: no CUDA kernel for dtype ", input.scalar_type(),
              " and world size ", ctx.world_size);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (out_tmp.defined()) out.copy_(out_tmp);
}

}  // namespace pyallreduce

PYALLREDUCE_REGISTER_BACKEND(CUDA, ::pyallreduce::cuda_all_reduce)
