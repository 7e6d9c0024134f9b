// One-shot and two-shot all-reduce kernels over CUDA IPC memory, and the
// reduce-scatter and all-gather kernels (protocol in csrc/common/protocol.h,
// explained in docs/architecture.md). Templated on the element type and the
// world size so every per-peer loop is unrolled and all W loads of a vector are
// in flight together. csrc/cuda/kernels.cu instantiates them behind
// kernel_api.h, which also holds what the host side shares with them (the
// call, the status record, the graph entry); the glue (csrc/cuda/glue.cpp)
// only picks the source mode and calls that API.
//
// Work split. A chunk is kThreads x 16 bytes (8 KiB), the same for every dtype:
// thread t of a block handles the 16-byte vector t of each of its chunks.
// Chunk c belongs to block (c / W) % gridDim.x on every rank and is reduced in
// two-shot by rank c % W (protocol.h chunk_block, chunk_owner_rank); W and
// gridDim.x are the communicator's fixed world size and nblocks, so block b of
// every rank touches the same bytes in every call and algorithm: that is what
// lets per-block flags (no grid-wide barrier) and double buffering (no end
// barrier) work.
//
// Summation is in fp32, always in rank order 0..W-1, with no FMA (only adds;
// the build also passes -fmad=false), and "avg" is a true IEEE division by W:
// every rank, and the CPU and Triton backends, produce the same bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../common/protocol.h"
#include "device_ops.h"
#include "kernel_api.h"

namespace pyallreduce {
namespace cuda {

// What the kernels receive, by value (kernel parameter space, so a CUDA graph
// captures it as is). Buffers are given for an even epoch plus the shift an
// odd epoch adds (max_bytes for staging buffers, 0 for registered ones): the
// kernels then address every peer as a parameter-bank base + one register,
// instead of holding W 64-bit pointers chosen at run time in registers.
struct KernelArgs {
  char* regions[kMaxRanks];        // flags, epochs
  const char* sources[kMaxRanks];  // the W buffers reduced from
  char* reduced[kMaxRanks];        // two-shot: where rank q leaves its reduced chunks
  int64_t sources_odd_shift;
  int64_t reduced_odd_shift;
  const char* input;
  char* out;
  int64_t bytes;
  int64_t segment_stride;          // reduce-scatter: protocol.h segment_stride(bytes)
  int64_t timeout_ns;
  const GraphEntry* graph_entry;  // nullptr: the buffers above are final
  CallStatus* status;
  uint32_t* claim;
  uint32_t* gave_up;
  uint64_t desc_bytes;
  int64_t call_number;
  int rank;
  int mode;
  int algo;                        // what runs: kOneShot, kTwoShot, kReduceScatter, kAllGather or kAgreeOnly
  int desc_algo;                   // the descriptor's algo: algo, or the one an agreement round stands for
  uint32_t dtype;
  bool average;
  bool in_place;
};

// ---- protocol layout in device code ----------------------------------------
// protocol.h's flag_index/staging_offset are host-only constexpr functions
// (calling them from device code needs --expt-relaxed-constexpr); these are the
// same formulas, and the static_asserts keep the two from drifting apart.

__host__ __device__ constexpr int64_t device_flag_index(int block, int rank) {
  return int64_t(block) * kMaxRanks + rank;
}
__host__ __device__ constexpr int64_t device_staging_offset(uint32_t epoch, int64_t max_bytes) {
  return kDataOffset + int64_t(epoch & 1u) * max_bytes;
}
static_assert(device_flag_index(5, 3) == flag_index(5, 3), "flag layout drifted from protocol.h");
static_assert(device_staging_offset(7, 1 << 20) == staging_offset(7, 1 << 20) &&
                  device_staging_offset(8, 1 << 20) == staging_offset(8, 1 << 20),
              "staging layout drifted from protocol.h");
__host__ __device__ constexpr int64_t device_desc_offset(uint32_t epoch, int block, int rank) {
  return kDescOffset + ((int64_t(epoch & 1u) * kMaxBlocks + block) * kMaxRanks + rank) * kDescBytes;
}
static_assert(device_desc_offset(7, 5, 3) == desc_offset(7, 5, 3) &&
                  device_desc_offset(8, 5, 3) == desc_offset(8, 5, 3),
              "descriptor layout drifted from protocol.h");
static_assert(kDataOffset % kVecBytes == 0 && kAlignment % kVecBytes == 0,
              "staging buffers must keep 16-byte vectors aligned");
static_assert(kDescOffset % kVecBytes == 0 && kDescBytes == kVecBytes,
              "a descriptor must be one aligned 16-byte vector");
static_assert(kSegmentUnit % kChunkBytes == 0,
              "a staging chunk must lie inside one reduce-scatter segment");


__device__ __forceinline__ uint32_t* flag_ptr(char* region, int64_t array_offset, int block,
                                              int rank) {
  return reinterpret_cast<uint32_t*>(region + array_offset) + device_flag_index(block, rank);
}

// ---- per-block epoch -----------------------------------------------------------

// e = ++epoch[block] in this rank's own region, read and written by thread 0
// only and broadcast through shared memory. The counter lives in device memory
// so a replayed CUDA graph keeps counting. Calls that run a second barrier on
// start_flags (the zero-copy end barrier) consume two epochs: that barrier
// waits for e + 1, so it can never be satisfied by the start barrier's e.
// Consecutive launches on one stream are ordered, so plain accesses suffice.
// Returns false, advancing nothing, once a wait of the communicator gave up
// (Call::gave_up): the kernel must then return at once.
__device__ __forceinline__ bool advance_epoch(const KernelArgs& a, char* own_region, uint32_t epochs_used,
                                              uint32_t& e) {
  __shared__ uint32_t shared_epoch;
  __shared__ bool shared_go;
  if (threadIdx.x == 0) {
    shared_go = load_relaxed_gpu(a.gave_up) == 0;
    uint32_t* counter = reinterpret_cast<uint32_t*>(own_region + kEpochOffset) + blockIdx.x;
    const uint32_t next = *counter + 1;
    if (shared_go) *counter = next + epochs_used - 1;
    shared_epoch = next;
  }
  __syncthreads();
  e = shared_epoch;
  return shared_go;
}

// arr[i] for a runtime i < W without indexing a local array (which would
// spill the array to local memory): W predicated selects.
template <int W, typename P>
__device__ __forceinline__ P select_rank(const P* arr, int i) {
  P r = arr[0];
#pragma unroll
  for (int q = 1; q < W; ++q) r = (q == i) ? arr[q] : r;
  return r;
}

// ---- barrier ----------------------------------------------------------------

// What the block's waiting threads saw at the last barrier, for every thread.
struct BarrierView {
  uint32_t late[kMaxRanks];     // 1: rank q never arrived before the deadline
  CallDesc seen[kMaxRanks];     // start barrier: rank q's descriptor of this call
};

// Fills in the communicator's status record unless another block already did
// (thread 0 only). Plain stores, then code with release at system scope.
template <int W>
__device__ __forceinline__ void record_failure(const KernelArgs& a, uint32_t code, uint32_t barrier_id,
                                               uint32_t e, uint32_t missing, const BarrierView& view) {
  CallStatus* st = a.status;
  if (threadIdx.x != 0) return;
  const bool gave_up = code != kStatusMismatch;
  if (gave_up) store_relaxed_gpu(a.gave_up, 1u);  // later kernels do nothing (advance_epoch)
  const uint32_t generation = st->generation;
  if (!claim_record(a.claim, gave_up ? generation | kClaimSevere : generation)) return;
  // A wait that gave up because of an abort (or passed its deadline after one) says so.
  if (code == kStatusDeadline && load_acquire_sys(&st->aborted) != 0) code = kStatusAborted;
  st->barrier = barrier_id;
  st->block = blockIdx.x;
  st->epoch = e;
  st->missing = missing;
  st->call = a.call_number;
#pragma unroll
  for (int q = 0; q < W; ++q) st->descs[q] = view.seen[q];
  store_release_sys(&st->code, code);
}

// Counts a mismatched call in the status record (kernel_api.h CallStatus).
__device__ __forceinline__ void count_mismatch(const KernelArgs& a) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  a.status->mismatches += 1;
  a.status->last_mismatch_call = a.call_number;
}

// Block b meets block b of every peer on one flag array at epoch e: thread q
// (q < W) tells rank q "I am at e" and waits until rank q told us the same.
// The start barrier (`mine` set) also publishes this call's descriptor to rank
// q and reads rank q's, and, in a call without a mid barrier (`with_mid`),
// stores e into rank q's mid flag (the wrap fix: protocol.h).
//
// Ordering: the data this block wrote before the barrier (copy-in, two-shot
// reduced chunks) is written by all 512 threads, the release only by threads
// < W. No __threadfence_system() is needed: __syncthreads() (bar.sync)
// synchronizes the block's threads at CTA scope, so those stores precede the
// release in the PTX memory model's causality order, and a release is
// cumulative: a peer whose acquire load reads our flag sees everything that
// precedes the release, from any thread of the block. The mirror image holds
// after the wait: thread q's acquire, then bar.sync, then every thread's loads
// of peer data. (vLLM's custom all-reduce and PyTorch's SymmetricMemory rely
// on the same syncthreads + release/acquire pattern.) The descriptor is a
// plain store before the release and a plain load after the acquire, by the
// same thread q.
//
// Deadline: every wait reads %globaltimer; past timeout_ns the thread gives up
// on rank q. With `may_abort` it also gives up once the host has aborted the
// communicator (CallStatus::aborted, read every kAbortLookNs of a wait):
// wherever no peer can go on reading memory the caller gets back. That is the
// start barrier (a peer that passes it and reads our buffer in place needs us
// again at a mid or end barrier we never reach, and raises there), and a later barrier of a
// staged call (peers read only our region, which stays allocated and which
// nothing rewrites: a kernel queued behind this one does nothing,
// Call::gave_up). Not a later barrier of the zero-copy
// modes: a peer still reading our registered buffer in place would go on
// reading it after the caller got it back (two-shot's mid barrier is the last
// one there), and finish with whatever the caller wrote, without an error.
// Returns the ranks that never arrived (bit q), the same value in every thread
// of the block; 0 when all did.
template <int W>
__device__ __forceinline__ uint32_t barrier(const KernelArgs& a, char* own_region, int64_t array_offset,
                                            uint32_t e, const CallDesc* mine, bool with_mid, bool may_abort,
                                            BarrierView& view) {
  __syncthreads();
  if (threadIdx.x < W) {
    const int q = threadIdx.x;
    // select_rank, not a.regions[q]: a runtime index would put the arguments
    // in local memory in the graph-entry kernels (with_graph_entry copies them).
    char* const peer = select_rank<W>(a.regions, q);
    if (mine != nullptr) {
      *reinterpret_cast<CallDesc*>(peer + device_desc_offset(e, blockIdx.x, a.rank)) = *mine;
    }
    if (with_mid) store_release_sys(flag_ptr(peer, kMidFlagsOffset, blockIdx.x, a.rank), e);
    store_release_sys(flag_ptr(peer, array_offset, blockIdx.x, a.rank), e);
    const uint32_t* own = flag_ptr(own_region, array_offset, blockIdx.x, q);
    uint64_t started = 0;
    uint64_t next_abort_look = 0;
    uint32_t late = 0;
    while (!epoch_reached(load_acquire_sys(own), e)) {
      const uint64_t now = global_timer_ns();
      if (started == 0) {
        started = now;  // the clock is read only once the flag was not already there
        next_abort_look = now + uint64_t(kAbortLookNs);
      } else if (now - started > uint64_t(a.timeout_ns)) {
        late = 1;
        break;
      } else if (may_abort && now >= next_abort_look) {  // a slow wait: has the host aborted the communicator?
        next_abort_look = now + uint64_t(kAbortLookNs);
        if (load_acquire_sys(&a.status->aborted) != 0) {
          late = 1;
          break;
        }
      }
    }
    view.late[q] = late;
    if (mine != nullptr && late == 0) {
      view.seen[q] = *reinterpret_cast<const CallDesc*>(own_region + device_desc_offset(e, blockIdx.x, q));
    }
  }
  __syncthreads();
  uint32_t missing = 0;
#pragma unroll
  for (int q = 0; q < W; ++q) missing |= view.late[q] << q;
  return missing;
}

// The start barrier and the agreement check, before any peer data is read.
// Returns true when the call may go on. Otherwise the status record says why,
// and on a mismatch this block has put itself back in step with its peers
// (protocol.h): its epoch counter back to e (a two-epoch kind had reserved
// e + 1) and its mid flags at e, so every rank continues from e + 1.
template <int W>
__device__ __forceinline__ bool start_call(const KernelArgs& a, char* own_region, uint32_t e,
                                           uint32_t kind, bool with_mid) {
  __shared__ BarrierView view;
  const CallDesc mine{a.desc_bytes, e, kind};
  uint32_t missing = barrier<W>(a, own_region, kStartFlagsOffset, e, &mine, with_mid, true, view);
  if (missing != 0) {
    record_failure<W>(a, kStatusDeadline, kBarrierStart, e, missing, view);
    return false;
  }
  bool agree = true;
#pragma unroll
  for (int q = 0; q < W; ++q) agree = agree && same_call(view.seen[q], mine);
  if (agree) return true;
  if (threadIdx.x == 0) reinterpret_cast<uint32_t*>(own_region + kEpochOffset)[blockIdx.x] = e;
  if (threadIdx.x < W && !with_mid) {
    store_release_sys(flag_ptr(select_rank<W>(a.regions, threadIdx.x), kMidFlagsOffset, blockIdx.x, a.rank), e);
  }
  record_failure<W>(a, kStatusMismatch, kBarrierStart, e, 0, view);
  count_mismatch(a);
  return false;
}

// A later barrier of the call (mid, end); false after recording a deadline.
template <int W>
__device__ __forceinline__ bool meet(const KernelArgs& a, char* own_region, int64_t array_offset,
                                     uint32_t e, uint32_t barrier_id) {
  __shared__ BarrierView view;
  const uint32_t missing = barrier<W>(a, own_region, array_offset, e, nullptr, false, a.mode == kStaged, view);
  if (missing != 0) record_failure<W>(a, kStatusDeadline, barrier_id, e, missing, view);
  return missing == 0;
}

// ---- element conversions --------------------------------------------------------

// Raw bits of one element and its exact conversion to fp32 and back with
// round-to-nearest-even (the same cvt instructions torch and Triton use). The
// unsigned integers all-gather copies as (launch_all_gather) are their own
// bits and have no conversion.
template <typename T>
struct Elem {
  using Bits = T;
};
template <>
struct Elem<float> {
  using Bits = uint32_t;
  static __device__ __forceinline__ float to_float(Bits b) { return __uint_as_float(b); }
  static __device__ __forceinline__ Bits from_float(float f) { return __float_as_uint(f); }
};
template <>
struct Elem<__half> {
  using Bits = uint16_t;
  static __device__ __forceinline__ float to_float(Bits b) { return __half2float(__ushort_as_half(b)); }
  static __device__ __forceinline__ Bits from_float(float f) {
    return __half_as_ushort(__float2half_rn(f));
  }
};
template <>
struct Elem<__nv_bfloat16> {
  using Bits = uint16_t;
  static __device__ __forceinline__ float to_float(Bits b) { return __uint_as_float(uint32_t(b) << 16); }
  static __device__ __forceinline__ Bits from_float(float f) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  }
};

// One 16-byte vector, viewed as raw elements.
template <typename T>
union Vec {
  using Bits = typename Elem<T>::Bits;
  static constexpr int kElems = kVecBytes / sizeof(Bits);
  int4 v;
  Bits e[kElems];
};

// The elements of the 16 bytes at p of which the first `valid` (> 0) belong
// to the payload, one by one: p need only be element-aligned, and nothing past
// the payload is touched.
template <typename T>
__device__ __forceinline__ Vec<T> load_elems(const char* p, int64_t valid) {
  Vec<T> r;
  r.v = make_int4(0, 0, 0, 0);
  const auto* src = reinterpret_cast<const typename Vec<T>::Bits*>(p);
#pragma unroll
  for (int i = 0; i < Vec<T>::kElems; ++i) {
    if (int64_t(i) * int64_t(sizeof(src[0])) < valid) r.e[i] = src[i];
  }
  return r;
}
template <typename T>
__device__ __forceinline__ void store_elems(char* p, const Vec<T>& x, int64_t valid) {
  auto* dst = reinterpret_cast<typename Vec<T>::Bits*>(p);
#pragma unroll
  for (int i = 0; i < Vec<T>::kElems; ++i) {
    if (int64_t(i) * int64_t(sizeof(dst[0])) < valid) dst[i] = x.e[i];
  }
}

// Loads the 16-byte aligned vector at p, of which only `valid` bytes (> 0)
// belong to the payload: the last vector of a call whose size is not a
// multiple of 16 is read element by element, so nothing past the tensor's end
// is touched.
template <typename T>
__device__ __forceinline__ Vec<T> load_vec(const char* p, int64_t valid) {
  if (valid >= kVecBytes) {
    Vec<T> r;
    r.v = *reinterpret_cast<const int4*>(p);
    return r;
  }
  return load_elems<T>(p, valid);
}

template <typename T>
__device__ __forceinline__ void store_vec(char* p, const Vec<T>& x, int64_t valid) {
  if (valid >= kVecBytes) {
    *reinterpret_cast<int4*>(p) = x.v;
  } else {
    store_elems<T>(p, x, valid);
  }
}

// load_vec/store_vec at an address that may be only element-aligned: the
// caller's side of reduce-scatter and all-gather, whose segment q starts at
// q * S (S % 16 may be nonzero) of a tensor that may be a view at any element
// offset. All-reduce's kernels get aligned tensors instead (call_plan.h's
// temporaries), which cannot help here: the segments themselves are misaligned.
template <typename T>
__device__ __forceinline__ Vec<T> load_piece(const char* p, int64_t valid) {
  return vec_aligned(reinterpret_cast<uintptr_t>(p)) ? load_vec<T>(p, valid) : load_elems<T>(p, valid);
}
template <typename T>
__device__ __forceinline__ void store_piece(char* p, const Vec<T>& x, int64_t valid) {
  if (vec_aligned(reinterpret_cast<uintptr_t>(p))) {
    store_vec<T>(p, x, valid);
  } else {
    store_elems<T>(p, x, valid);
  }
}

// cast(sum over q = 0..W-1 of float(src[q][off..off+16))) (/ W). All W loads
// are issued before the first add so they are in flight together.
template <typename T, int W>
__device__ __forceinline__ Vec<T> reduce_vec(const char* const (&src)[W], int64_t off,
                                             int64_t valid, bool average) {
  Vec<T> in[W];
#pragma unroll
  for (int q = 0; q < W; ++q) in[q] = load_vec<T>(src[q] + off, valid);
  float acc[Vec<T>::kElems];
#pragma unroll
  for (int i = 0; i < Vec<T>::kElems; ++i) acc[i] = Elem<T>::to_float(in[0].e[i]);
#pragma unroll
  for (int q = 1; q < W; ++q) {
#pragma unroll
    for (int i = 0; i < Vec<T>::kElems; ++i) acc[i] += Elem<T>::to_float(in[q].e[i]);
  }
  Vec<T> r;
#pragma unroll
  for (int i = 0; i < Vec<T>::kElems; ++i) {
    // __fdiv_rn: IEEE division whatever the division flags; a reciprocal
    // multiply would differ from the other backends in the last bit.
    r.e[i] = Elem<T>::from_float(average ? __fdiv_rn(acc[i], float(W)) : acc[i]);
  }
  return r;
}

// Byte offset of this thread's vector in chunk c.
__device__ __forceinline__ int64_t vec_offset(int64_t chunk) {
  return chunk * kChunkBytes + int64_t(threadIdx.x) * kVecBytes;
}

// This block's rounds in [0, bytes), and the byte offset of this thread's
// vector in round k (the block's k-th chunk).
template <int W>
__device__ __forceinline__ int64_t this_block_rounds(int64_t bytes) {
  return block_rounds(int(blockIdx.x), (bytes + kChunkBytes - 1) / kChunkBytes, int(gridDim.x), W);
}
template <int W>
__device__ __forceinline__ int64_t round_offset(int64_t k) {
  return vec_offset(block_chunk(int(blockIdx.x), k, int(gridDim.x), W));
}

// Copies this block's chunks of [0, bytes) to dst. The block's chunks are
// block_chunk(blockIdx.x, k) for rounds k = 0, 1, ... (owner k % W); src_of(k)
// gives the source buffer of round k (nullptr: skip it). kCopyBatch rounds are
// loaded before any is stored, so each thread keeps several 16-byte loads in
// flight.
template <typename T, int W, typename SrcOf>
__device__ __forceinline__ void copy_block_chunks(char* dst, int64_t bytes, SrcOf src_of) {
  const int rounds = int(this_block_rounds<W>(bytes));
  for (int k = 0; k < rounds; k += kCopyBatch) {
    Vec<T> v[kCopyBatch];
    const char* src[kCopyBatch];
#pragma unroll
    for (int i = 0; i < kCopyBatch; ++i) {
      const int64_t off = round_offset<W>(k + i);
      src[i] = (k + i < rounds && off < bytes) ? src_of(k + i) : nullptr;
      if (src[i] != nullptr) v[i] = load_vec<T>(src[i] + off, bytes - off);
    }
#pragma unroll
    for (int i = 0; i < kCopyBatch; ++i) {
      const int64_t off = round_offset<W>(k + i);
      if (src[i] != nullptr) store_vec<T>(dst + off, v[i], bytes - off);
    }
  }
}

// Reduces the vector at byte `off` of every source into out (and into
// also_to, the two-shot owner's reduced buffer, unless it is out itself).
template <typename T, int W>
__device__ __forceinline__ void reduce_at(const KernelArgs& a, int64_t shift, int64_t off,
                                          char* also_to) {
  const int64_t valid = a.bytes - off;
  const char* src[W];
#pragma unroll
  for (int q = 0; q < W; ++q) src[q] = a.sources[q] + shift;
  const Vec<T> r = reduce_vec<T, W>(src, off, valid, a.average);
  store_vec<T>(a.out + off, r, valid);
  if (also_to != nullptr && also_to != a.out) store_vec<T>(also_to + off, r, valid);
}

// ---- kernels ------------------------------------------------------------------

// This call's descriptor kind; the mode is the one that runs (a graph entry's).
__device__ __forceinline__ uint32_t call_kind(const KernelArgs& a) {
  return desc_kind(a.dtype, uint32_t(a.desc_algo), uint32_t(a.mode), a.average, a.in_place);
}

// One-shot: copy in, start barrier, every rank reduces every element from all W
// buffers. kRegistered reads the peers' inputs directly and ends with a barrier
// (on start_flags at e + 1: the layout has no third flag array, and a second
// epoch value keeps the two barriers on one array apart). With algo
// kAgreeOnly and no bytes, this is the agreement round: start barrier and
// descriptor check only.
template <typename T, int W>
__device__ __forceinline__ void one_shot(const KernelArgs& a) {
  char* const own_region = select_rank<W>(a.regions, a.rank);
  const bool staged = a.mode == kStaged;
  const uint32_t kind = call_kind(a);
  const uint32_t epochs_used = desc_epochs_used(kind);  // 2: kRegistered, with its end barrier
  uint32_t e;
  if (!advance_epoch(a, own_region, epochs_used, e)) return;
  const int64_t shift = (e & 1u) ? a.sources_odd_shift : 0;
  if (staged) {  // own staging buffer = own source
    const char* const input = a.input;
    copy_block_chunks<T, W>(const_cast<char*>(select_rank<W>(a.sources, a.rank)) + shift, a.bytes,
                         [input](int) { return input; });
  }
  if (!start_call<W>(a, own_region, e, kind, /*with_mid=*/true)) return;

  const int64_t rounds = this_block_rounds<W>(a.bytes);
  for (int64_t k = 0; k < rounds; ++k) {
    const int64_t off = round_offset<W>(k);
    if (off < a.bytes) reduce_at<T, W>(a, shift, off, nullptr);
  }
  if (epochs_used == 2) meet<W>(a, own_region, kStartFlagsOffset, e + 1, kBarrierEnd);
}

// Two-shot: copy in, start barrier, rank r reduces the chunks it owns from all
// W sources into its `reduced` buffer (its staging buffer, or in place its
// registered buffer), mid barrier, then every rank gathers the other owners'
// chunks. Each rank moves 2(W-1)/W of the payload over the links instead of
// W-1 times it.
//
// Ownership (protocol.h's chunk_owner_rank): this block's round k is reduced by
// rank k % W, so every size spreads the reduction over all ranks.
template <typename T, int W>
__device__ __forceinline__ void two_shot(const KernelArgs& a) {
  char* const own_region = select_rank<W>(a.regions, a.rank);
  const bool staged = a.mode == kStaged;
  const uint32_t kind = call_kind(a);
  const bool in_place = desc_epochs_used(kind) == 2;  // kRegisteredInPlace, with its end barrier
  uint32_t e;
  if (!advance_epoch(a, own_region, in_place ? 2 : 1, e)) return;
  const int64_t shift = (e & 1u) ? a.sources_odd_shift : 0;
  const int64_t reduced_shift = (e & 1u) ? a.reduced_odd_shift : 0;
  char* const own_reduced = select_rank<W>(a.reduced, a.rank) + reduced_shift;
  if (staged) {  // own staging buffer = own source = own reduced buffer
    const char* const input = a.input;
    copy_block_chunks<T, W>(own_reduced, a.bytes, [input](int) { return input; });
  }
  if (!start_call<W>(a, own_region, e, kind, /*with_mid=*/false)) return;

  // Reduce-scatter over rounds k = rank, rank + W, ... Only the owner touches
  // chunk c in this phase (on every rank), so writing the result over its own
  // source (in place) is safe.
  const int64_t rounds = this_block_rounds<W>(a.bytes);
  for (int64_t k = a.rank; k < rounds; k += W) {
    const int64_t off = round_offset<W>(k);
    if (off < a.bytes) reduce_at<T, W>(a, shift, off, own_reduced);
  }
  // Peers read our reduced chunks only after this.
  if (!meet<W>(a, own_region, kMidFlagsOffset, e, kBarrierMid)) return;

  // All-gather from each round's owner (own rounds are already in out).
  const int rank = a.rank;
  copy_block_chunks<T, W>(a.out, a.bytes, [&a, rank, reduced_shift](int k) -> const char* {
    const int owner = k % W;
    return owner == rank ? nullptr : select_rank<W>(a.reduced, owner) + reduced_shift;
  });
  // In place, peers read our registered buffer until they pass this barrier;
  // the caller may overwrite it as soon as we return.
  if (in_place) meet<W>(a, own_region, kStartFlagsOffset, e + 1, kBarrierEnd);
}

// ---- reduce-scatter and all-gather ----------------------------------------------
//
// protocol.h: staged only, one epoch per call, the start barrier only (which
// stores the mid flags, as one-shot's does). S = a.bytes is the per-rank
// segment. The work is split by staging chunk as for all-reduce: the block
// that copies staging chunk c in is the block that reads chunk c on every peer
// (chunk_block), whatever the collective, so the per-block flags and the double
// buffering argument hold across calls of every kind. The caller's side of a
// chunk (input or out segment q, at q * S) holds the same payload bytes at an
// address that may be only element-aligned: load_piece/store_piece.

// One thread's 16 bytes of a copy: from, to, and how many of them belong to
// the payload (<= 0: none).
struct Piece {
  const char* from = nullptr;
  char* to = nullptr;
  int64_t valid = 0;
};

// Byte offset of this thread's vector within a chunk.
__device__ __forceinline__ int64_t lane_offset() { return int64_t(threadIdx.x) * kVecBytes; }

// Calls f(c) for this block's staging chunks c in [first, end), in increasing
// order: block_chunk(b, k) from k = the number of the block's chunks below first.
template <int W, typename F>
__device__ __forceinline__ void for_block_chunks(int64_t first, int64_t end, F f) {
  const int b = int(blockIdx.x), nblocks = int(gridDim.x);
  const int64_t last = block_rounds(b, end, nblocks, W);
  for (int64_t k = block_rounds(b, first, nblocks, W); k < last; ++k) f(block_chunk(b, k, nblocks, W));
}

// Copies piece_of(c) for this block's staging chunks c in [first, end);
// kCopyBatch chunks are loaded before any is stored (as copy_block_chunks).
template <typename T, int W, typename PieceOf>
__device__ __forceinline__ void copy_pieces(int64_t first, int64_t end, PieceOf piece_of) {
  const int b = int(blockIdx.x), nblocks = int(gridDim.x);
  const int64_t last = block_rounds(b, end, nblocks, W);
  for (int64_t k = block_rounds(b, first, nblocks, W); k < last; k += kCopyBatch) {
    Piece p[kCopyBatch];
    Vec<T> v[kCopyBatch];
#pragma unroll
    for (int i = 0; i < kCopyBatch; ++i) {
      if (k + i < last) p[i] = piece_of(block_chunk(b, k + i, nblocks, W));
      if (p[i].valid > 0) v[i] = load_piece<T>(p[i].from, p[i].valid);
    }
#pragma unroll
    for (int i = 0; i < kCopyBatch; ++i) {
      if (p[i].valid > 0) store_piece<T>(p[i].to, v[i], p[i].valid);
    }
  }
}

// Reduce-scatter: copy the W input segments in (segment q at q *
// segment_stride(S) of own staging), start barrier, then out = segment `rank`
// of every rank's staging, reduced as one-shot reduces (reduce_vec: the same
// bits as one-shot's all-reduce of those bytes). out may be segment `rank` of
// the input: the block that writes out[o] copied input segment `rank`'s byte o
// in before its barrier (same staging chunk).
template <typename T, int W>
__device__ __forceinline__ void reduce_scatter(const KernelArgs& a) {
  char* const own_region = select_rank<W>(a.regions, a.rank);
  uint32_t e;
  if (!advance_epoch(a, own_region, 1, e)) return;
  const int64_t shift = (e & 1u) ? a.sources_odd_shift : 0;
  const int64_t segment = a.bytes, segment_chunks = a.segment_stride / kChunkBytes, lane = lane_offset();
  char* const own_staging = const_cast<char*>(select_rank<W>(a.sources, a.rank)) + shift;
  const char* const input = a.input;
  copy_pieces<T, W>(0, W * segment_chunks, [=](int64_t c) {
    const int64_t q = c / segment_chunks, o = (c % segment_chunks) * kChunkBytes + lane;
    return Piece{input + q * segment + o, own_staging + c * kChunkBytes + lane, segment - o};
  });
  if (!start_call<W>(a, own_region, e, call_kind(a), /*with_mid=*/true)) return;

  const char* src[W];
#pragma unroll
  for (int q = 0; q < W; ++q) src[q] = a.sources[q] + shift;
  const int64_t first = a.rank * segment_chunks;
  for_block_chunks<W>(first, first + segment_chunks, [&](int64_t c) {
    const int64_t o = (c - first) * kChunkBytes + lane;
    if (o < segment) {
      store_piece<T>(a.out + o, reduce_vec<T, W>(src, c * kChunkBytes + lane, segment - o, a.average), segment - o);
    }
  });
}

// All-gather: copy the input to own staging [0, S), start barrier, then out
// segment q = rank q's staging [0, S), all W loads of a vector in flight
// together. Word: an unsigned integer the caller's addresses are aligned to
// (launch_all_gather). The input may be segment `rank` of out: the block that
// writes out segment `rank`'s byte o copied input byte o in before its
// barrier, and writes it back unchanged.
template <typename Word, int W>
__device__ __forceinline__ void all_gather(const KernelArgs& a) {
  char* const own_region = select_rank<W>(a.regions, a.rank);
  uint32_t e;
  if (!advance_epoch(a, own_region, 1, e)) return;
  const int64_t shift = (e & 1u) ? a.sources_odd_shift : 0;
  const int64_t segment = a.bytes, nchunks = (segment + kChunkBytes - 1) / kChunkBytes, lane = lane_offset();
  char* const own_staging = const_cast<char*>(select_rank<W>(a.sources, a.rank)) + shift;
  const char* const input = a.input;
  copy_pieces<Word, W>(0, nchunks, [=](int64_t c) {
    const int64_t o = c * kChunkBytes + lane;
    return Piece{input + o, own_staging + o, segment - o};
  });
  if (!start_call<W>(a, own_region, e, call_kind(a), /*with_mid=*/true)) return;

  for_block_chunks<W>(0, nchunks, [&](int64_t c) {
    const int64_t o = c * kChunkBytes + lane;
    if (o >= segment) return;
    Vec<Word> v[W];
#pragma unroll
    for (int q = 0; q < W; ++q) v[q] = load_vec<Word>(a.sources[q] + shift + o, segment - o);
#pragma unroll
    for (int q = 0; q < W; ++q) store_piece<Word>(a.out + q * segment + o, v[q], segment - o);
  });
}

// The arguments of a call captured with a graph-table entry: the captured
// staging arguments, or, once the entry is registered, the zero-copy ones
// (as make_kernel_args would have built them). Plain loads: the host wrote the
// entry before this launch.
template <int W>
__device__ __forceinline__ KernelArgs with_graph_entry(const KernelArgs& params) {
  KernelArgs a = params;
  const GraphEntry* entry = params.graph_entry;
  const int mode = int(entry->mode);
  if (mode != kStaged) {
#pragma unroll
    for (int q = 0; q < W; ++q) a.sources[q] = entry->registered[q];
    a.sources_odd_shift = 0;
    if (mode == kRegisteredInPlace) {
#pragma unroll
      for (int q = 0; q < W; ++q) a.reduced[q] = const_cast<char*>(entry->registered[q]);
      a.reduced_odd_shift = 0;
    }
    a.mode = mode;
  }
  return a;
}

// Kernels with kGraphEntry = false take every buffer from the parameter bank
// (eager calls, and captures of buffers registered beforehand); the graph-table
// variant only adds the entry load in front, so eager calls pay nothing for it.
template <typename T, int W, bool kGraphEntry>
__global__ void __launch_bounds__(kThreads, 1) one_shot_kernel(const KernelArgs params) {
  if constexpr (kGraphEntry) {
    one_shot<T, W>(with_graph_entry<W>(params));
  } else {
    one_shot<T, W>(params);
  }
}

template <typename T, int W, bool kGraphEntry>
__global__ void __launch_bounds__(kThreads, 1) two_shot_kernel(const KernelArgs params) {
  if constexpr (kGraphEntry) {
    two_shot<T, W>(with_graph_entry<W>(params));
  } else {
    two_shot<T, W>(params);
  }
}

// Always staged: no graph-entry variant.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads, 1) reduce_scatter_kernel(const KernelArgs params) {
  reduce_scatter<T, W>(params);
}

template <typename Word, int W>
__global__ void __launch_bounds__(kThreads, 1) all_gather_kernel(const KernelArgs params) {
  all_gather<Word, W>(params);
}

// ---- launch ---------------------------------------------------------------------

// The algorithm that runs: in-place zero-copy exists only in the two-shot
// structure (one-shot would overwrite its input while peers still read it),
// so such a call runs two-shot whatever was asked (and an in-place call gets
// a graph entry only when it runs two-shot: see plan_call in csrc/cuda/call_plan.h).
inline int64_t kernel_algo(int64_t algo, Mode mode) {
  return algo == kOneShot && mode == kRegisteredInPlace ? kTwoShot : algo;
}

inline KernelArgs make_kernel_args(const Call& call) {
  KernelArgs a{};
  const int64_t even = device_staging_offset(0, call.max_bytes);
  const int64_t odd_shift = device_staging_offset(1, call.max_bytes) - even;
  const bool staged = call.mode == kStaged;
  for (int q = 0; q < kMaxRanks; ++q) {
    a.regions[q] = call.regions[q];
    char* staging = call.regions[q] == nullptr ? nullptr : call.regions[q] + even;
    a.sources[q] = staged ? staging : call.registered[q];
    a.reduced[q] = call.mode == kRegisteredInPlace ? call.registered[q] : staging;
  }
  a.sources_odd_shift = staged ? odd_shift : 0;
  a.reduced_odd_shift = call.mode == kRegisteredInPlace ? 0 : odd_shift;
  a.input = call.input;
  a.out = call.out;
  a.bytes = call.bytes;
  a.segment_stride = segment_stride(call.bytes);
  a.timeout_ns = call.timeout_ns;
  a.graph_entry = call.graph_entry;
  a.status = call.status;
  a.claim = call.claim;
  a.gave_up = call.gave_up;
  a.desc_bytes = call.desc_bytes;
  a.call_number = call.call_number;
  a.rank = call.rank;
  a.mode = call.mode;
  a.algo = int(kernel_algo(call.algo, call.mode));
  a.desc_algo = call.algo == kAgreeOnly ? int(call.agree_algo) : a.algo;
  a.dtype = call.dtype;
  a.average = call.average;
  a.in_place = call.in_place;
  return a;
}

// The agreement round (kAgreeOnly) runs the one-shot kernel with no bytes.
template <typename T, int W, bool kGraphEntry>
inline void launch_kernel(const KernelArgs& a, int nblocks, cudaStream_t stream) {
  if (a.algo != kTwoShot) {
    launch(one_shot_kernel<T, W, kGraphEntry>, nblocks, kThreads, stream, a);
  } else {
    launch(two_shot_kernel<T, W, kGraphEntry>, nblocks, kThreads, stream, a);
  }
}

template <typename T, int W>
inline void launch_for_world(const KernelArgs& a, int nblocks, cudaStream_t stream) {
  if (a.graph_entry != nullptr) {
    launch_kernel<T, W, true>(a, nblocks, stream);
  } else {
    launch_kernel<T, W, false>(a, nblocks, stream);
  }
}

// The world sizes that get kernels: 1..kMaxRanks. The host-shim harness's
// sanitizer builds lower it to the worlds their suites run (tests/sim/build.py),
// which halves their compile time; the product build never sets it.
#ifndef PYALLREDUCE_KERNEL_WORLDS
#define PYALLREDUCE_KERNEL_WORLDS kMaxRanks
#endif

template <int W, typename F>
inline bool with_world(F& f) {
  if constexpr (W <= PYALLREDUCE_KERNEL_WORLDS) {
    f(std::integral_constant<int, W>());
    return true;
  }
  return false;
}

// The one world-size switch: f(std::integral_constant<int, W>()); returns
// false for a world size without kernels (outside 1..kMaxRanks).
template <typename F>
inline bool with_world_size(int world_size, F f) {
  static_assert(kMaxRanks == 8, "extend the switch below");
  switch (world_size) {
    case 1: return with_world<1>(f);
    case 2: return with_world<2>(f);
    case 3: return with_world<3>(f);
    case 4: return with_world<4>(f);
    case 5: return with_world<5>(f);
    case 6: return with_world<6>(f);
    case 7: return with_world<7>(f);
    case 8: return with_world<8>(f);
    default: return false;
  }
}

// One-shot, two-shot and the agreement round (kAgreeOnly).
template <typename T>
inline bool launch_all_reduce(int world_size, const Call& call, int nblocks, cudaStream_t stream) {
  const KernelArgs a = make_kernel_args(call);
  return with_world_size(world_size, [&](auto w) { launch_for_world<T, decltype(w)::value>(a, nblocks, stream); });
}

// Reduce-scatter of a float32, float16 or bfloat16 tensor (call.bytes = S,
// mode kStaged).
template <typename T>
inline bool launch_reduce_scatter(int world_size, const Call& call, int nblocks, cudaStream_t stream) {
  const KernelArgs a = make_kernel_args(call);
  return with_world_size(world_size, [&](auto w) {
    launch(reduce_scatter_kernel<T, decltype(w)::value>, nblocks, kThreads, stream, a);
  });
}

// All-gather copies bytes, whatever the dtype: the kernel's word is the widest
// of 1, 2, 4, 8 bytes that divides S and the input and out addresses, so every
// access to segment q of out (at q * S) is aligned to it. Any dtype's tensors
// are aligned to its element size, so the word is never narrower than that.
inline int all_gather_word_bytes(const Call& call) {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(call.input) | reinterpret_cast<uintptr_t>(call.out) |
                         uintptr_t(call.bytes) | uintptr_t(8);
  return int(bits & (~bits + 1));  // the lowest set bit
}

template <typename Word>
inline bool launch_all_gather_words(int world_size, const KernelArgs& a, int nblocks, cudaStream_t stream) {
  return with_world_size(world_size, [&](auto w) {
    launch(all_gather_kernel<Word, decltype(w)::value>, nblocks, kThreads, stream, a);
  });
}

// All-gather (call.bytes = S, mode kStaged).
inline bool launch_all_gather(int world_size, const Call& call, int nblocks, cudaStream_t stream) {
  const KernelArgs a = make_kernel_args(call);
  switch (all_gather_word_bytes(call)) {
    case 1: return launch_all_gather_words<uint8_t>(world_size, a, nblocks, stream);
    case 2: return launch_all_gather_words<uint16_t>(world_size, a, nblocks, stream);
    case 4: return launch_all_gather_words<uint32_t>(world_size, a, nblocks, stream);
    default: return launch_all_gather_words<uint64_t>(world_size, a, nblocks, stream);
  }
}

}  // namespace cuda
}  // namespace pyallreduce
