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
constexpr int64_t kChunkBytes = 4096;      // two-shot ownership unit (chunk_owner_rank)
constexpr int64_t kTileElems = 512;        // fp32 accumulator tile, stays in L1
constexpr int64_t kParallelGrainBytes = 256 << 10;
constexpr int kSpinsBeforeYield = 1024;    // then yield: 8 ranks on 2 cores must progress
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

// dst[i] = cast(sum over q in order 0..W-1 of float(src[q][i])) (/ W), i in [0, n).
// Fixed order and fp32 accumulation make every rank's bits identical. The loops
// are plain so the compiler vectorises each target clone (AVX-512, AVX2, SSE2).
template <typename T>
inline void reduce_tiles(const T* const* src, int world, T* dst, int64_t n, bool average) {
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

#define PYALLREDUCE_CLONES __attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default")))
PYALLREDUCE_CLONES void reduce_f32(const float* const* s, int w, float* d, int64_t n, bool avg) {
  reduce_tiles(s, w, d, n, avg);
}
PYALLREDUCE_CLONES void reduce_f16(const _Float16* const* s, int w, _Float16* d, int64_t n, bool avg) {
  reduce_tiles(s, w, d, n, avg);
}
PYALLREDUCE_CLONES void reduce_bf16(const Bf16* const* s, int w, Bf16* d, int64_t n, bool avg) {
  reduce_tiles(s, w, d, n, avg);
}
#undef PYALLREDUCE_CLONES

// Reduces bytes [begin, end) of every rank's staging buffer into dst + begin.
void reduce_range(at::ScalarType dtype, char* const* srcs, int world, char* dst, int64_t begin,
                  int64_t end, bool average) {
  const int64_t elem = at::elementSize(dtype);
  const int64_t n = (end - begin) / elem;
  const char* s[kMaxRanks];
  for (int q = 0; q < world; ++q) s[q] = srcs[q] + begin;
  dst += begin;
  switch (dtype) {
    case at::kFloat:
      return reduce_f32(reinterpret_cast<const float* const*>(s), world,
                        reinterpret_cast<float*>(dst), n, average);
    case at::kHalf:
      return reduce_f16(reinterpret_cast<const _Float16* const*>(s), world,
                        reinterpret_cast<_Float16*>(dst), n, average);
    case at::kBFloat16:
      return reduce_bf16(reinterpret_cast<const Bf16* const*>(s), world,
                         reinterpret_cast<Bf16*>(dst), n, average);
    default:
      TORCH_CHECK(false, "pyallreduce: unsupported dtype ", dtype);
  }
}

void parallel_copy(char* dst, const char* src, int64_t bytes) {
  at::parallel_for(0, bytes, kParallelGrainBytes, [&](int64_t b, int64_t e) {
    std::memcpy(dst + b, src + b, e - b);
  });
}

void host_all_reduce(Context& ctx, const at::Tensor& input, at::Tensor& out, int64_t algo,
                     bool average) {
  const int64_t bytes = input.nbytes();
  const int64_t elem = input.element_size();
  const int world = ctx.world_size;
  uint32_t* epoch = flags(ctx.own_region(), kEpochOffset) + kBlock;
  const uint32_t e = ++*epoch;
  const int64_t staging = staging_offset(e, ctx.max_bytes);
  char* bufs[kMaxRanks];
  for (int q = 0; q < world; ++q) bufs[q] = ctx.regions[q] + staging;
  char* own = bufs[ctx.rank];
  char* dst = static_cast<char*>(out.data_ptr());

  parallel_copy(own, static_cast<const char*>(input.data_ptr()), bytes);
  barrier(ctx, kStartFlagsOffset, e, "start");

  if (algo == kOneShot) {
    at::parallel_for(0, bytes / elem, kParallelGrainBytes / elem, [&](int64_t b, int64_t end) {
      reduce_range(input.scalar_type(), bufs, world, dst, b * elem, end * elem, average);
    });
    return;
  }
  // Two-shot: chunk c is reduced by rank c % W into its own staging buffer, then
  // every rank gathers each chunk from its owner.
  const int64_t nchunks = (bytes + kChunkBytes - 1) / kChunkBytes;
  auto chunk_end = [&](int64_t c) { return std::min(bytes, (c + 1) * kChunkBytes); };
  const int64_t mine = (nchunks - ctx.rank + world - 1) / world;  // chunks rank, rank+W, ...
  at::parallel_for(0, mine, kParallelGrainBytes / kChunkBytes, [&](int64_t b, int64_t end) {
    for (int64_t k = b; k < end; ++k) {
      const int64_t c = ctx.rank + k * world;
      reduce_range(input.scalar_type(), bufs, world, own, c * kChunkBytes, chunk_end(c), average);
    }
  });
  barrier(ctx, kMidFlagsOffset, e, "mid");
  at::parallel_for(0, nchunks, kParallelGrainBytes / kChunkBytes, [&](int64_t b, int64_t end) {
    for (int64_t c = b; c < end; ++c) {
      const char* from = bufs[chunk_owner_rank(c, 1, world)];
      std::memcpy(dst + c * kChunkBytes, from + c * kChunkBytes, chunk_end(c) - c * kChunkBytes);
    }
  });
}

}  // namespace
}  // namespace pyallreduce

PYALLREDUCE_REGISTER_BACKEND(CPU, ::pyallreduce::host_all_reduce)
