// The decisions the CUDA glue (csrc/cuda/glue.cpp) makes for one call, as plain functions
// without torch or CUDA runtime calls, so tests/sim (the CUDA-on-host harness)
// runs exactly the glue's choices in front of the real kernels: the source
// mode, the aligned temporaries, graph-table eligibility, graph-table slots,
// reduce-scatter's and all-gather's plan, and the text of a failure the
// kernels recorded.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>

#include "../common/context.h"
#include "kernel_api.h"

namespace pyallreduce {
namespace cuda {

// Whether the kernels may read `in` in place (zero-copy) when it is registered:
// an in-place call, or an out that does not overlap the input (a partial
// overlap would have out overwrite input peers still read).
inline bool may_read_in_place(uintptr_t in, uintptr_t out, int64_t bytes) {
  return in == out || out + uintptr_t(bytes) <= in || in + uintptr_t(bytes) <= out;
}

struct CallPlan {
  Mode mode = kStaged;
  bool in_place = false;     // the descriptor's bit: the caller's input is its out
  bool copy_input = false;   // input goes through an aligned temporary (clone)
  bool copy_out = false;     // the kernel writes an aligned temporary, copied to out after
  bool graph_entry_eligible = false;  // a capture may give it a graph-table entry
};

// `registered`: find_registered matched the input (asked only when
// may_read_in_place). The kernels access input and out in 16-byte vectors.
// Tensors from the allocator are aligned; a view at an odd offset goes through
// an aligned temporary. A registered input is aligned by construction
// (find_registered), but out need not be: a zero-copy call with a misaligned
// out writes a temporary too (16-byte stores to it would fault).
inline CallPlan plan_call(uintptr_t in, uintptr_t out, int64_t bytes, int64_t algo, bool registered) {
  CallPlan p;
  p.in_place = in == out;
  if (registered) p.mode = p.in_place ? kRegisteredInPlace : kRegistered;
  p.copy_input = p.mode == kStaged && !vec_aligned(in);
  p.copy_out = p.mode != kRegisteredInPlace && !vec_aligned(out);
  const bool disjoint = !p.in_place && may_read_in_place(in, out, bytes);
  // A graph entry may later switch the call to zero copy, which reads the
  // captured input in place and writes the captured out: both must be the
  // caller's own aligned tensors, and in place only exists as two-shot.
  p.graph_entry_eligible = p.mode == kStaged && !p.copy_input && !p.copy_out &&
                           (disjoint || (p.in_place && algo == kTwoShot));
  return p;
}

// Reduce-scatter and all-gather (algo kReduceScatter or kAllGather, segment
// S bytes): staged whatever is registered (their kernels read only staging
// buffers), no temporaries (the kernels take element-aligned addresses: their
// segments at q * S need not be 16-byte aligned anyway), never a graph entry
// (a capture records them as plain staged calls). In place means the one
// overlap protocol.h allows: reduce-scatter's out is segment `rank` of its
// input, all-gather's input segment `rank` of its out.
inline CallPlan plan_segment_call(uintptr_t in, uintptr_t out, int64_t segment_bytes, int rank, int64_t algo) {
  CallPlan p;
  p.in_place = collective_in_place(in, out, segment_bytes, rank, algo);
  return p;
}

// Graph table (all_reduce.cpp): whether comm.capture() must allocate a new
// block before it opens, given the blocks so far and the next free slot. A new
// block is started when the current one is more than half used, so one
// capture has at least half a block of entries.
inline bool graph_needs_block(int64_t nblocks, int64_t block_entries, int64_t next_slot) {
  return nblocks == 0 || nblocks * block_entries - next_slot < (block_entries + 1) / 2;
}
// The slot for an eligible captured call, or -1 when every block is full.
inline int64_t graph_take_slot(int64_t nblocks, int64_t block_entries, int64_t& next_slot) {
  return next_slot < nblocks * block_entries ? next_slot++ : -1;
}

// One communicator's kernels must run one after another on the device: two
// of its kernels running at once on one rank race on the per-block epochs
// (wrong sums, or barriers that never meet). The host-side lock orders the
// launches, not the GPU work, and callers launch on several streams (the DDP
// hook's side stream, the current stream of eager calls). So a launch on a
// stream other than the previous launch's first waits for that launch's event.
// Launches being captured into a CUDA graph are not chained: a capture cannot
// wait on an event recorded outside it (torch.cuda.graph synchronizes the
// device when the capture begins), and a replay is ordered by the stream it is
// replayed on only (README: replay on the stream of the eager calls).
struct LaunchOrder {
  bool any = false;   // a launch was recorded
  cudaStream_t last{};  // on this stream, with the communicator's event
};
// Whether a launch on `stream` must first wait for the previous launch's
// event; notes this launch (the caller records the event after it).
inline bool order_launch(LaunchOrder& order, cudaStream_t stream, bool capturing) {
  if (capturing) return false;
  const bool wait = order.any && order.last != stream;
  order.any = true;
  order.last = stream;
  return wait;
}

inline const char* barrier_name(uint32_t barrier) {
  return barrier == kBarrierStart ? "start" : barrier == kBarrierMid ? "mid" : "end";
}

// The error for a kStatusDeadline or kStatusAborted record of this rank,
// worded as the CPU and Triton backends word theirs (the rank, the barrier,
// the call, who is missing).
inline std::string gave_up_message(const CallStatus& st, int rank, int world_size, int64_t timeout_ns) {
  std::ostringstream missing;
  for (int q = 0; q < world_size; ++q) {
    if ((st.missing >> q) & 1u) missing << " " << q;
  }
  std::ostringstream s;
  if (st.code == kStatusAborted) {
    s << "pyallreduce: collective call " << st.call << " on this communicator was aborted (" << kAbortedBy
      << ") while rank " << rank << "'s kernel waited in the " << barrier_name(st.barrier) << " barrier (block "
      << st.block << ", epoch " << st.epoch << ") for rank(s)" << missing.str()
      << "; create a new Communicator (or process group) on the ranks that go on";
    return s.str();
  }
  s << "pyallreduce: rank " << rank << " waited past its " << double(timeout_ns) / 1e9 << " s deadline in the "
    << barrier_name(st.barrier) << " barrier of collective call " << st.call << " on this communicator (block "
    << st.block << ", epoch " << st.epoch << "); rank(s)" << missing.str()
    << " never arrived there. Every rank must make the same collective calls in the same order. This "
       "communicator is unusable now (close() it and create a new one on every rank); the CUDA context is fine.";
  return s.str();
}

}  // namespace cuda
}  // namespace pyallreduce
