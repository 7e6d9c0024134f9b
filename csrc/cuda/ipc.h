// CUDA IPC helpers for the CUDA transport (pyallreduce/transport/cuda_ipc.py
// decides what to allocate, export and map; this only wraps the CUDA calls and
// turns every CUDA error into a Python exception), and the table of zero-copy
// buffers registered per communicator (kept in csrc/cuda/all_reduce.cpp, where
// the launcher looks inputs up).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "../common/protocol.h"

namespace at {
class Tensor;
}
namespace pybind11 {
class module_;
}

namespace pyallreduce {

struct Context;

// The agreement round of a call this rank sends to torch.distributed
// (protocol.h kAgreeOnly; csrc/module.cpp's _C.agree reaches it through
// register_agree_impl): publishes desc (its epoch is filled in), meets every
// peer at the start barrier, and waits for the answer. Throws CallMismatch
// when the ranks' calls differ (the context stays usable), and marks the
// context broken on a deadline. Does nothing while the current stream is
// being captured.
void cuda_agree(Context& ctx, CallDesc desc);
// Waits for the communicator's kernels launched so far (not while capturing)
// and raises what they recorded: a deadline (naming the ranks that never
// arrived; marks the context broken) or a mismatch (CallMismatch; cleared).
void cuda_check(Context& ctx);

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

// Waits until the work enqueued so far on `stream` (and, first, `event`, if
// not null) has finished, and for nothing else: never cudaDeviceSynchronize,
// which waits for every stream of the device, NCCL's and the training's too.
// In a RelaxedCaptureScope. Every wait of the glue goes through here.
cudaError_t wait_relaxed(cudaEvent_t event, cudaStream_t stream);

// Adds the cuda_* functions to pyallreduce._C (see ipc.cpp for the list).
void bind_cuda_ipc(pybind11::module_& m);

// Zero-copy registrations of the communicator `handle` (create_context).
// local_ptr..local_ptr+nbytes is this rank's buffer; peer_ptrs[q] is rank q's
// corresponding buffer as mapped in this process (peer_ptrs[rank] == local_ptr).
// A collective whose input lies inside a registered buffer (at a 16-byte
// aligned offset) reads every rank's buffer at the same offset in place, so
// every rank must pass its corresponding buffer: register on all ranks, call
// with the matching tensors on all ranks.
void register_cuda_buffer(int64_t handle, int64_t local_ptr, int64_t nbytes,
                          const std::vector<int64_t>& peer_ptrs);
// Returns false if local_ptr was not registered.
bool unregister_cuda_buffer(int64_t handle, int64_t local_ptr);
// Makes what every kernel call of the communicator uses (its status record and
// launch-order event), once, right after create_context: outside any capture.
void cuda_prepare(int64_t handle);
// Drops every registration of the communicator (call before destroy_context).
// Returns the captured inputs that graph entries may have made zero copy:
// peers may map them, so the caller keeps them alive until they unmapped.
std::vector<at::Tensor> clear_cuda_buffers(int64_t handle);
// How many blocks of the all-reduce kernels for world_size ranks `device`
// holds resident at once (occupancy x SMs; policy.py bounds nblocks with it
// when several ranks share a GPU).
int64_t cuda_resident_blocks(int64_t device, int64_t world_size);
// Whether an input at ptr of nbytes would be read in place (zero-copy).
bool is_cuda_buffer_registered(int64_t handle, int64_t ptr, int64_t nbytes);

// CUDA graphs (comm.capture(); the graph table is explained in all_reduce.cuh
// and all_reduce.cpp). Between begin and end, a captured call whose buffers are
// not registered gets a table entry that says "staged" until set_entries.
// begin allocates a new block of block_entries entries when needed.
void graph_capture_begin(int64_t handle, int64_t block_entries);
// Every call captured since begin: (entry slot or -1, input address, bytes,
// in place, algo, dtype, average), and how many eligible calls found no free
// entry.
struct GraphCapture {
  std::vector<std::tuple<int64_t, int64_t, int64_t, bool, int64_t, std::string, bool>> calls;
  int64_t calls_without_entry = 0;
};
GraphCapture graph_capture_end(int64_t handle);
// Makes the entries `slots` zero copy: peer_ptrs[i][q] is rank q's buffer for
// slots[i] as mapped here. The caller makes sure no kernel of the communicator
// runs meanwhile and that every rank sets the same entries.
void graph_set_entries(int64_t handle, const std::vector<int64_t>& slots,
                       const std::vector<std::vector<int64_t>>& peer_ptrs);
// Back to "staged" (when another rank failed to set its entries).
void graph_reset_entries(int64_t handle, const std::vector<int64_t>& slots);
// The mode of every entry used so far, read back from the device (tests).
std::vector<int64_t> graph_entry_modes(int64_t handle);

}  // namespace pyallreduce
