// One Context per Communicator: the mapped peer regions and the fixed launch
// shape. Python creates it (pyallreduce._C.create_context) after the transport
// has mapped every peer, and passes its integer handle to the custom ops, which
// keeps the op schemas free of opaque objects (torch.compile sees a constant).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "protocol.h"

namespace pyallreduce {

// Host backend: the bytes of one round of a large call (csrc/cpu/all_reduce.cpp,
// run_rounds) until the Communicator sets this machine's (set_round_bytes,
// policy.host_round_bytes); measured on the 2-core Intel Xeon VM.
constexpr int64_t kDefaultRoundBytes = 256 << 10;

// Who ends a communicator without its peers, for the error of a call that
// gave up waiting because of it (every backend's, Python's through _C).
constexpr const char* kAbortedBy =
    "Communicator.abort(), torch.distributed's abort of its process group, or a close after an error or at exit";

struct Context {
  int rank = 0;
  int world_size = 1;
  int64_t max_bytes = 0;
  int nblocks = 1;             // fixed for the communicator's life (see protocol.h)
  int64_t timeout_ns = 0;      // deadline of every spin
  bool is_cuda = false;
  int device = -1;             // CUDA device index, -1 for host memory
  std::array<char*, kMaxRanks> regions{};  // region base of every rank, own included
  std::vector<int64_t> pids;   // host backend: peers' pids, to report a dead rank early
  // Host backend: the ranks outnumber the cores they may run on together, so
  // a waiting rank yields before it sleeps instead of spinning (wait_reached).
  bool ranks_outnumber_cores = false;

  // One collective in flight per communicator: a second thread is rejected,
  // never interleaved (interleaving would pair different calls across ranks).
  std::mutex in_flight;
  // Set when a collective failed mid-protocol (deadline, dead peer): flags and
  // epochs are then out of step across ranks, so every later call must refuse.
  std::atomic<bool> broken{false};
  std::string broken_reason;
  // Set by abort_context (Communicator.abort and every close without the
  // peers; torch.distributed's abort of the process group) from any thread: a
  // host wait in progress gives up at its next clock check (within
  // kLivenessCheckPeriod), and no later call starts. An abort also ends a
  // CUDA kernel's wait within kAbortLookNs (the status record's `aborted`).
  std::atomic<bool> aborted{false};
  // Set by seal_context (destroy_context's first step) under in_flight: a
  // thread that fetched the context just before close() must not touch the
  // (soon freed or unmapped) status record and regions.
  bool closed = false;
  // Collectives started on this context (agreement rounds included): the "call
  // N" of error messages, counted from 1.
  int64_t calls = 0;
  // Host backend (csrc/cpu/all_reduce.cpp, run_rounds): calls left for
  // which this rank still reports contended cores (its hint kDescContended),
  // and whether any rank's hint said so in the last call, which every rank
  // reads alike.
  int contended_calls = 0;
  bool merge_rounds = false;
  int64_t slice_lost_call = -(int64_t{1} << 40);  // the last call whose yield lost a slice (wait_reached)
  // Waits in a row that found the awaited peer on this rank's CPU, up to the
  // number that moves it; negative after a move that failed (wait_reached).
  int shared_cpu_waits = 0;
  // Host backend: the size of a round (run_rounds), the same on every rank
  // (rank 0's choice, group.agree_on_group), set before the first call.
  int64_t round_bytes = kDefaultRoundBytes;

  char* own_region() const { return regions[rank]; }
};

// The ranks' descriptors of one call differ (protocol.h, "agree"). Every rank
// throws the same text, nothing was reduced, and the protocol put every rank's
// epochs back in step: unlike any other failure mid-protocol, the context
// stays usable.
struct CallMismatch : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The text of CallMismatch: every rank's call, one line each.
// mismatches > 1: that many calls were skipped before this rank looked (a GPU
// kernel records them; the host raises at a later call), the last of them
// `last_call`.
std::string mismatch_message(int64_t call, uint32_t epoch, const CallDesc* descs, int world_size,
                             int64_t mismatches = 1, int64_t last_call = 0);
// Whether every descs[q] equals mine (epoch included).
bool calls_agree(const CallDesc& mine, const CallDesc* descs, int world_size);

// Registry of live contexts, indexed by handle.
int64_t register_context(std::unique_ptr<Context> ctx);
// keep_alive: the context's kernels may still run (a graph replay its close
// could not wait for), so the context, and with it the CUDA glue's state keyed
// by its address (status record, graph table), stays allocated until the
// process exits, and no new context takes its address.
void destroy_context(int64_t handle, bool keep_alive = false);
// destroy_context's first step, alone: sets `closed` once no call is in flight
// (waiting for one on another thread) and returns the context, or null for a
// handle not registered. The handle stays registered: the CUDA close seals,
// waits for its kernels and frees the status record, then destroys.
std::shared_ptr<Context> seal_context(int64_t handle);
std::shared_ptr<Context> get_context(int64_t handle);
// Sets the context's `aborted` and waits until no call of it is in flight;
// nothing for a handle already destroyed. end_kernels (an abort, not every
// close without the peers): its CUDA kernels waiting for a peer give up too.
void abort_context(int64_t handle, bool end_kernels);

// Holds ctx.in_flight for one collective and refuses a broken or busy context.
class CollectiveGuard {
 public:
  explicit CollectiveGuard(Context& ctx);
  ~CollectiveGuard();
  CollectiveGuard(const CollectiveGuard&) = delete;
  CollectiveGuard& operator=(const CollectiveGuard&) = delete;
  // Marks the context unusable; later calls raise with this reason.
  void fail(const std::string& reason);

 private:
  Context& ctx_;
};

}  // namespace pyallreduce
