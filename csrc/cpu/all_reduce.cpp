// One-shot and two-shot all-reduce over host shared memory (protocol in
// csrc/common/protocol.h). One "block" per rank: the rank's thread runs the
// barriers, and at::parallel_for spreads the copies and sums over the intra-op
// threads between them (one thread with OMP_NUM_THREADS=1).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sched.h>
#include <signal.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "../common/op_args.h"
#include "../common/protocol.h"

namespace pyallreduce {
namespace {

constexpr int kBlock = 0;                  // the host backend runs one block per rank
constexpr int64_t kSliceAlignBytes = 64;   // two-shot slice boundaries: one writer per cache line
constexpr int64_t kTileElems = 512;        // fp32 accumulator tile, stays in L1
constexpr int64_t kParallelGrainBytes = 256 << 10;
constexpr int64_t kRoundBytes = 256 << 10;  // see host_all_reduce; a multiple of every element size
// Then yield: with more ranks than cores the rank we wait for needs our core.
// ~5 us of pause on recent x86; a yield with nothing else to run costs ~0.3 us.
constexpr int kSpinsBeforeYield = 128;
constexpr int kSpinsPerClockCheck = 256;

uint32_t* flags(char* region, int64_t offset) {
  return reinterpret_cast<uint32_t*>(region + offset);
}

constexpr auto kLivenessCheckPeriod = std::chrono::milliseconds(100);

// A peer process that exited, or was killed and not yet reaped by its parent
// (a zombie still answers kill(pid, 0)), will never arrive.
bool rank_process_gone(int64_t pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const auto paren = line.rfind(')');  // the command name may hold spaces and parentheses
  return paren != std::string::npos && paren + 2 < line.size() &&
         (line[paren + 2] == 'Z' || line[paren + 2] == 'X');
}

// Barrier on one flag array (start or mid): tell every peer we reached epoch e,
// then wait until every peer told us the same. Raises with the missing ranks
// when the deadline passes or a peer's process is gone.
void barrier(const Context& ctx, int64_t flags_offset, uint32_t e, const char* where) {
  for (int q = 0; q < ctx.world_size; ++q) {
    __atomic_store_n(flags(ctx.regions[q], flags_offset) + flag_index(kBlock, ctx.rank), e,
                     __ATOMIC_RELEASE);
  }
  uint32_t* own = flags(ctx.own_region(), flags_offset);
  auto arrived = [&](int q) {
    return epoch_reached(__atomic_load_n(own + flag_index(kBlock, q), __ATOMIC_ACQUIRE), e);
  };
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::nanoseconds(ctx.timeout_ns);
  auto next_liveness_check = start + kLivenessCheckPeriod;
  for (int q = 0; q < ctx.world_size; ++q) {
    for (int64_t spins = 1; !arrived(q); ++spins) {
      if (spins < kSpinsBeforeYield) {
        _mm_pause();
      } else {
        sched_yield();
      }
      if (spins % kSpinsPerClockCheck != 0) continue;
      const auto now = std::chrono::steady_clock::now();
      bool dead = false;
      if (now >= next_liveness_check && !ctx.pids.empty()) {
        dead = rank_process_gone(ctx.pids[q]);
        next_liveness_check = now + kLivenessCheckPeriod;
      }
      if (!dead && now < deadline) continue;
      std::ostringstream missing;
      for (int p = 0; p < ctx.world_size; ++p) {
        if (!arrived(p)) missing << " " << p;
      }
      double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      TORCH_CHECK(false, "pyallreduce: rank ", ctx.rank, " waited ", waited, " s in the ", where,
                  " barrier of call ", e, "; rank(s)", missing.str(), " never arrived",
                  dead ? " (rank " + std::to_string(q) + "'s process has exited)" : std::string(),
                  ". Every rank must make the same collective calls in the same order.");
    }
  }
}

// dst[i] = cast(sum over q in order 0..W-1 of float(src[q][i])) (/ W), i in [0, n),
// also stored to dst2 unless it is null. Fixed order and fp32 accumulation make
// every rank's bits identical. The loops are plain so the compiler vectorises
// them; always_inline puts them inside each target clone below (AVX-512, AVX2,
// SSE2) instead of one out-of-line SSE2 copy.
template <typename T>
[[gnu::always_inline]] inline void reduce_tiles(const T* const* src, int world, T* dst, T* dst2,
                                                int64_t n, bool average) {
  float acc[kTileElems];
  for (int64_t base = 0; base < n; base += kTileElems) {
    const int64_t len = std::min(kTileElems, n - base);
    const T* s0 = src[0] + base;
    for (int64_t i = 0; i < len; ++i) acc[i] = static_cast<float>(s0[i]);
    for (int q = 1; q < world; ++q) {
      const T* sq = src[q] + base;
      for (int64_t i = 0; i < len; ++i) acc[i] += static_cast<float>(sq[i]);
    }
    if (average) {
      const float w = static_cast<float>(world);
      for (int64_t i = 0; i < len; ++i) acc[i] /= w;
    }
    T* d = dst + base;
    for (int64_t i = 0; i < len; ++i) d[i] = static_cast<T>(acc[i]);
    if (dst2 != nullptr) std::memcpy(dst2 + base, d, len * sizeof(T));
  }
}

// bf16 as raw bits: float conversion by shift, round-to-nearest-even back with
// NaN kept quiet (the same rounding torch and Triton use).
struct Bf16 {
  uint16_t bits;
  explicit operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  Bf16() = default;
  explicit Bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    bits = (f != f) ? uint16_t(0x7FC0) : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
};

// Elements [begin, n) with reduce_tiles: the scalar tail of the 8-lane kernels below.
template <typename T>
[[gnu::always_inline]] inline void reduce_tail(const T* const* src, int world, T* dst, T* dst2, int64_t begin,
                                               int64_t n, bool average) {
  const T* from[kMaxRanks];
  for (int q = 0; q < world; ++q) from[q] = src[q] + begin;
  reduce_tiles(from, world, dst + begin, dst2 != nullptr ? dst2 + begin : nullptr, n - begin, average);
}

#define PYALLREDUCE_CLONES __attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default")))
PYALLREDUCE_CLONES void reduce_f32(const float* const* s, int w, float* d, float* d2, int64_t n, bool avg) {
  reduce_tiles(s, w, d, d2, n, avg);
}
#undef PYALLREDUCE_CLONES

// bf16 and fp16 without AVX2 (and F16C): plain conversions.
void reduce_bf16_generic(const Bf16* const* s, int w, Bf16* d, Bf16* d2, int64_t n, bool avg) {
  reduce_tiles(s, w, d, d2, n, avg);
}
void reduce_f16_generic(const _Float16* const* s, int w, _Float16* d, _Float16* d2, int64_t n, bool avg) {
  reduce_tiles(s, w, d, d2, n, avg);
}

// fp16 with F16C, 8 lanes at a time. GCC 12 does not vectorise _Float16
// conversions itself: it emits one scalar vcvtph2ps per element, which made
// fp16 ~20x slower per byte than fp32. Same order, fp32 adds, division and
// round-to-nearest-even as reduce_tiles, so the bits are the same.
__attribute__((target("avx2,f16c"))) void reduce_f16_f16c(const uint16_t* const* s, int w, uint16_t* d,
                                                            uint16_t* d2, int64_t n, bool avg) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256 wv = _mm256_set1_ps(static_cast<float>(w));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 acc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s[0] + i)));
    for (int q = 1; q < w; ++q) {
      acc = _mm256_add_ps(acc, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s[q] + i))));
    }
    if (avg) acc = _mm256_div_ps(acc, wv);
    const __m128i h = _mm256_cvtps_ph(acc, kRound);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), h);
    if (d2 != nullptr) _mm_storeu_si128(reinterpret_cast<__m128i*>(d2 + i), h);
  }
  if (i < n) reduce_tail(reinterpret_cast<const _Float16* const*>(s), w, reinterpret_cast<_Float16*>(d),
                        reinterpret_cast<_Float16*>(d2), i, n, avg);
}

// bf16 with AVX2, 8 lanes at a time: what the compiler made of Bf16's
// conversions ran at under half of fp32's speed per byte. Bit for bit the same
// as Bf16: widen by a 16-bit shift; narrow with round-to-nearest-even, NaN -> 0x7FC0.
__attribute__((target("avx2"))) inline __m256 widen_bf16(const uint16_t* p) {
  const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
}

__attribute__((target("avx2"))) void reduce_bf16_avx2(const uint16_t* const* s, int w, uint16_t* d,
                                                       uint16_t* d2, int64_t n, bool avg) {
  const __m256 wv = _mm256_set1_ps(static_cast<float>(w));
  const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
  const __m256i quiet_nan = _mm256_set1_epi32(0x7FC0);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 acc = widen_bf16(s[0] + i);
    for (int q = 1; q < w; ++q) acc = _mm256_add_ps(acc, widen_bf16(s[q] + i));
    if (avg) acc = _mm256_div_ps(acc, wv);
    const __m256i u = _mm256_castps_si256(acc);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, bias), lsb), 16);
    r = _mm256_blendv_epi8(r, quiet_nan, _mm256_castps_si256(_mm256_cmp_ps(acc, acc, _CMP_UNORD_Q)));
    // 32 -> 16 bits: values are <= 0xFFFF, so the saturating pack is exact; it
    // packs within 128-bit lanes, and the permute brings lanes 0..7 together.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0b1000);
    const __m128i h = _mm256_castsi256_si128(packed);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), h);
    if (d2 != nullptr) _mm_storeu_si128(reinterpret_cast<__m128i*>(d2 + i), h);
  }
  if (i < n) reduce_tail(reinterpret_cast<const Bf16* const*>(s), w, reinterpret_cast<Bf16*>(d),
                        reinterpret_cast<Bf16*>(d2), i, n, avg);
}

void reduce_bf16(const char* const* s, int w, char* d, char* d2, int64_t n, bool avg) {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) {
    reduce_bf16_avx2(reinterpret_cast<const uint16_t* const*>(s), w, reinterpret_cast<uint16_t*>(d),
                     reinterpret_cast<uint16_t*>(d2), n, avg);
  } else {
    reduce_bf16_generic(reinterpret_cast<const Bf16* const*>(s), w, reinterpret_cast<Bf16*>(d),
                        reinterpret_cast<Bf16*>(d2), n, avg);
  }
}

void reduce_f16(const char* const* s, int w, char* d, char* d2, int64_t n, bool avg) {
  static const bool f16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  if (f16c) {
    reduce_f16_f16c(reinterpret_cast<const uint16_t* const*>(s), w, reinterpret_cast<uint16_t*>(d),
                    reinterpret_cast<uint16_t*>(d2), n, avg);
  } else {
    reduce_f16_generic(reinterpret_cast<const _Float16* const*>(s), w, reinterpret_cast<_Float16*>(d),
                       reinterpret_cast<_Float16*>(d2), n, avg);
  }
}

// Reduces bytes [begin, end) of every rank's staging buffer into dst + begin
// (and dst2 + begin unless dst2 is null).
void reduce_range(at::ScalarType dtype, char* const* srcs, int world, char* dst, char* dst2,
                  int64_t begin, int64_t end, bool average) {
  const int64_t elem = at::elementSize(dtype);
  const int64_t n = (end - begin) / elem;
  const char* s[kMaxRanks];
  for (int q = 0; q < world; ++q) s[q] = srcs[q] + begin;
  dst += begin;
  if (dst2 != nullptr) dst2 += begin;
  switch (dtype) {
    case at::kFloat:
      return reduce_f32(reinterpret_cast<const float* const*>(s), world, reinterpret_cast<float*>(dst),
                        reinterpret_cast<float*>(dst2), n, average);
    case at::kHalf:
      return reduce_f16(s, world, dst, dst2, n, average);
    case at::kBFloat16:
      return reduce_bf16(s, world, dst, dst2, n, average);
    default:
      TORCH_CHECK(false, "pyallreduce: unsupported dtype ", dtype);
  }
}

void parallel_copy(char* dst, const char* src, int64_t bytes) {
  at::parallel_for(0, bytes, kParallelGrainBytes, [&](int64_t b, int64_t e) {
    std::memcpy(dst + b, src + b, e - b);
  });
}

// One protocol round (one epoch) over bytes [0, bytes) of src into dst.
void all_reduce_round(Context& ctx, at::ScalarType dtype, const char* src, char* dst, int64_t bytes,
                      int64_t algo, bool average) {
  const int64_t elem = at::elementSize(dtype);
  const int world = ctx.world_size;
  uint32_t* epoch = flags(ctx.own_region(), kEpochOffset) + kBlock;
  const uint32_t e = ++*epoch;
  const int64_t staging = staging_offset(e, ctx.max_bytes);
  char* bufs[kMaxRanks];
  for (int q = 0; q < world; ++q) bufs[q] = ctx.regions[q] + staging;
  char* own = bufs[ctx.rank];

  parallel_copy(own, src, bytes);
  barrier(ctx, kStartFlagsOffset, e, "start");

  if (algo == kOneShot) {
    at::parallel_for(0, bytes / elem, kParallelGrainBytes / elem, [&](int64_t b, int64_t end) {
      reduce_range(dtype, bufs, world, dst, nullptr, b * elem, end * elem, average);
    });
    return;
  }
  // Two-shot: rank q reduces slice q (contiguous, so the hardware prefetchers
  // stream it) from every rank's buffer into both its own buffer and out; after
  // the mid barrier every rank copies the other slices from their owners. With
  // one block per rank, any split the ranks agree on within a call is sound
  // (protocol.h: a buffer is rewritten only two calls later).
  const int64_t slice = (bytes + world - 1) / world;
  const int64_t slice_bytes = (slice + kSliceAlignBytes - 1) / kSliceAlignBytes * kSliceAlignBytes;
  auto slice_begin = [&](int q) { return std::min(bytes, q * slice_bytes); };
  auto for_slice = [&](int q, auto&& body) {  // body(begin, end) over the intra-op threads
    at::parallel_for(slice_begin(q) / elem, slice_begin(q + 1) / elem, kParallelGrainBytes / elem,
                     [&](int64_t b, int64_t end) { body(b * elem, end * elem); });
  };
  for_slice(ctx.rank, [&](int64_t b, int64_t end) {
    reduce_range(dtype, bufs, world, dst, own, b, end, average);
  });
  barrier(ctx, kMidFlagsOffset, e, "mid");
  for (int i = 1; i < world; ++i) {
    const int q = (ctx.rank + i) % world;  // ranks start on different owners
    for_slice(q, [&](int64_t b, int64_t end) { std::memcpy(dst + b, bufs[q] + b, end - b); });
  }
}

// Large messages go in rounds of kRoundBytes: each round's staging copy is still
// in cache when the peers read it, where one round over the whole message would
// have evicted its start by then (L2 is a few MiB). Costs one barrier per round.
void host_all_reduce(Context& ctx, const at::Tensor& input, at::Tensor& out, int64_t algo,
                     bool average) {
  const int64_t bytes = input.nbytes();
  const auto* src = static_cast<const char*>(input.data_ptr());
  auto* dst = static_cast<char*>(out.data_ptr());
  for (int64_t done = 0; done < bytes; done += kRoundBytes) {
    all_reduce_round(ctx, input.scalar_type(), src + done, dst + done, std::min(kRoundBytes, bytes - done),
                     algo, average);
  }
}

}  // namespace
}  // namespace pyallreduce

PYALLREDUCE_REGISTER_BACKEND(CPU, ::pyallreduce::host_all_reduce)
