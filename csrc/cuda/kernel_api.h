// What the host side (csrc/cuda/glue.cpp, compiled by g++ without torch)
// shares with the kernels (all_reduce.cuh, compiled by nvcc in
// csrc/cuda/kernels.cu, the only file with device code): the call, the status
// record, the graph-table entry, and the launch functions kernels.cu defines.
// Plain host C++ with the CUDA runtime's types: the device passes of nvcc
// never see torch's headers, and g++ never sees device code.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/protocol.h"

namespace pyallreduce {
namespace cuda {

// 512 threads: enough 16-byte loads in flight per block to cover NVLink
// latency with few blocks (the SMs are shared with the training beside us).
constexpr int kThreads = 512;
constexpr int kVecBytes = 16;
constexpr int64_t kChunkBytes = int64_t(kThreads) * kVecBytes;
// Plain copies (copy-in, two-shot gather) keep this many 16-byte loads per
// thread in flight before storing, so a copy is not one round trip per vector.
constexpr int kCopyBatch = 4;

// Where the W buffers a call reduces from live (the descriptor's mode field:
// the values are protocol.h's).
enum Mode : int {
  // Every rank copies its input into its own staging buffer data[e % 2]; peers
  // read the staging buffers. No end barrier (double buffering).
  kStaged = int(kModeStaged),
  // Zero-copy: peers read each rank's registered input in place and out is a
  // separate tensor. One-shot then needs an end barrier (the caller may
  // overwrite the input as soon as the kernel returns); two-shot does not (the
  // inputs are only read before its mid barrier).
  kRegistered = int(kModeRegistered),
  // Zero-copy and out == input: two-shot only (kernel_algo forces it),
  // owners reduce in place, every rank gathers into its own registered buffer,
  // end barrier.
  kRegisteredInPlace = int(kModeRegisteredInPlace),
};

// What a kernel leaves for the host when a call cannot complete, instead of
// trapping (a trap makes the process's CUDA context unusable for good). One
// record per communicator in pinned host memory mapped into the device, so the
// host reads it without synchronising: csrc/cuda/glue.cpp checks it before
// every launch, after an agreement round and in check(). The first failing
// block claims it, fills it in, and stores code last (release, system scope);
// the host reads code (acquire), then the rest. The claim is an atomicMax of
// the record's generation on a word in device memory (Call::claim), not an
// atomic on the mapped host memory, which would depend on the platform's PCIe
// atomics: only this process's blocks compete. A block wins when the word was
// below the generation; the host advances the generation whenever it clears
// the record, so the device word never needs resetting.
// Every mismatched call is counted, not only the first: the host raises a
// recorded mismatch only after launching the next call, which may mismatch
// too, and a program that catches the error and goes on must learn that
// neither call wrote its output. Block 0 counts (every block of a mismatched
// call sees the mismatch; the communicator's kernels run one after another,
// so it is the only writer), and the host reads the count once no kernel of
// the communicator runs.
// A deadline or an abort claims with its generation | kClaimSevere, so it takes
// the record over from a mismatch of the same generation (the worse news: the
// ranks are out of step, and every later kernel does nothing, Call::gave_up),
// never the reverse; the host raises it even if it first read the mismatch.
// The host's generations stay far below 2^31.
constexpr uint32_t kClaimSevere = 1u << 31;
constexpr uint32_t kStatusOk = 0;
constexpr uint32_t kStatusDeadline = 1;  // a rank never arrived: the communicator is broken
constexpr uint32_t kStatusMismatch = 2;  // descriptors differ: nothing written, ranks in step
constexpr uint32_t kStatusAborted = 3;   // a wait gave up because the host set `aborted`: broken too
// CallStatus::barrier values.
constexpr uint32_t kBarrierStart = 0;
constexpr uint32_t kBarrierMid = 1;
constexpr uint32_t kBarrierEnd = 2;

struct CallStatus {
  uint32_t code;
  uint32_t generation;          // from 1, advanced by the host each time it clears the record
  uint32_t barrier;             // deadline or abort: which barrier
  uint32_t block;
  uint32_t epoch;               // e of the (first) failed call
  uint32_t missing;             // deadline or abort: bit q set = rank q had not arrived
  uint32_t mismatches;          // mismatched calls since the host last cleared the record
  uint32_t unused;              // keeps the 64-bit fields aligned
  int64_t call;                 // Call::call_number of the (first) failed call
  int64_t last_mismatch_call;   // Call::call_number of the last mismatched call
  CallDesc descs[kMaxRanks];    // mismatch: every rank's descriptor as read here (the first call's)
  // Set to 1 by the host (abort_context with end_kernels: Communicator.abort(),
  // torch.distributed's abort of the group) and never cleared: last, so that clearing the record
  // (the fields before it) cannot race with it. A wait that has lasted
  // kAbortLookNs reads it once per kAbortLookNs and gives up as at its
  // deadline, so an abort does not wait for the kernel's deadline. Only a
  // slow wait reads this host word (over PCIe): a call whose peers arrive in
  // time never does.
  uint32_t aborted;
};

// A captured call's entry in the communicator's graph table (device memory).
// A CUDA graph fixes kernel arguments at capture, but a buffer first seen
// during a capture is registered only when comm.capture() exits: such a call
// is captured with a pointer to its entry, which says kStaged (zeroed memory)
// until the host fills in every rank's buffer and the zero-copy mode. The
// host writes entries only while no kernel runs, and every rank writes the
// same modes (comm.capture() agrees on them first).
struct GraphEntry {
  const char* registered[kMaxRanks];  // every rank's input as mapped here, once registered
  int64_t mode;                       // kStaged, kRegistered or kRegisteredInPlace
};

// One call as the glue (csrc/cuda/glue.cpp) describes it.
struct Call {
  char* regions[kMaxRanks];     // each rank's region base as mapped in this process
  char* registered[kMaxRanks];  // zero-copy modes: each rank's input as mapped here
  const char* input;            // this rank's input (all-reduce: 16-byte aligned)
  char* out;                    // this rank's output (all-reduce: 16-byte aligned)
  int64_t bytes;                // payload size, a multiple of the element size; for
                                // reduce-scatter and all-gather the segment S (protocol.h)
  int64_t max_bytes;            // size of one staging buffer
  int64_t timeout_ns;           // deadline of every spin
  int rank;
  Mode mode;
  int64_t algo;                 // kOneShot, kTwoShot, kReduceScatter, kAllGather or kAgreeOnly, as requested
  // An agreement round (algo kAgreeOnly): the algo its descriptor names, i.e.
  // the collective it stands for (kAgreeOnly for an all-reduce), so that the
  // fallbacks of different collectives cannot pair.
  int64_t agree_algo = kAgreeOnly;
  bool average;                 // divide the fp32 sum by W before the cast
  bool in_place;                // the caller's input and out are one tensor (descriptor only)
  uint32_t dtype;               // c10::ScalarType value (descriptor only)
  uint64_t desc_bytes;          // the call's payload as published (bytes, or an agreement's size)
  int64_t call_number;          // the communicator's count of collective calls, for the status record
                                // (a captured call keeps the number it was captured with)
  const GraphEntry* graph_entry;  // set for a captured staged call whose buffers may be registered later
  CallStatus* status;           // device address of the communicator's status record
  uint32_t* claim;              // device memory: the last generation of the record a block claimed
  // Device memory, set by a block whose wait gave up (a deadline, an abort).
  // Every later kernel of the communicator then does nothing at all (no copy
  // in, no flag): those already queued when a wait gave up would otherwise
  // publish calls this rank never completes, whose flags (a peer counts e and
  // e + 1 as arrived) and staging writes a late peer could take for the
  // failed call's, and finish it with wrong data and no error.
  uint32_t* gave_up;
};

__host__ __device__ inline bool vec_aligned(uintptr_t p) { return p % uintptr_t(kVecBytes) == 0; }

// The element types the reductions support (reduce-scatter and all-reduce);
// all-gather copies words of any dtype.
enum class Element { kFloat32, kFloat16, kBFloat16 };

// The kernels' launchers, defined in csrc/cuda/kernels.cu. Each launches one
// call's kernel on `stream` with nblocks blocks and returns false, launching
// nothing, when no kernel exists for the world size; a launch error is left
// for cudaGetLastError. all_reduce covers one-shot, two-shot and the
// agreement round (call.algo).
namespace kernels {
bool all_reduce(Element element, int world_size, const Call& call, int nblocks, cudaStream_t stream);
bool reduce_scatter(Element element, int world_size, const Call& call, int nblocks, cudaStream_t stream);
bool all_gather(int world_size, const Call& call, int nblocks, cudaStream_t stream);
// The fewest blocks of any kernel instance for world_size that one SM of the
// current device holds, in *blocks; cudaErrorInvalidValue for a world size
// without kernels.
cudaError_t fewest_resident_blocks_per_sm(int world_size, int* blocks);
}  // namespace kernels

}  // namespace cuda
}  // namespace pyallreduce
