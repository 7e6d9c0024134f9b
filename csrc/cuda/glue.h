// The CUDA glue of one communicator: its status record and launch order,
// zero-copy registrations, the graph table of comm.capture(), and the
// launches of its calls. Plain C++ on the CUDA runtime: no torch header (the
// torch adapter, adapter.cpp, turns tensors into the pointers and sizes used
// here, allocates temporaries, and passes the current stream), so it builds
// against any CUDA runtime, the emulated one of tests/emulated included.
// Errors are std::runtime_error ("pyallreduce: ..."), or CallMismatch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../common/context.h"
#include "call_plan.h"
#include "kernel_api.h"

namespace pyallreduce {
namespace cuda {

// Keeps a captured input's memory alive (the adapter's tensor): peers map it
// once its graph entry is zero copy. Made only when a call takes an entry.
using Keep = std::shared_ptr<void>;
using MakeKeep = std::function<Keep()>;

// Whether `stream` is capturing a CUDA graph.
bool is_capturing(cudaStream_t stream);

// ---- status record, launch order, checks --------------------------------------------

// Makes the communicator's status record and launch-order event (when it is
// created, outside any capture: cudaHostAlloc and cudaEventCreate would
// invalidate a global-mode capture).
void prepare(Context& ctx, cudaStream_t stream);
// For abort_context: every kernel of the communicator waiting for a peer
// gives up within kAbortLookNs, as at its deadline, and records
// kStatusAborted (CallStatus::aborted). From any thread; never waits.
void interrupt(const Context& ctx);
// Waits for the communicator's kernels launched so far (not while capturing)
// and raises what they recorded: a deadline (naming the ranks that never
// arrived; marks the context broken) or a mismatch (CallMismatch; cleared).
void check(Context& ctx, cudaStream_t stream);
// The agreement round of a call this rank sends to torch.distributed
// (protocol.h kAgreeOnly): publishes desc, meets every peer at the start
// barrier, and waits for the answer. Throws CallMismatch when the ranks'
// calls differ (the context stays usable), and marks the context broken on a
// deadline. Does nothing while `stream` is being captured.
void agree(Context& ctx, CallDesc desc, cudaStream_t stream);
// The fewest blocks of our kernels for world_size that device holds at once.
int64_t resident_blocks(int device, int64_t world_size);

// ---- one collective call ---------------------------------------------------------------

// The communicator's status record and launch order (made by prepare()):
// looked up once per call by record_of and passed to each step below.
struct StatusRecord;
StatusRecord& record_of(const Context& ctx);
// What runtime.h wait_until_unused needs of the communicator: the event its
// last eager launch recorded (every earlier one ran before it) and whether a
// kernel of it was ever launched into a capture; (none, false) for a context
// without its status record (prepare failed), which never launched.
std::pair<cudaEvent_t, bool> launch_chain(const Context& ctx);

// A call as the adapter describes it: this rank's buffers (the all-reduce's
// 16-byte aligned: see plan_all_reduce), the payload (reduce-scatter and
// all-gather: the segment S of protocol.h), what the descriptor says.
struct CallArgs {
  const char* input;
  char* out;
  int64_t bytes;
  int64_t algo;        // kOneShot, kTwoShot, kReduceScatter or kAllGather
  bool average;
  uint32_t dtype;      // the descriptor's dtype code
  bool reduces;        // a reduction kernel exists for the dtype (element is set)
  Element element;
};

// Before anything is launched: an earlier call's deadline left the ranks
// out of step, so this raises it and nothing is launched.
void raise_deadline(Context& ctx, StatusRecord& rec, cudaStream_t stream);
// After the launch: what an earlier kernel recorded (see check()).
void raise_recorded(Context& ctx, StatusRecord& rec, cudaStream_t stream);
// Reduce-scatter and all-gather: staged whatever is registered, no
// temporaries. Returns whether a kernel exists for the dtype and world size.
bool launch_segment(Context& ctx, StatusRecord& rec, cudaStream_t stream, const CallArgs& args);
// An all-reduce in two steps: the plan says which temporaries the adapter
// must make (a misaligned input or out goes through an aligned copy), then
// the launch with the buffers the kernel reads and writes.
struct AllReduceCall {
  Call call{};
  CallPlan plan;
  bool capturing = false;
};
AllReduceCall plan_all_reduce(Context& ctx, const StatusRecord& rec, cudaStream_t stream, const CallArgs& args);
bool launch_all_reduce(Context& ctx, StatusRecord& rec, cudaStream_t stream, AllReduceCall& c, const char* input,
                       char* out, const CallArgs& args, const MakeKeep& keep);

// ---- zero-copy registrations ---------------------------------------------------------

void register_buffer(const std::shared_ptr<Context>& ctx, int64_t local_ptr, int64_t nbytes,
                     const std::vector<int64_t>& peer_ptrs);
bool unregister_buffer(const Context& ctx, int64_t local_ptr);
bool is_registered(const Context& ctx, int64_t ptr, int64_t nbytes);
// At close: frees the graph table and the status record; returns the kept
// inputs of zero-copy graph entries (peers map them: the transport drops
// them after every peer unmapped).
std::vector<Keep> clear_buffers(const Context& ctx);

// ---- the graph table of comm.capture() ---------------------------------------------

void graph_capture_begin(const std::shared_ptr<Context>& ctx, int64_t block_entries, cudaStream_t stream);
struct CapturedCall {
  int64_t slot;    // its graph-table entry, or -1 (not eligible, or no free entry)
  int64_t input;   // this rank's input address
  int64_t nbytes;
  bool in_place;
  int64_t algo;
  uint32_t dtype;  // the descriptor's dtype code
  bool average;
};
struct GraphCapture {
  std::vector<CapturedCall> calls;
  int64_t calls_without_entry = 0;
};
GraphCapture graph_capture_end(const Context& ctx);
void graph_set_entries(const Context& ctx, const std::vector<int64_t>& slots,
                       const std::vector<std::vector<int64_t>>& peer_ptrs, cudaStream_t stream);
void graph_reset_entries(const Context& ctx, const std::vector<int64_t>& slots, cudaStream_t stream);
std::vector<int64_t> graph_entry_modes(const Context& ctx, cudaStream_t stream);

}  // namespace cuda
}  // namespace pyallreduce
