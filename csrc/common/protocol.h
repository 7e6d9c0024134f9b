// The symmetric-region layout and the signal protocol shared by every backend
// (C++ CPU, CUDA, and the Triton kernels, which read these constants through
// pyallreduce._C). This file is the one place these numbers are defined.
//
// Every rank owns one region that all peers map:
//
//   offset 0                 start_flags[kMaxBlocks][kMaxRanks]  uint32
//   kMidFlagsOffset          mid_flags  [kMaxBlocks][kMaxRanks]  uint32
//   kEpochOffset             epoch      [kMaxBlocks]             uint32
//   kDataOffset              data[2][max_bytes]                  staging buffers
//
// start_flags[b][q] / mid_flags[b][q] in rank r's region are written only by
// rank q's block b (one 32-bit word per writer: no two ranks ever write bytes
// of one word) and read only by rank r. epoch[b] is read and advanced only by
// the owning rank's block b: the call counter lives beside the flags (device
// memory on GPU) so a replayed CUDA graph keeps counting.
//
// Protocol for one call of block b (W ranks, e = ++epoch[b]):
//   copy-in    input -> own data[e % 2]            (alternating buffers: see below)
//   start      for q: peer[q].start_flags[b][me] = e  (release, system scope)
//              wait own.start_flags[b][q] reached e for every q (acquire)
//   one-shot   out = sum over q = 0..W-1 of peer[q].data[e % 2]   (fixed order)
//   two-shot   reduce my owned chunks from every peer into own data[e % 2],
//              mid barrier on mid_flags (same shape), gather every owner's chunks.
//
// No end barrier: a rank overwrites data[e % 2] again only in call e + 2,
// after passing the start barrier of call e + 1, which each peer reaches only
// after finishing call e (the last reader of that buffer).
//
// That argument is per block, so on every rank, in every call and in both
// algorithms, a given element must be touched by the same block. Elements are
// grouped in chunks of a width fixed by the backend (threads-per-block x one
// 16-byte vector on GPU); chunk c belongs to block c % nblocks, with nblocks
// fixed for the communicator's life. See chunk_owner_rank(). (The host backend
// runs one block per rank, so there any split the ranks agree on within a call
// is sound; it uses contiguous slices, see csrc/cpu/all_reduce.cpp.)
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
constexpr int64_t kSignalBytes = kEpochOffset + int64_t(kMaxBlocks) * sizeof(uint32_t);
constexpr int64_t kDataOffset = (kSignalBytes + kAlignment - 1) / kAlignment * kAlignment;

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

// Flags only ever move forward, and a peer can be at most one barrier ahead of
// us (it cannot pass barrier e+1 before we arrived at it). So while we wait for
// e, a peer's flag holds e or e+1 (arrived: e+1 was written over e) or an older
// epoch (not there yet; a mid flag keeps the epoch of the last two-shot call,
// however long ago). "Reached" is flag - e in {0, 1} modulo 2^32: wrap-safe, and
// a stale flag of any age reads as not arrived (a signed "flag - e >= 0" would
// accept a mid flag 2^31 epochs old: ~36 minutes of 1 us one-shot calls).
#if defined(__CUDACC__)
__host__ __device__
#endif
inline bool epoch_reached(uint32_t flag, uint32_t epoch) {
  return uint32_t(flag - epoch) <= 1u;
}

// Two-shot ownership. Chunk c (a fixed number of elements, chosen by the
// backend) is handled by block c % nblocks on every rank, and reduced by rank
// (c / nblocks) % W. Both depend only on c, so the per-block argument above
// holds across calls of different sizes and algorithms.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline int64_t chunk_owner_rank(int64_t chunk, int nblocks, int world_size) {
  return (chunk / nblocks) % world_size;
}

}  // namespace pyallreduce
