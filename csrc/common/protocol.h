// The symmetric-region layout and the signal protocol shared by every backend
// (C++ CPU, CUDA, and the Triton kernels, which read these constants through
// pyallreduce._C). This file is the one place these numbers are defined.
//
// Every rank owns one region that all peers map:
//
//   offset 0                 start_flags[kMaxBlocks][kMaxRanks]  uint32
//   kMidFlagsOffset          mid_flags  [kMaxBlocks][kMaxRanks]  uint32
//   kEpochOffset             epoch      [kMaxBlocks]             uint32
//   kDescOffset              desc[2][kMaxBlocks][kMaxRanks]      CallDesc (16 bytes)
//   kSleepOffset             sleeping                            uint32 (host backend)
//   kCpuOffset               the CPU the rank runs on, plus one  uint32 (host backend)
//   kDataOffset              data[2][max_bytes]                  staging buffers
//
// start_flags[b][q] / mid_flags[b][q] / desc[*][b][q] in rank r's region are
// written only by rank q's block b (one 32-bit word per writer: no two ranks
// ever write bytes of one word) and read only by rank r. epoch[b] is read and
// advanced only by the owning rank's block b: the call counter lives beside
// the flags (device memory on GPU) so a replayed CUDA graph keeps counting.
//
// Protocol for one call of block b (W ranks, e = ++epoch[b]):
//   copy-in    input -> own data[e % 2]            (alternating buffers: see below)
//   start      for q: peer[q].desc[e % 2][b][me] = my CallDesc for e  (plain stores)
//                     peer[q].start_flags[b][me] = e  (release, system scope)
//                     no mid barrier in this call (one-shot, agreement round):
//                     peer[q].mid_flags[b][me] = e (release)
//              wait own.start_flags[b][q] reached e for every q (acquire)
//   agree      own.desc[e % 2][b][q] == my CallDesc for every q (epoch included),
//              checked before any peer data is read; else every rank raises
//              the same error listing every rank's call (calls_agree();
//              bit kDescContended of `kind` is a hint and not compared).
//   one-shot   out = sum over q = 0..W-1 of peer[q].data[e % 2]   (fixed order)
//   two-shot   reduce my owned chunks from every peer into own data[e % 2],
//              mid barrier on mid_flags (same shape), gather every owner's chunks.
//
// Why a call without a mid barrier still stores e into the mid flags: "reached"
// (epoch_reached below) is flag - e in {0, 1} modulo 2^32, so a mid flag left
// by a two-shot call exactly 2^32 - 1 or 2^32 epochs earlier (or the zeroed
// region's 0 when the first two-shot call runs at epoch 0 or 2^32 - 1) would
// pass the mid barrier before the peer reduced its chunks. Refreshed by every
// call, a mid flag is never more than two epochs old (a zero-copy call uses
// two), so it can never alias. Checked for any history by tests/model.
//
// Why the descriptors are double-buffered by epoch parity: a peer that passed
// the start barrier of e may already publish call e + 1 while we still read
// its descriptor of e; it rewrites desc[e % 2] only in call e + 2, after the
// start barrier of e + 1, which needs our flag e + 1, stored after our check.
// On a mismatch every rank skips the call's data (no output is written), sets
// its epoch counter back to e (a kind that uses two epochs had reserved
// e + 1) and stores e into its mid flags, so every rank continues from e + 1
// in step. (Skipping to e + 2 where some rank's call used two epochs would let
// the rank that found the mismatch first overwrite its start flag and
// desc[e % 2] before a slower peer read them: a deadlock tests/model found.)
//
// tests/model/protocol.pml models this protocol for every interleaving; keep
// the two in step (tests/model/README.md maps one onto the other).
#pragma once

#include <cstdint>

namespace pyallreduce {

constexpr int kMaxRanks = 8;
constexpr int kMaxBlocks = 64;
// Staging buffers, max_bytes and every slice boundary are multiples of this:
// it keeps 16-byte vector accesses aligned and buffers on separate pages.
constexpr int64_t kAlignment = 4096;

constexpr int64_t kFlagArrayBytes = int64_t(kMaxBlocks) * kMaxRanks * sizeof(uint32_t);
constexpr int64_t kStartFlagsOffset = 0;
constexpr int64_t kMidFlagsOffset = kStartFlagsOffset + kFlagArrayBytes;
constexpr int64_t kEpochOffset = kMidFlagsOffset + kFlagArrayBytes;
constexpr int64_t kDescOffset = kEpochOffset + int64_t(kMaxBlocks) * sizeof(uint32_t);
constexpr int64_t kDescBytes = 16;  // sizeof(CallDesc): one 16-byte vector store on GPU
constexpr int64_t kDescArrayBytes = 2 * int64_t(kMaxBlocks) * kMaxRanks * kDescBytes;
// The host backend's "I may be asleep on a futex" word, alone on its cache line
// (peers read it after every flag store; see csrc/cpu/all_reduce.cpp).
constexpr int64_t kSleepOffset = kDescOffset + kDescArrayBytes;
// The host backend's "I run on CPU n" word (n + 1; 0 before the first
// call), on its own cache line: written by the rank when it changed, read
// by a peer spinning for it (csrc/cpu/all_reduce.cpp, wait_reached).
constexpr int64_t kCpuOffset = kSleepOffset + 64;
constexpr int64_t kSignalBytes = kCpuOffset + 64;
constexpr int64_t kDataOffset = (kSignalBytes + kAlignment - 1) / kAlignment * kAlignment;

// How often a CUDA kernel's wait, once it has lasted this long, reads its
// communicator's "aborted" word in pinned host memory: an abort ends a waiting
// kernel within about this long, and a wait whose peers arrive in time never
// reads host memory. (Triton's interpreted waits read it every round; its
// compiled ones do not yet.)
constexpr int64_t kAbortLookNs = 1000000;

// Algorithm ids as passed to the custom op (pyallreduce/communicator.py maps names).
constexpr int64_t kOneShot = 0;
constexpr int64_t kTwoShot = 1;

inline constexpr int64_t region_bytes(int64_t max_bytes) {
  return kDataOffset + 2 * max_bytes;
}
inline constexpr int64_t staging_offset(uint32_t epoch, int64_t max_bytes) {
  return kDataOffset + int64_t(epoch & 1u) * max_bytes;
}
inline constexpr int64_t flag_index(int block, int rank) {
  return int64_t(block) * kMaxRanks + rank;
}
// Byte offset in a region of desc[epoch % 2][block][rank].
inline constexpr int64_t desc_offset(uint32_t epoch, int block, int rank) {
  return kDescOffset + ((int64_t(epoch & 1u) * kMaxBlocks + block) * kMaxRanks + rank) * kDescBytes;
}

// What one call of one rank is, published with its start flag. Ranks whose
// descriptors differ would pair different calls: wrong sums, reads past a
// smaller peer's data, or barriers that never meet. `kind` packs:
//   bits 0-7   dtype: the c10::ScalarType value (torch's numbering, the same on
//              every rank of one installation; Python: pyallreduce._C.dtype_code)
//   bits 8-15  algo: kOneShot, kTwoShot, kAgreeOnly (no data moves),
//              kReduceScatter, kAllGather
//   bits 16-23 mode: kStaged..kRegisteredInPlace (CUDA), kModeFallback
//   bit 24     average
//   bit 25     in place
//   bit 26     a hint, not compared (kDescCompared): this rank's waits inside
//              its last call slept, i.e. its cores are contended (host backend:
//              when any rank says so, every rank merges the call's later rounds,
//              see csrc/cpu/all_reduce.cpp)
struct CallDesc {
  uint64_t bytes;   // the whole call's payload (all of its rounds on CPU)
  uint32_t epoch;   // e: catches a descriptor that is not this call's
  uint32_t kind;
};
static_assert(sizeof(CallDesc) == kDescBytes, "CallDesc must stay one 16-byte vector");
constexpr uint32_t kDescContended = 1u << 26;
constexpr uint32_t kDescCompared = ~kDescContended;  // the bits of `kind` every rank must agree on

// Whether two ranks' descriptors describe the same call (epoch included).
#if defined(__CUDACC__)
__host__ __device__
#endif
inline bool same_call(const CallDesc& a, const CallDesc& b) {
  return a.bytes == b.bytes && a.epoch == b.epoch && ((a.kind ^ b.kind) & kDescCompared) == 0;
}

// Reduce-scatter and all-gather: the two halves of two-shot, as collectives
// of their own (torch.distributed's reduce_scatter_tensor and
// all_gather_into_tensor). One epoch per call, no mid barrier (the start
// barrier also stores the mid flags, as one-shot does), so the one-shot
// argument for rewriting a staging buffer two calls later holds as is.
// S is the per-rank segment: reduce-scatter's output, all-gather's input; the
// descriptor's `bytes` is W * S (the larger tensor) for both.
//   reduce-scatter  input = W segments of S; out = sum over q in rank order of
//                   segment `rank` of rank q's input (fp32 accumulation, avg
//                   divides by W), the bits of one-shot's sum of those bytes.
//                   Staging holds the segments at segment_stride(S) apart.
//   all-gather      input = S bytes (any dtype: a byte copy); out = W
//                   segments, segment q is rank q's input. Staging holds S.
// A GPU block copies in and reads the same staging chunks in every call: the
// chunk of staging offset o is o / chunk bytes, its block chunk_block(...),
// as for all-reduce; the caller chunks calls larger than staging. The host
// backend (one block) runs any size in rounds, each a piece of every segment
// with its own layout (csrc/cpu/all_reduce.cpp).
// Aliasing: reduce-scatter's out may be exactly segment `rank` of its input,
// all-gather's input exactly segment `rank` of its out (FSDP2 does this);
// any other overlap is refused.
constexpr int64_t kReduceScatter = 3;
constexpr int64_t kAllGather = 4;
// Reduce-scatter segments start at multiples of this in staging, so every
// backend's chunk (CUDA 8 KiB, Triton 4 KiB, host cache lines) lies inside
// one segment and vector accesses stay aligned.
constexpr int64_t kSegmentUnit = 8192;
inline constexpr int64_t segment_stride(int64_t segment_bytes) {
  return (segment_bytes + kSegmentUnit - 1) / kSegmentUnit * kSegmentUnit;
}

// Whether a call is in place (the descriptor's in-place bit): all-reduce's out
// is its input; reduce-scatter's out is exactly segment `rank` of its input,
// all-gather's input exactly segment `rank` of its out (the aliasing above).
// segment_bytes: S for reduce-scatter and all-gather. The one place for this
// rule in C++ (module.cpp's argument check, call_plan.h, the host backend).
inline bool collective_in_place(uintptr_t in, uintptr_t out, int64_t segment_bytes, int rank, int64_t algo) {
  const uintptr_t own_segment = uintptr_t(rank) * uintptr_t(segment_bytes);
  if (algo == kReduceScatter) return segment_bytes > 0 && out == in + own_segment;
  if (algo == kAllGather) return segment_bytes > 0 && in == out + own_segment;
  return in == out;
}

// A call that moves no data through the kernels: the agreement round a rank
// runs before a call it sends to torch.distributed (kModeFallback), so that a
// fallback call facing a kernel call on another rank raises on both instead
// of each waiting for the other.
constexpr int64_t kAgreeOnly = 2;
// Where a call's sources live (CUDA's zero-copy modes: csrc/cuda/all_reduce.cuh),
// or that the call goes to torch.distributed.
constexpr uint32_t kModeStaged = 0;
constexpr uint32_t kModeRegistered = 1;
constexpr uint32_t kModeRegisteredInPlace = 2;
constexpr uint32_t kModeFallback = 3;

#if defined(__CUDACC__)
__host__ __device__
#endif
inline constexpr uint32_t desc_kind(uint32_t dtype, uint32_t algo, uint32_t mode, bool average,
                                    bool in_place) {
  return (dtype & 0xFFu) | (algo & 0xFFu) << 8 | (mode & 0xFFu) << 16 | uint32_t(average) << 24 |
         uint32_t(in_place) << 25;
}
// Epochs a call of this kind uses on the CUDA kernels: the zero-copy end
// barrier waits on start_flags at e + 1 (all_reduce.cuh); everything else 1
// (and every call of the host and Triton backends).
#if defined(__CUDACC__)
__host__ __device__
#endif
inline constexpr uint32_t desc_epochs_used(uint32_t kind) {
  const uint32_t algo = (kind >> 8) & 0xFFu, mode = (kind >> 16) & 0xFFu;
  return (mode == kModeRegistered && algo == uint32_t(kOneShot)) || mode == kModeRegisteredInPlace ? 2u : 1u;
}

// Flags only ever move forward, and a peer can be at most one barrier ahead of
// us (it cannot pass barrier e+1 before we arrived at it). So while we wait for
// e, a peer's flag holds e or e+1 (arrived: e+1 was written over e) or an older
// epoch, at most two behind (not there yet: every call stores both flags, see
// above). "Reached" is flag - e in {0, 1} modulo 2^32: wrap-safe because no
// flag is ever 2^32 - 2 epochs stale.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline bool epoch_reached(uint32_t flag, uint32_t epoch) {
  return uint32_t(flag - epoch) <= 1u;
}

// Chunk ownership. Chunk c (a fixed number of bytes, chosen by the backend)
// is reduced in two-shot by rank c % W, and handled by block (c / W) %
// nblocks on every rank in every phase of both algorithms: W consecutive
// chunks, one per owner, form a group, and groups go round-robin over the
// blocks. Both depend only on c (and the communicator's fixed W and nblocks),
// so a block touches the same bytes of the staging buffers in every call,
// which the per-block argument above needs; and every size spreads the
// reduction over the ranks (their shares differ by at most one chunk).
#if defined(__CUDACC__)
__host__ __device__
#endif
inline constexpr int64_t chunk_owner_rank(int64_t chunk, int world_size) {
  return chunk % world_size;
}
#if defined(__CUDACC__)
__host__ __device__
#endif
inline constexpr int64_t chunk_block(int64_t chunk, int nblocks, int world_size) {
  return (chunk / world_size) % nblocks;
}
// Block b's k-th chunk, k = 0, 1, ... in increasing order (its owner is
// k % W), and how many of [0, nchunks) are block b's.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline constexpr int64_t block_chunk(int block, int64_t k, int nblocks, int world_size) {
  return (block + k / world_size * nblocks) * world_size + k % world_size;
}
#if defined(__CUDACC__)
__host__ __device__
#endif
inline constexpr int64_t block_rounds(int block, int64_t nchunks, int nblocks, int world_size) {
  const int64_t groups = nchunks / world_size;  // complete ones; then nchunks % W chunks of the next
  return (groups - block + nblocks - 1) / nblocks * world_size +
         (groups % nblocks == block ? nchunks % world_size : 0);
}

}  // namespace pyallreduce
