// Runs the real CUDA kernels (csrc/cuda/all_reduce.cuh: all-reduce,
// reduce-scatter, all-gather) and the glue's decisions (csrc/cuda/call_plan.h)
// on the host through tests/sim/cuda_shim.h: W ranks as threads or as forked
// processes, each mapping the shared regions at its own address, every output
// bit compared with an independent fp32 rank-order reference (all-gather: with
// every rank's input). What it covers and what it cannot: docs/verification.md.
//
//   harness [--suite plain|quick|tsan] [--mode threads|procs|both] [--seed N] [--only NAME]
//
// Exit status 0 when every check passed. Each rank runs its calls without any
// host synchronisation with the others (random delays between calls, slow
// flag operations now and then), checks its own results right after each call
// and then overwrites its input, as a caller may.
#include "cuda_shim.h"
// The shim first: the kernels see its CUDA keywords.
#include "cuda/all_reduce.cuh"
#include "cuda/call_plan.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <functional>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>

#if defined(SIM_COVERAGE)
extern "C" void __gcov_dump();
#endif

using namespace pyallreduce;
using namespace pyallreduce::cuda;

namespace {

// ---- element types and the independent reference ----------------------------------

// The three the reductions take, then two that only all-gather takes (it
// copies bytes: a 1-byte and an 8-byte element).
enum DType { kF32, kF16, kBF16, kU8, kI64 };
constexpr int kReducedDtypes = 3, kDtypes = 5;
const char* const kDtypeNames[] = {"float32", "float16", "bfloat16", "uint8", "int64"};
// c10::ScalarType values (the descriptor's dtype field): Byte 0, Long 4, Half 5, Float 6, BFloat16 15.
const uint32_t kDtypeCodes[] = {6, 5, 15, 0, 4};
int elem_size(int dt) { return dt == kF32 ? 4 : dt == kU8 ? 1 : dt == kI64 ? 8 : 2; }

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Written here from the IEEE formats, not taken from NVIDIA's headers.
float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h >> 15) << 31, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  if (exp == 0) return bits_float(sign) + (sign ? -1.0f : 1.0f) * std::ldexp(float(man), -24);
  if (exp == 31) return bits_float(sign | 0x7F800000u | (man << 13));
  return bits_float(sign | ((exp + 112) << 23) | (man << 13));
}
uint16_t float_to_half(float f) {  // round to nearest even; inputs here are finite
  const uint32_t u = float_bits(f), sign = (u >> 16) & 0x8000;
  const int exp = int((u >> 23) & 0xFF) - 127 + 15;
  uint32_t man = u & 0x7FFFFF;
  if (exp >= 31) return uint16_t(sign | 0x7C00);
  if (exp <= 0) {  // subnormal half (or zero)
    if (exp < -10) return uint16_t(sign);
    man |= 0x800000;
    const int shift = 14 - exp;
    uint32_t h = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1))) ++h;
    return uint16_t(sign | h);
  }
  uint32_t h = (uint32_t(exp) << 10) | (man >> 13);
  const uint32_t rem = man & 0x1FFF;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) ++h;  // may carry into the exponent: correct
  return uint16_t(sign | h);
}
float to_f32(int dt, const char* p) {
  if (dt >= kReducedDtypes) return float(uint8_t(*p));  // raw types: shown by their first byte
  if (dt == kF32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t b;
  std::memcpy(&b, p, 2);
  return dt == kF16 ? half_to_float(b) : bits_float(uint32_t(b) << 16);
}
void from_f32(int dt, float f, char* p) {
  if (dt == kF32) {
    std::memcpy(p, &f, 4);
    return;
  }
  uint16_t b;
  if (dt == kF16) {
    b = float_to_half(f);
  } else {
    const uint32_t u = float_bits(f);
    b = uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
  }
  std::memcpy(p, &b, 2);
}

uint64_t mix(uint64_t x) {  // splitmix64
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
uint64_t input_hash(uint64_t seed, int q, int64_t i) {
  return mix(seed * 131 + uint64_t(q) * 0x100000001ull + uint64_t(i));
}
// Element i of rank q's input: never zero, varied mantissas, no overflow.
float input_value(uint64_t seed, int q, int64_t i) {
  const float v = float(int64_t(input_hash(seed, q, i) % 20001) - 10000) / 97.0f;
  return v == 0.0f ? 0.5f : v;
}
// Elements first.. first + count - 1 of rank q's input (raw types: hash bytes,
// the first byte odd, so never a zero element).
void fill_input(char* p, int dt, int64_t count, uint64_t seed, int q, int64_t first = 0) {
  const int es = elem_size(dt);
  for (int64_t i = 0; i < count; ++i) {
    if (dt < kReducedDtypes) {
      from_f32(dt, input_value(seed, q, first + i), p + i * es);
    } else {
      const uint64_t h = input_hash(seed, q, first + i) | 1u;
      std::memcpy(p + i * es, &h, size_t(es));  // little endian: the low bytes
    }
  }
}
// The all-reduce of elements first.. first + count - 1 (a reduce-scatter's
// segment is the all-reduce of those elements of the whole input).
void reference(char* out, int dt, int64_t count, uint64_t seed, int world, bool average, int64_t first = 0) {
  std::vector<char> x(size_t(elem_size(dt)));
  for (int64_t i = 0; i < count; ++i) {
    float acc = 0.0f;
    for (int q = 0; q < world; ++q) {  // rank order, each input rounded to the dtype first
      from_f32(dt, input_value(seed, q, first + i), x.data());
      const float v = to_f32(dt, x.data());
      acc = q == 0 ? v : acc + v;
    }
    if (average) acc = acc / float(world);
    from_f32(dt, acc, out + i * elem_size(dt));
  }
}

// ---- the world: shared regions and registered buffers -----------------------------

struct Config {
  int world = 2;
  int nblocks = 2;
  int64_t max_bytes = 0;        // 0: derived from the sizes used
  int64_t timeout_ns = int64_t(30) * 1000000000;  // a hang costs 30 s; a loaded 2-core machine needs ~1 s
  bool processes = false;
  uint64_t seed = 1;
};

constexpr int kGraphEntries = 8;
constexpr uint8_t kSentinel = 0xA5;
constexpr int kGuardBytes = 64;  // checked after every output

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// A status record as the glue makes it (cuda_prepare): generation 1.
CallStatus first_status() {
  CallStatus s{};
  s.generation = 1;
  return s;
}

struct Rank {
  Config cfg;
  int rank = 0;
  char* base = nullptr;         // this rank's mapping of the shared file
  int64_t per_rank = 0;         // region + registered buffer
  CallStatus status = first_status();  // the glue's pinned record (private to the rank)
  uint32_t claim = 0;           // the glue's claim word in device memory (kernel_api.h CallStatus)
  uint32_t gave_up = 0;         // and the word beside it (kernel_api.h Call::gave_up)
  uint32_t kept_mismatches = 0; // mismatches the record holds because the "host" has not looked yet
  int64_t first_kept_call = 0;  // the call number of the first of them
  GraphEntry entries[kGraphEntries]{};
  std::mt19937_64 rng;
  int failures = 0;
  int64_t calls = 0;
  int slow_us = 0;              // > 0: sleep this long at every flag operation
  std::string where;            // test name, for messages

  char* region(int q) const { return base + q * per_rank; }
  char* reg_buf(int q) const { return region(q) + region_bytes(cfg.max_bytes); }
  int64_t reg_bytes() const { return cfg.max_bytes + 256; }

  // The first failure ends the run: peers would only wait for this rank until
  // their deadlines (a forked rank's siblings are killed by run_world).
  [[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 2, 3))) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    std::fprintf(stderr, "FAIL [%s W=%d nblocks=%d %s] rank %d call %" PRId64 ": %s\n", where.c_str(),
                 cfg.world, cfg.nblocks, cfg.processes ? "procs" : "threads", rank, calls, msg);
    std::fflush(nullptr);
    _exit(1);
  }
};

// One rank's part of one collective call.
struct CallSpec {
  int dtype = kF32;
  int64_t count = 1;            // elements; reduce-scatter and all-gather: of one segment (S)
  int64_t algo = kOneShot;      // kAgreeOnly: the agreement round (no data)
  int64_t agree_algo = kAgreeOnly;  // an agreement round's descriptor: the collective it stands for
  bool average = false;
  // In place, reduce-scatter and all-gather: the one overlap they allow
  // (out = segment `rank` of the input, input = segment `rank` of out).
  // Registered: the input lies in the registered buffer (only all-reduce
  // reads it in place).
  enum Where { kPrivate, kPrivateInPlace, kRegistered, kRegisteredInPlace } where = kPrivate;
  int in_off = 0, out_off = 0;  // elements, to test misaligned tensors (all-gather in place: out's)
  int graph = 0;                // 0 eager; 1 captured, entry unset; 2 captured, entry set
  int entry = 0;
  uint64_t seed = 1;
  bool skip = false;            // this rank makes no call (deadline tests)
  bool in_place() const { return where == kPrivateInPlace || where == kRegisteredInPlace; }
  bool in_registered() const { return where == kRegistered || where == kRegisteredInPlace; }
  bool segments() const { return algo == kReduceScatter || algo == kAllGather; }
  int64_t in_count(int world) const { return algo == kReduceScatter ? world * count : count; }
  int64_t out_count(int world) const { return algo == kAllGather ? world * count : count; }
};

// kSkipped: a call launched after one of this rank gave up (a deadline, an
// abort), as a kernel queued behind it: it must leave everything as it was.
enum class Expect { kOk, kMismatch, kDeadline, kAborted, kSkipped };

// What the glue's find_registered says for this input: the whole registered
// buffer is registered, so any 16-byte aligned offset inside it. The glue
// never asks for reduce-scatter and all-gather.
bool registered_for(const CallSpec& s) {
  return s.in_registered() && s.graph == 0 && !s.segments() &&
         int64_t(s.in_off) * elem_size(s.dtype) % kVecBytes == 0;
}

// The mode and algorithm that run, as the kernels will publish them.
CallDesc expected_desc(const CallSpec& s, uint32_t epoch, int world) {
  const int64_t bytes = s.count * elem_size(s.dtype) * (s.segments() ? world : 1);
  Mode mode = kStaged;
  if (s.algo == kAgreeOnly) {
    mode = Mode(kModeFallback);
  } else if (registered_for(s)) {
    mode = s.in_place() ? kRegisteredInPlace : kRegistered;
  } else if (s.graph == 2) {
    mode = s.in_place() ? kRegisteredInPlace : kRegistered;
  }
  const int64_t algo = s.algo == kAgreeOnly ? s.agree_algo : kernel_algo(s.algo, mode);
  return CallDesc{uint64_t(bytes), epoch,
                  desc_kind(kDtypeCodes[s.dtype], uint32_t(algo), uint32_t(mode), s.average, s.in_place())};
}

// Two-shot balance (protocol.h chunk_owner_rank): a staged two-shot call
// leaves the chunks this rank reduced in its staging buffer, and its own input
// copy in every other chunk. Every rank must have reduced floor or ceil of
// nchunks / W chunks, so the ranks' shares differ by at most one chunk at every
// size. (A chunk that holds both the input and the result counts either way.)
void check_two_shot_share(Rank& r, const char* input, const char* result, int64_t bytes) {
  const uint32_t e = reinterpret_cast<const uint32_t*>(r.region(r.rank) + kEpochOffset)[0];
  const char* staging = r.region(r.rank) + staging_offset(e, r.cfg.max_bytes);
  const int64_t nchunks = (bytes + kChunkBytes - 1) / kChunkBytes;
  int64_t surely = 0, maybe = 0;
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t off = c * kChunkBytes;
    const size_t len = size_t(std::min(kChunkBytes, bytes - off));
    const bool is_input = std::memcmp(staging + off, input + off, len) == 0;
    const bool is_result = std::memcmp(staging + off, result + off, len) == 0;
    if (!is_input && !is_result) r.fail("staging chunk %" PRId64 " holds neither the input nor the result", c);
    surely += !is_input;
    maybe += is_result;
  }
  const int64_t lo = nchunks / r.cfg.world, hi = (nchunks + r.cfg.world - 1) / r.cfg.world;
  if (surely > hi || maybe < lo) {
    r.fail("two-shot of %" PRId64 " chunks: this rank reduced %" PRId64 "-%" PRId64 " of them, want %" PRId64
           "-%" PRId64 " (unbalanced ownership)", nchunks, surely, maybe, lo, hi);
  }
}

// Reduce-scatter and all-gather stage per protocol.h: right after a call
// (no later call of this rank has written it yet) this rank's staging buffer
// holds input segment q at q * segment_stride(S) (reduce-scatter), or the
// input at 0 (all-gather), the layout every backend shares.
void check_segment_staging(Rank& r, const CallSpec& s, const char* input, int64_t segment) {
  const uint32_t e = reinterpret_cast<const uint32_t*>(r.region(r.rank) + kEpochOffset)[0];
  const char* staging = r.region(r.rank) + staging_offset(e, r.cfg.max_bytes);
  const int parts = s.algo == kReduceScatter ? r.cfg.world : 1;
  for (int q = 0; q < parts; ++q) {
    if (std::memcmp(staging + q * segment_stride(segment), input + q * segment, size_t(segment)) != 0) {
      r.fail("%s of %" PRId64 " bytes: staging at %" PRId64 " does not hold input segment %d",
             s.algo == kReduceScatter ? "reduce-scatter" : "all-gather", segment,
             int64_t(q) * segment_stride(segment), q);
    }
  }
}

// The first element of got that differs from want, if any, fails the rank.
void check_elements(Rank& r, const CallSpec& s, const CallPlan& plan, const char* what, const char* got,
                    const char* want, int64_t count) {
  const int es = elem_size(s.dtype);
  for (int64_t i = 0; i < count; ++i) {
    if (std::memcmp(want + i * es, got + i * es, size_t(es)) != 0) {
      r.fail("%s %s %" PRId64 " elems algo %" PRId64 " where %d mode %d graph %d off %d/%d: %s element %" PRId64
             " is %g, want %g",
             kDtypeNames[s.dtype], s.average ? "avg" : "sum", s.count, s.algo, int(s.where), int(plan.mode),
             s.graph, s.in_off, s.out_off, what, i, double(to_f32(s.dtype, got + i * es)),
             double(to_f32(s.dtype, want + i * es)));
    }
  }
}

// The glue's dispatch: by dtype, all-gather by its word (launch_all_gather).
bool launch_call(Rank& r, const CallSpec& s, const Call& call) {
  const int W = r.cfg.world, nb = r.cfg.nblocks;
  if (s.algo == kAllGather) return launch_all_gather(W, call, nb, nullptr);
  const bool rs = s.algo == kReduceScatter;
  switch (s.dtype) {
    case kF32: return rs ? launch_reduce_scatter<float>(W, call, nb, nullptr) : launch_all_reduce<float>(W, call, nb, nullptr);
    case kF16: return rs ? launch_reduce_scatter<__half>(W, call, nb, nullptr) : launch_all_reduce<__half>(W, call, nb, nullptr);
    case kBF16:
      return rs ? launch_reduce_scatter<__nv_bfloat16>(W, call, nb, nullptr)
                : launch_all_reduce<__nv_bfloat16>(W, call, nb, nullptr);
    default: return false;
  }
}

// What a call of rank r publishes: its epoch counters and its start and mid
// flags in every rank's region.
std::vector<uint32_t> protocol_marks(const Rank& r) {
  std::vector<uint32_t> marks;
  for (int b = 0; b < r.cfg.nblocks; ++b) {
    marks.push_back(reinterpret_cast<const uint32_t*>(r.region(r.rank) + kEpochOffset)[b]);
    for (int q = 0; q < r.cfg.world; ++q) {
      for (int64_t flags : {kStartFlagsOffset, kMidFlagsOffset}) {
        marks.push_back(__atomic_load_n(reinterpret_cast<const uint32_t*>(r.region(q) + flags) + flag_index(b, r.rank),
                                        __ATOMIC_ACQUIRE));
      }
    }
  }
  return marks;
}

// Runs one call on rank r: the glue's decisions (call_plan.h), the kernel,
// then every check. specs[q] is rank q's call.
// host_clears: after a mismatch, clear the record as the glue does once it
// raised; false leaves it as the glue leaves it until it looks (it raises a
// recorded mismatch only after launching the next call).
void run_call(Rank& r, const std::vector<CallSpec>& specs, Expect expect, uint32_t missing = 0,
              bool host_clears = true) {
  const CallSpec& s = specs[size_t(r.rank)];
  ++r.calls;
  if (s.skip) return;
  const int es = elem_size(s.dtype), W = r.cfg.world;
  const int64_t bytes = s.count * es;  // the payload, or the segment S
  const int64_t in_bytes = s.in_count(W) * es, out_bytes = s.out_count(W) * es;
  const bool gather_in_place = s.algo == kAllGather && s.in_place();

  // Input and out where the spec says; private buffers have exactly their size
  // (ASan sees any access past them) plus checked guard bytes after out.
  char* in_alloc = nullptr;
  char* out_alloc = nullptr;
  char* in;
  char* out;
  if (!s.in_place() || gather_in_place) {
    out_alloc = static_cast<char*>(std::malloc(size_t(int64_t(s.out_off) * es + out_bytes + kGuardBytes)));
    out = out_alloc + int64_t(s.out_off) * es;
    std::memset(out, kSentinel, size_t(out_bytes + kGuardBytes));
  }
  if (gather_in_place) {
    in = out + r.rank * bytes;
  } else if (s.in_registered()) {
    in = r.reg_buf(r.rank) + int64_t(s.in_off) * es;
    if (int64_t(s.in_off) * es + in_bytes > r.reg_bytes()) std::abort();
  } else {
    in_alloc = static_cast<char*>(std::malloc(size_t(int64_t(s.in_off) * es + in_bytes)));
    in = in_alloc + int64_t(s.in_off) * es;
  }
  if (s.in_place() && !gather_in_place) out = s.algo == kReduceScatter ? in + r.rank * bytes : in;
  if (s.algo != kAgreeOnly) fill_input(in, s.dtype, s.in_count(W), s.seed, r.rank);
  std::vector<char> before(out, out + out_bytes);  // a skipped call must leave out as it was
  const std::vector<char> input(in, in + in_bytes);

  // The glue's decisions.
  const auto in_addr = reinterpret_cast<uintptr_t>(in), out_addr = reinterpret_cast<uintptr_t>(out);
  const bool registered = registered_for(s) && may_read_in_place(in_addr, out_addr, bytes);
  const CallPlan plan = s.segments() ? plan_segment_call(in_addr, out_addr, bytes, r.rank, s.algo)
                                     : plan_call(in_addr, out_addr, bytes, s.algo, registered);
  if (s.segments() && (plan.in_place != s.in_place() || plan.mode != kStaged || plan.copy_input ||
                       plan.copy_out || plan.graph_entry_eligible)) {
    r.fail("plan_segment_call: in place %d mode %d copies %d/%d graph entry %d, want in place %d, staged, "
           "no copies, no entry", plan.in_place, int(plan.mode), plan.copy_input, plan.copy_out,
           plan.graph_entry_eligible, s.in_place());
  }
  Call call{};
  for (int q = 0; q < W; ++q) {
    call.regions[q] = r.region(q);
    if (registered) call.registered[q] = r.reg_buf(q) + int64_t(s.in_off) * es;
  }
  call.bytes = bytes;
  call.desc_bytes = uint64_t(s.segments() ? W * bytes : bytes);
  call.max_bytes = r.cfg.max_bytes;
  call.timeout_ns = r.cfg.timeout_ns;
  call.rank = r.rank;
  call.mode = plan.mode;
  call.algo = s.algo;
  call.average = s.average;
  call.in_place = plan.in_place;
  call.dtype = kDtypeCodes[s.dtype];
  call.call_number = r.calls;
  call.status = &r.status;
  call.claim = &r.claim;
  call.gave_up = &r.gave_up;
  char* in_tmp = nullptr;
  char* out_tmp = nullptr;
  if (plan.copy_input) {
    in_tmp = static_cast<char*>(std::malloc(size_t(bytes)));
    std::memcpy(in_tmp, in, size_t(bytes));
  }
  if (plan.copy_out) {
    out_tmp = static_cast<char*>(std::malloc(size_t(bytes)));
    std::memcpy(out_tmp, out, size_t(bytes));  // out.clone()
  }
  call.input = in_tmp ? in_tmp : in;
  call.out = out_tmp ? out_tmp : out;
  if (s.algo == kAgreeOnly) {
    call.bytes = 0;
    call.mode = Mode(kModeFallback);
    call.input = call.out = nullptr;
    call.agree_algo = s.agree_algo;
  }
  if (s.graph != 0) {
    if (!plan.graph_entry_eligible || !s.in_registered()) {
      r.fail("graph spec not eligible for an entry");
    } else {
      GraphEntry& e = r.entries[s.entry];
      e = GraphEntry{};
      if (s.graph == 2) {
        for (int q = 0; q < W; ++q) e.registered[q] = r.reg_buf(q) + int64_t(s.in_off) * es;
        e.mode = plan.in_place ? kRegisteredInPlace : kRegistered;
      }
      call.graph_entry = &e;
    }
  }

  const std::vector<uint32_t> marks_before = protocol_marks(r);
  const uint32_t code_before = __atomic_load_n(&r.status.code, __ATOMIC_ACQUIRE);
  sim::options.seed = r.rng();
  const bool slow = r.rng() % 4 == 0;
  sim::options.flag_sleep_us = r.slow_us > 0 ? r.slow_us : slow ? int(r.rng() % 200) : 0;
  sim::options.flag_sleep_percent = r.slow_us > 0 ? 100 : slow ? 20 : 0;
  if (!launch_call(r, s, call)) r.fail("the launch refused world %d", W);
  if (out_tmp != nullptr) std::memcpy(out, out_tmp, size_t(bytes));  // out.copy_(out_tmp)

  // Checks.
  const uint32_t code = __atomic_load_n(&r.status.code, __ATOMIC_ACQUIRE);
  if (expect == Expect::kOk) {
    const uint32_t want_code = r.kept_mismatches > 0 ? kStatusMismatch : kStatusOk;
    if (code != want_code || r.status.mismatches != r.kept_mismatches) {
      r.fail("status code %u (barrier %s, missing 0x%x, %u mismatches) on a matching call, want code %u, "
             "%u mismatches", code, barrier_name(r.status.barrier), r.status.missing, r.status.mismatches,
             want_code, r.kept_mismatches);
    } else if (s.algo == kAllGather) {
      std::vector<char> want(static_cast<size_t>(bytes));
      for (int q = 0; q < W; ++q) {
        fill_input(want.data(), s.dtype, s.count, s.seed, q);
        check_elements(r, s, plan, ("segment " + std::to_string(q)).c_str(), out + q * bytes, want.data(), s.count);
      }
      check_segment_staging(r, s, input.data(), bytes);
    } else if (s.algo != kAgreeOnly) {
      // Reduce-scatter: the all-reduce reference of this rank's segment.
      const int64_t first = s.algo == kReduceScatter ? r.rank * s.count : 0;
      std::vector<char> want(static_cast<size_t>(bytes));
      reference(want.data(), s.dtype, s.count, s.seed, W, s.average, first);
      check_elements(r, s, plan, "out", out, want.data(), s.count);
      if (s.algo == kReduceScatter) check_segment_staging(r, s, input.data(), bytes);
      const bool staged_two_shot = plan.mode == kStaged && s.graph != 2 && s.algo == kTwoShot;
      if (staged_two_shot && W > 1) check_two_shot_share(r, input.data(), want.data(), bytes);
    }
  } else if (expect == Expect::kSkipped) {
    if (code != code_before || protocol_marks(r) != marks_before) {
      r.fail("a call launched after a wait gave up changed the record (code %u, was %u) or published itself "
             "(an epoch counter or a flag of this rank moved)", code, code_before);
    }
    if (std::memcmp(before.data(), out, size_t(out_bytes)) != 0) r.fail("a call launched after a wait gave up wrote its output");
  } else if (expect == Expect::kMismatch) {
    const int64_t first_call = r.kept_mismatches > 0 ? r.first_kept_call : r.calls;
    if (code != kStatusMismatch) {
      r.fail("status code %u on a mismatched call, want %u", code, kStatusMismatch);
    } else if (r.status.mismatches != r.kept_mismatches + 1 || r.status.call != first_call ||
               r.status.last_mismatch_call != r.calls) {
      r.fail("mismatch record: %u mismatches, calls %" PRId64 "..%" PRId64 ", want %u, calls %" PRId64
             "..%" PRId64, r.status.mismatches, r.status.call, r.status.last_mismatch_call,
             r.kept_mismatches + 1, first_call, r.calls);
    } else {
      for (int q = 0; q < W; ++q) {
        const CallDesc want = expected_desc(specs[size_t(q)], r.status.epoch, W);
        const CallDesc& got = r.status.descs[q];
        if (got.bytes != want.bytes || got.epoch != want.epoch || got.kind != want.kind) {
          r.fail("mismatch record: rank %d's descriptor (%" PRIu64 ", %u, 0x%x), want (%" PRIu64 ", %u, 0x%x)",
                 q, got.bytes, got.epoch, got.kind, want.bytes, want.epoch, want.kind);
        }
      }
    }
    if (std::memcmp(before.data(), out, size_t(out_bytes)) != 0) r.fail("a mismatched call wrote its output");
    if (host_clears) {
      const uint32_t next = r.status.generation + 1;  // the glue clears a mismatch once raised
      std::memset(&r.status, 0, sizeof(r.status));
      r.status.generation = next;
      r.kept_mismatches = 0;
    } else {
      r.first_kept_call = first_call;
      ++r.kept_mismatches;
    }
  } else {
    // An abort may also name a rank whose flag arrived just as the wait gave up:
    // every missing rank must be named, and may be joined by others.
    const bool aborted = expect == Expect::kAborted;
    const uint32_t want_code = aborted ? kStatusAborted : kStatusDeadline;
    if (code != want_code || (aborted ? (r.status.missing & missing) != missing : r.status.missing != missing)) {
      r.fail("status code %u missing 0x%x, want code %u with missing 0x%x", code, r.status.missing, want_code,
             missing);
    } else {
      const std::string msg = gave_up_message(r.status, r.rank, W, r.cfg.timeout_ns);
      const std::string gave_up = aborted ? "was aborted (" + std::string(kAbortedBy) + ") while rank " +
                                                std::to_string(r.rank) + "'s kernel waited"
                                          : " never arrived there";
      const size_t ranks = msg.find("rank(s)");
      for (int q = 0; q < W; ++q) {  // (single missing ranks in these tests)
        const bool named = msg.find(gave_up) != std::string::npos &&
                           msg.find("collective call " + std::to_string(r.status.call) + " ") != std::string::npos &&
                           ranks != std::string::npos && msg.find(" " + std::to_string(q), ranks) != std::string::npos;
        if (((missing >> q) & 1u) && !named) r.fail("the message does not name rank %d and the call: %s", q, msg.c_str());
      }
    }
  }
  // Nothing but out is written: the input outside out is as it was, and so
  // are the guard bytes after a separate out.
  for (int64_t i = 0; i < in_bytes; ++i) {
    const bool in_out = in + i >= out && in + i < out + out_bytes;
    if (!in_out && in[i] != input[size_t(i)]) r.fail("input byte %" PRId64 " was overwritten", i);
  }
  if (out_alloc != nullptr) {
    for (int i = 0; i < kGuardBytes; ++i) {
      if (uint8_t(out[out_bytes + i]) != kSentinel) r.fail("byte %d after the output was overwritten", i);
    }
  }
  // A caller may reuse its input at once: peers must be done with it.
  if (s.algo != kAgreeOnly) std::memset(in, 0x7F, size_t(in_bytes));
  std::free(in_alloc);
  std::free(out_alloc);
  std::free(in_tmp);
  std::free(out_tmp);
}

void random_pause(Rank& r) {
  const uint64_t x = r.rng() % 8;
  if (x < 2) std::this_thread::sleep_for(std::chrono::microseconds(r.rng() % 300));
  else if (x < 4) std::this_thread::yield();
}

// ---- running W ranks ----------------------------------------------------------------

using RankBody = std::function<void(Rank&)>;
using WorldSetup = std::function<void(char* base, int64_t per_rank, const Config&)>;

// Maps the shared file at an address of this rank's own (a fixed hint per rank,
// so forked processes do not all get the same address either).
char* map_shared(int fd, int64_t total, int rank) {
  void* hint = reinterpret_cast<void*>(uintptr_t(0x200000000000ull) + uintptr_t(rank) * (uintptr_t(1) << 36) +
                                       uintptr_t(rank) * 0x3000);
  void* p = mmap(hint, size_t(total), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED_NOREPLACE, fd, 0);
  if (p == MAP_FAILED) p = mmap(nullptr, size_t(total), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    std::perror("mmap of the shared file");
    std::abort();
  }
  return static_cast<char*>(p);
}

// Returns the number of ranks that failed.
int run_world(const std::string& name, Config cfg, const RankBody& body, const WorldSetup& setup = nullptr) {
  const int64_t per_rank = round_up(region_bytes(cfg.max_bytes) + cfg.max_bytes + 256, 4096);
  const int64_t total = per_rank * cfg.world;
  const int fd = memfd_create("pyallreduce-sim", 0);
  if (fd < 0 || ftruncate(fd, total) != 0) {
    std::perror("memfd");
    std::abort();
  }
  if (setup) {
    char* p = static_cast<char*>(mmap(nullptr, size_t(total), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    setup(p, per_rank, cfg);
    munmap(p, size_t(total));
  }
#if defined(SIM_TSAN)
  // TSan tracks memory by address: a race between ranks is only visible when
  // they access the shared memory through one mapping (threads mode only).
  char* const one_mapping = static_cast<char*>(
      mmap(nullptr, size_t(total), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
#endif
  auto run_rank = [&](int rank) {
    Rank r;
    r.cfg = cfg;
    r.rank = rank;
    r.per_rank = per_rank;
#if defined(SIM_TSAN)
    r.base = one_mapping;
#else
    r.base = map_shared(fd, total, rank);
#endif
    r.rng.seed(mix(cfg.seed * 977 + uint64_t(rank)));
    r.where = name;
    body(r);
#if !defined(SIM_TSAN)
    munmap(r.base, size_t(total));
#endif
    return r.failures;
  };
  int failed = 0;
  if (!cfg.processes) {
    std::vector<int> result(size_t(cfg.world));
    std::vector<std::thread> ranks;
    for (int q = 0; q < cfg.world; ++q) ranks.emplace_back([&, q] { result[size_t(q)] = run_rank(q); });
    for (auto& t : ranks) t.join();
    for (int f : result) failed += f != 0;
  } else {
    std::fflush(nullptr);
    std::vector<pid_t> pids;
    for (int q = 0; q < cfg.world; ++q) {
      const pid_t pid = fork();
      if (pid == 0) {
        const int f = run_rank(q);
        std::fflush(nullptr);
#if defined(SIM_COVERAGE)
        __gcov_dump();  // _exit skips the exit handlers that write the counts
#endif
        _exit(f == 0 ? 0 : 1);
      }
      pids.push_back(pid);
    }
    for (size_t left = pids.size(); left > 0; --left) {
      int st = 0;
      const pid_t pid = waitpid(-1, &st, 0);
      if (WIFEXITED(st) && WEXITSTATUS(st) == 0) continue;
      ++failed;
      for (pid_t other : pids) {
        if (other != pid) kill(other, SIGKILL);  // they would wait for the failed rank
      }
    }
  }
#if defined(SIM_TSAN)
  munmap(one_mapping, size_t(total));
#endif
  close(fd);
  return failed;
}

// ---- scripts --------------------------------------------------------------------------

// Sizes (elements) around every boundary the kernels have: one element, a
// partial vector, a partial chunk, a chunk, the blocks' first round, the two-
// shot owners' rounds, several rounds, each with tails.
std::vector<int64_t> sizes_for(int dt, const Config& cfg, int64_t max_count) {
  const int64_t es = elem_size(dt), vec = kVecBytes / es, chunk = kChunkBytes / es;
  const int64_t round = chunk * cfg.nblocks, owners = round * cfg.world;
  std::vector<int64_t> v = {1, 2, vec - 1, vec, vec + 1, 3 * vec + 1, chunk - 1, chunk, chunk + 1,
                            chunk + vec, chunk * cfg.world - 1, chunk * cfg.world + 1, round - 1, round,
                            round + 3, owners - 1, owners,
                            owners + chunk / 2 + 1, 2 * owners + 5, 3 * owners + chunk + 7};
  std::vector<int64_t> out;
  for (int64_t x : v) {
    if (x >= 1 && x <= max_count) out.push_back(x);
  }
  return out;
}

// The most elements a call may have (reduce-scatter, all-gather: per
// segment): what one staging buffer holds, W segments at segment_stride apart
// for reduce-scatter.
int64_t max_count(const CallSpec& s, const Config& cfg) {
  const int64_t staged = s.algo == kReduceScatter ? cfg.max_bytes / cfg.world / kSegmentUnit * kSegmentUnit
                                                  : cfg.max_bytes;
  return staged / elem_size(s.dtype);
}

// A random call every rank makes (the same spec on every rank): one-shot,
// two-shot, reduce-scatter or all-gather, so that one communicator's calls mix
// all of them.
CallSpec random_spec(std::mt19937_64& g, const Config& cfg, bool allow_graph) {
  CallSpec s;
  const uint64_t kind = g() % 6;
  s.algo = kind < 2 ? kOneShot : kind < 4 ? kTwoShot : kind == 4 ? kReduceScatter : kAllGather;
  s.dtype = int(g() % (s.algo == kAllGather ? kDtypes : kReducedDtypes));
  const std::vector<int64_t> sizes = sizes_for(s.dtype, cfg, max_count(s, cfg));
  s.count = sizes[g() % sizes.size()];
  s.average = s.algo != kAllGather && g() % 2;
  s.seed = g();
  switch (g() % 6) {
    case 0: s.where = CallSpec::kPrivate; break;
    case 1: s.where = CallSpec::kPrivateInPlace; break;
    case 2: case 3: s.where = CallSpec::kRegistered; break;
    default: s.where = CallSpec::kRegisteredInPlace; break;
  }
  const int64_t vec = kVecBytes / elem_size(s.dtype);
  if (g() % 4 == 0) s.in_off = int(1 + g() % (vec - 1 > 0 ? vec - 1 : 1));
  if (g() % 4 == 0) s.out_off = int(1 + g() % (vec - 1 > 0 ? vec - 1 : 1));
  if (g() % 4 == 0) s.in_off = int(vec * (1 + g() % 3));  // aligned, not at the buffer's start
  if (s.in_registered() && (s.in_off + s.in_count(cfg.world)) * elem_size(s.dtype) > cfg.max_bytes + 256) {
    s.in_off = 0;
  }
  if (allow_graph && s.in_registered() && !s.segments() && g() % 3 == 0) {
    s.in_off = int(vec * (g() % 2));
    s.out_off = 0;
    if (s.where == CallSpec::kRegisteredInPlace) s.algo = kTwoShot;  // in-place entries are two-shot only
    s.graph = 1 + int(g() % 2);
    s.entry = int(g() % kGraphEntries);
  }
  return s;
}

// n random calls, the same on every rank, with random pauses between them.
RankBody random_script(int n, bool allow_graph) {
  return [n, allow_graph](Rank& r) {
    std::mt19937_64 g(r.cfg.seed);  // the same script on every rank
    for (int i = 0; i < n && r.failures == 0; ++i) {
      CallSpec s = random_spec(g, r.cfg, allow_graph);
      if (s.graph != 0 && g() % 2 == 0) {
        // "Replays" of one captured call, its entry switched between them.
        for (int k = 0; k < 3; ++k) {
          s.graph = 1 + (s.graph % 2);
          s.seed = g();
          run_call(r, std::vector<CallSpec>(size_t(r.cfg.world), s), Expect::kOk);
          random_pause(r);
        }
        continue;
      }
      run_call(r, std::vector<CallSpec>(size_t(r.cfg.world), s), Expect::kOk);
      random_pause(r);
    }
  };
}

// A staged two-shot call of every boundary size (fp32 and bf16): each checks
// the ranks' shares of the reduction (check_two_shot_share) besides the result.
RankBody balance_script() {
  return [](Rank& r) {
    for (int dt : {kF32, kBF16}) {
      for (int64_t count : sizes_for(dt, r.cfg, r.cfg.max_bytes / elem_size(dt))) {
        CallSpec s;
        s.dtype = dt;
        s.count = count;
        s.algo = kTwoShot;
        s.seed = uint64_t(count);
        run_call(r, std::vector<CallSpec>(size_t(r.cfg.world), s), Expect::kOk);
      }
    }
  };
}

// Reduce-scatter (float32, float16, bfloat16; sum and avg in turn) and
// all-gather (every dtype) of every boundary size, in turn private, in place
// (the one alias each allows) and with the input in the registered buffer
// (which they must not read in place), with misaligned input and out offsets
// in turn, and a random call (any kind) after every third, so the staging
// buffers pass between the kinds on one communicator. every_dtype: every
// size in every dtype; else each size in one dtype, the next size in the next.
RankBody segments_script(bool every_dtype) {
  return [every_dtype](Rank& r) {
    std::mt19937_64 g(r.cfg.seed);  // the same script on every rank
    int i = 0;
    for (int64_t algo : {kReduceScatter, kAllGather}) {
      const int ndtypes = algo == kAllGather ? kDtypes : kReducedDtypes;
      for (int dt = 0; dt < ndtypes; ++dt) {
        CallSpec s;
        s.algo = algo;
        s.dtype = dt;
        const int vec = kVecBytes / elem_size(dt);
        const std::vector<int64_t> sizes = sizes_for(dt, r.cfg, max_count(s, r.cfg));
        for (size_t k = 0; k < sizes.size(); ++k) {
          if (!every_dtype && int(k % size_t(ndtypes)) != dt) continue;
          ++i;
          s.count = sizes[k];
          s.seed = g();
          s.average = algo == kReduceScatter && i % 2 == 1;
          s.where = i % 3 == 0 ? CallSpec::kPrivate : i % 3 == 1 ? CallSpec::kPrivateInPlace : CallSpec::kRegistered;
          const int offsets = (i / 3) % 4;  // none, input, out, both (elements: never 16-byte aligned)
          s.in_off = offsets & 1 ? 1 + i % (vec - 1) : 0;
          s.out_off = offsets & 2 ? vec - 1 - i % (vec - 1) : 0;
          run_call(r, std::vector<CallSpec>(size_t(r.cfg.world), s), Expect::kOk);
          if (i % 3 == 0) {
            run_call(r, std::vector<CallSpec>(size_t(r.cfg.world), random_spec(g, r.cfg, true)), Expect::kOk);
          }
        }
      }
    }
  };
}

// One communicator used from two streams (the DDP hook's side stream and the
// current stream): each rank launches its calls on two simulated streams, a
// thread per launch that starts after its stream's previous launch, and after
// the previous launch on the other stream only where the glue's order_launch
// says to wait for its event. Without that wait a rank's two kernels run at
// once and race on the epochs.
RankBody streams_script(int n) {
  return [n](Rank& r) {
    std::mt19937_64 g(r.cfg.seed);  // the same calls on every rank
    std::mt19937_64 pick(r.rng());  // each rank's own choice of streams
    Rank on[2] = {r, r};            // each stream's launches run one at a time on its own copy
    on[1].rng.seed(r.rng());
    LaunchOrder order;
    std::shared_future<void> last, tail[2];  // the previous launch (its event); each stream's last
    std::vector<std::thread> launches;
    for (int i = 0; i < n; ++i) {
      const std::vector<CallSpec> specs(size_t(r.cfg.world), random_spec(g, r.cfg, false));
      const int k = int(pick() % 2);
      const bool wait = order_launch(order, reinterpret_cast<cudaStream_t>(uintptr_t(k) + 1), false);
      const std::shared_future<void> after_stream = tail[k], after_event = wait ? last : std::shared_future<void>();
      auto done = std::make_shared<std::promise<void>>();
      tail[k] = last = done->get_future().share();
      Rank* stream = &on[k];
      launches.emplace_back([=] {
        if (after_stream.valid()) after_stream.wait();
        if (after_event.valid()) after_event.wait();
        run_call(*stream, specs, Expect::kOk);
        done->set_value();
      });
    }
    for (auto& t : launches) t.join();
    r.failures = on[0].failures + on[1].failures;
  };
}

// Each listed way of calling differently, then `followups` random matching
// calls (every mode, so the epochs must really be back in step, zero-copy's
// two-epoch calls included) and a matching agreement round.
RankBody mismatch_script(int followups) {
  return [followups](Rank& r) {
    const int W = r.cfg.world;
    auto same = [W](CallSpec s) { return std::vector<CallSpec>(size_t(W), s); };
    std::vector<std::vector<CallSpec>> cases;
    CallSpec base;
    base.count = 3000;
    base.seed = 7;
    auto vary = [&](const std::function<void(CallSpec&)>& f) {
      std::vector<CallSpec> v = same(base);
      f(v[size_t(W - 1)]);
      cases.push_back(v);
    };
    vary([](CallSpec& s) { s.count += 1; });                                   // bytes
    vary([](CallSpec& s) { s.dtype = kBF16; s.count *= 2; });                  // dtype, same bytes
    vary([](CallSpec& s) { s.average = true; });                               // op
    vary([](CallSpec& s) { s.algo = kTwoShot; });                              // algorithm
    vary([](CallSpec& s) { s.where = CallSpec::kRegistered; });                // mode: 2 epochs vs 1
    vary([](CallSpec& s) { s.where = CallSpec::kRegisteredInPlace; s.algo = kTwoShot; });
    vary([](CallSpec& s) { s.where = CallSpec::kPrivateInPlace; });            // in place
    vary([](CallSpec& s) { s.algo = kAgreeOnly; });                            // fallback vs kernel
    // Reduce-scatter and all-gather: one rank calls another collective of the
    // same descriptor bytes (W * S), another S, op, dtype or alias; and the
    // agreement rounds that stand for them.
    auto collective = [W](int64_t algo, int64_t segment_count) {
      CallSpec s;
      s.algo = algo;
      s.count = algo == kReduceScatter || algo == kAllGather ? segment_count : W * segment_count;
      s.seed = 11;
      return s;
    };
    auto against = [&](CallSpec all, CallSpec last) {
      std::vector<CallSpec> v = same(all);
      v[size_t(W - 1)] = last;
      cases.push_back(v);
    };
    const int64_t n = 1500;
    against(collective(kOneShot, n), collective(kReduceScatter, n));
    against(collective(kReduceScatter, n), collective(kAllGather, n));
    against(collective(kAllGather, n), collective(kTwoShot, n));
    {
      CallSpec s = collective(kReduceScatter, n);
      s.count += 1;
      against(collective(kReduceScatter, n), s);                                 // S
      s = collective(kAllGather, n);
      s.count -= 1;
      against(collective(kAllGather, n), s);
      s = collective(kReduceScatter, n);
      s.average = true;
      against(collective(kReduceScatter, n), s);                                 // op
      s = collective(kReduceScatter, n);
      s.where = CallSpec::kPrivateInPlace;
      against(collective(kReduceScatter, n), s);                                 // alias
      s = collective(kAllGather, n);
      s.where = CallSpec::kPrivateInPlace;
      against(collective(kAllGather, n), s);
      CallSpec bytes8 = collective(kAllGather, n);
      bytes8.dtype = kI64;
      s = collective(kAllGather, 8 * n);
      s.dtype = kU8;
      against(bytes8, s);                                                        // dtype, same bytes
      CallSpec agree_rs = collective(kAgreeOnly, n);
      agree_rs.agree_algo = kReduceScatter;
      CallSpec agree_ag = agree_rs;
      agree_ag.agree_algo = kAllGather;
      against(agree_rs, agree_ag);                                               // fallbacks of two collectives
      against(agree_ag, collective(kAgreeOnly, n));                              // and of all-reduce
      against(agree_rs, collective(kReduceScatter, n));                          // fallback vs kernel
    }
    {  // zero-copy one-shot against two-shot everywhere else
      CallSpec t = base;
      t.algo = kTwoShot;
      std::vector<CallSpec> v = same(t);
      v[0].where = CallSpec::kRegistered;
      v[0].algo = kOneShot;
      cases.push_back(v);
    }
    std::mt19937_64 g(r.cfg.seed);
    // The host does not look between mismatches (the glue raises a recorded
    // one only after launching the next call, which may mismatch too): the
    // record keeps the first call's descriptors and counts every mismatch up
    // to the last, whatever matching calls ran between them.
    run_call(r, cases[0], Expect::kMismatch, 0, /*host_clears=*/false);
    run_call(r, same(random_spec(g, r.cfg, true)), Expect::kOk);
    run_call(r, cases[0], Expect::kMismatch, 0, /*host_clears=*/false);
    run_call(r, cases[0], Expect::kMismatch);
    for (const auto& c : cases) {
      run_call(r, c, Expect::kMismatch);
      random_pause(r);
      for (int k = 0; k < followups; ++k) {  // the next matching calls are exact
        CallSpec s = random_spec(g, r.cfg, true);
        run_call(r, same(s), Expect::kOk);
      }
      CallSpec agree = base;  // an agreement round that matches, standing for each collective in turn
      agree.algo = kAgreeOnly;
      agree.agree_algo = (&c - cases.data()) % 3 == 0 ? kAgreeOnly : (&c - cases.data()) % 3 == 1 ? kReduceScatter
                                                                                                  : kAllGather;
      run_call(r, same(agree), Expect::kOk);
    }
  };
}

// A matching call, then the specs of one that rank `missing` never makes.
std::vector<CallSpec> matching_call_then_one_without(Rank& r, int missing) {
  CallSpec s;
  s.count = 5000;
  s.algo = r.cfg.seed % 2 ? kTwoShot : kOneShot;
  run_call(r, std::vector<CallSpec>(size_t(r.cfg.world), s), Expect::kOk);
  std::vector<CallSpec> v(size_t(r.cfg.world), s);
  v[size_t(missing)].skip = true;
  return v;
}

// Calls of every kernel, launched after a wait of this rank gave up, as kernels
// queued behind it: each must change nothing.
void calls_after_giving_up(Rank& r) {
  CallSpec s;
  s.count = 3000;
  for (int64_t algo : {kOneShot, kTwoShot, kReduceScatter, kAllGather, kAgreeOnly}) {
    s.algo = algo;
    s.dtype = algo == kAllGather ? kU8 : kF32;
    run_call(r, std::vector<CallSpec>(size_t(r.cfg.world), s), Expect::kSkipped);
  }
}

// Rank `missing` never calls: every other rank's kernel records a deadline
// naming it and returns.
RankBody deadline_script(int missing) {
  return [missing](Rank& r) {
    run_call(r, matching_call_then_one_without(r, missing), Expect::kDeadline, 1u << missing);
    if (r.rank != missing) calls_after_giving_up(r);
  };
}

// A mismatch the host has not cleared yet (the glue raises one only after
// launching the next call), then a call that rank `missing` never makes: its
// deadline must take the record over from the mismatch (kClaimSevere), or the
// host would raise the mismatch, clear the record and go on with kernels that
// do nothing; and the calls after it change nothing.
RankBody mismatch_then_deadline_script(int missing) {
  return [missing](Rank& r) {
    CallSpec s;
    s.count = 3000;
    std::vector<CallSpec> v(size_t(r.cfg.world), s);
    v[size_t(r.cfg.world - 1)].count += 1;
    run_call(r, v, Expect::kMismatch, 0, /*host_clears=*/false);
    v = std::vector<CallSpec>(size_t(r.cfg.world), s);
    v[size_t(missing)].skip = true;
    run_call(r, v, Expect::kDeadline, 1u << missing);
    if (r.rank != missing) calls_after_giving_up(r);
  };
}

// Rank `missing` never calls, and the host aborts every other rank 50 ms into
// its call, as abort_context does (CallStatus::aborted): each kernel gives up
// within kAbortLookNs, long before its deadline (cfg.timeout_ns, 20 s), and
// records kStatusAborted naming the missing rank.
RankBody abort_script(int missing) {
  return [missing](Rank& r) {
    const std::vector<CallSpec> v = matching_call_then_one_without(r, missing);
    std::thread host([&r] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      __atomic_store_n(&r.status.aborted, 1u, __ATOMIC_RELEASE);
    });
    const auto t0 = std::chrono::steady_clock::now();
    run_call(r, v, Expect::kAborted, 1u << missing);  // (a failure ends the process: no join needed)
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    host.join();
    if (r.rank != missing && waited > 1e-9 * double(r.cfg.timeout_ns) / 4) {
      r.fail("the aborted call took %.1f s: it waited for its deadline", waited);
    }
    if (r.rank != missing) calls_after_giving_up(r);
  };
}

// Returns once every other rank has published its next call at the start
// barrier (its start flags for this rank's next epoch are here): this rank's
// kernel then passes that barrier without waiting.
void wait_for_peers_at_start(const Rank& r) {
  const auto* epochs = reinterpret_cast<const uint32_t*>(r.region(r.rank) + kEpochOffset);
  const auto* flags = reinterpret_cast<const uint32_t*>(r.region(r.rank) + kStartFlagsOffset);
  for (bool all = false; !all; std::this_thread::sleep_for(std::chrono::milliseconds(1))) {
    all = true;
    for (int b = 0; b < r.cfg.nblocks; ++b) {
      for (int q = 0; q < r.cfg.world; ++q) {
        all = all && (q == r.rank || __atomic_load_n(&flags[flag_index(b, q)], __ATOMIC_ACQUIRE) == epochs[b] + 1);
      }
    }
  }
}

// Which later barriers an abort ends. Rank 0 is aborted from the start but
// launches each call only once rank 1 is at the start barrier (so it never
// waits there); rank 1 is slow at every flag operation (5 ms), so rank 0 then
// waits for it well over kAbortLookNs in the later barriers. Zero-copy
// one-shot, two-shot and two-shot in place must all complete exactly: their
// end barrier, and two-shot's mid barrier there, keep a peer from reading
// this rank's registered buffer after its caller got it back. Then a staged
// two-shot: rank 0 gives up in the mid barrier, and rank 1, which reads only
// rank 0's region, completes exactly. There rank 0 is aborted only once all
// its blocks have published their start: a block that starts after another
// block of its call gave up does nothing (Call::gave_up, as a kernel queued
// behind it), so its peers' blocks wait for their deadline instead. On a GPU
// a launch's resident blocks start microseconds apart; the host shim's block
// threads on a loaded machine, milliseconds (seen: 3 runs in 100).
RankBody abort_after_start_script() {
  return [](Rank& r) {
    if (r.rank == 0) __atomic_store_n(&r.status.aborted, 1u, __ATOMIC_RELEASE);
    if (r.rank == 1) r.slow_us = 5000;
    const int64_t chunk = kChunkBytes / 4;
    CallSpec s;
    s.count = 2 * chunk * r.cfg.world * r.cfg.nblocks;
    for (int64_t algo : {kOneShot, kTwoShot}) {
      for (auto where : {CallSpec::kRegistered, CallSpec::kRegisteredInPlace}) {
        if (algo == kOneShot && where == CallSpec::kRegisteredInPlace) continue;  // in place is two-shot only
        s.algo = algo;
        s.where = where;
        ++s.seed;
        if (r.rank == 0) wait_for_peers_at_start(r);
        run_call(r, std::vector<CallSpec>(size_t(r.cfg.world), s), Expect::kOk);
      }
    }
    s.algo = kTwoShot;
    s.where = CallSpec::kPrivate;
    ++s.seed;
    if (r.rank == 1) r.slow_us = 50000;  // rank 0 waits ~50 ms in the mid barrier: well past kAbortLookNs
    std::thread aborter;
    if (r.rank == 0) {
      wait_for_peers_at_start(r);
      __atomic_store_n(&r.status.aborted, 0u, __ATOMIC_RELEASE);
      const auto* epochs = reinterpret_cast<const uint32_t*>(r.region(0) + kEpochOffset);
      std::vector<uint32_t> e(size_t(r.cfg.nblocks));
      for (int b = 0; b < r.cfg.nblocks; ++b) e[size_t(b)] = epochs[b] + 1;
      aborter = std::thread([&r, e] {  // the abort, once every block of rank 0 is past its start
        const auto* peer_flags = reinterpret_cast<const uint32_t*>(r.region(1) + kStartFlagsOffset);
        for (int b = 0; b < r.cfg.nblocks; ++b) {
          while (__atomic_load_n(&peer_flags[flag_index(b, 0)], __ATOMIC_ACQUIRE) != e[size_t(b)]) {
            std::this_thread::sleep_for(std::chrono::microseconds(100));
          }
        }
        __atomic_store_n(&r.status.aborted, 1u, __ATOMIC_RELEASE);
      });
    }
    run_call(r, std::vector<CallSpec>(size_t(r.cfg.world), s), r.rank == 0 ? Expect::kAborted : Expect::kOk, 1u << 1);
    if (aborter.joinable()) aborter.join();
  };
}

// The state the old protocol leaves after ~2^32 one-shot calls: epoch counters
// just below the wrap, start flags at the last epoch, mid flags still 0 from
// the zeroed region. Then calls across the wrap with a slow rank 1: the first
// ones one-shot (which, with the fix, refresh the mid flags), then two-shot,
// zero-copy and mixed.
WorldSetup wrap_setup(uint32_t last_epoch, bool mid_fresh) {
  return [last_epoch, mid_fresh](char* base, int64_t per_rank, const Config& cfg) {
    for (int q = 0; q < cfg.world; ++q) {
      char* region = base + q * per_rank;
      auto* start = reinterpret_cast<uint32_t*>(region + kStartFlagsOffset);
      auto* mid = reinterpret_cast<uint32_t*>(region + kMidFlagsOffset);
      auto* epoch = reinterpret_cast<uint32_t*>(region + kEpochOffset);
      for (int b = 0; b < kMaxBlocks; ++b) {
        epoch[b] = last_epoch;
        for (int p = 0; p < cfg.world; ++p) {
          start[flag_index(b, p)] = last_epoch;
          mid[flag_index(b, p)] = mid_fresh ? last_epoch : 0;
        }
      }
    }
  };
}
// first_algo: the calls before the two-shot ones (one-shot, or reduce-scatter
// or all-gather, which must refresh the mid flags as one-shot does).
RankBody wrap_script(int one_shot_first, int64_t first_algo = kOneShot) {
  return [one_shot_first, first_algo](Rank& r) {
    std::mt19937_64 g(r.cfg.seed);
    const int64_t chunk = kChunkBytes / 4;
    if (r.rank == 1) r.slow_us = 300;  // peers run ahead into the mid barrier
    for (int i = 0; i < 8; ++i) {
      CallSpec s;
      s.count = 2 * chunk * r.cfg.nblocks * r.cfg.world + 3;
      s.seed = g();
      s.algo = i < one_shot_first ? first_algo : kTwoShot;
      if (s.segments()) s.count = 2 * chunk * r.cfg.nblocks + 3;  // W segments fit in staging
      if (i >= one_shot_first + 3) s.where = i % 2 ? CallSpec::kRegistered : CallSpec::kRegisteredInPlace;
      run_call(r, std::vector<CallSpec>(size_t(r.cfg.world), s), Expect::kOk);
    }
  };
}

// The graph table's bookkeeping (call_plan.h), as comm.capture() drives it:
// captures of 0..block_entries + 1 eligible calls in a row. Slots are never
// reused, never past the blocks allocated, and a capture that opens with at
// most half a block free gets a new block (so it has at least half a block).
bool graph_slots_ok() {
  for (int64_t per_block = 1; per_block <= 6; ++per_block) {
    int64_t nblocks = 0, next_slot = 0, last = -1;
    std::mt19937_64 g{uint64_t(per_block)};
    for (int capture = 0; capture < 40; ++capture) {
      if (graph_needs_block(nblocks, per_block, next_slot)) {
        next_slot = nblocks * per_block;  // graph_capture_begin skips the old block's rest
        ++nblocks;
      }
      if (nblocks * per_block - next_slot < (per_block + 1) / 2) return false;
      const int64_t calls = int64_t(g() % uint64_t(per_block + 2));
      for (int64_t c = 0; c < calls; ++c) {
        const int64_t slot = graph_take_slot(nblocks, per_block, next_slot);
        if (slot < 0) continue;  // full: the call is captured without an entry
        if (slot <= last || slot >= nblocks * per_block) return false;
        last = slot;
      }
    }
  }
  return true;
}

// ---- suites -------------------------------------------------------------------------

struct Totals {
  int worlds = 0, failed = 0;
};

void report(Totals& t, const std::string& name, const Config& cfg, int failed, double seconds) {
  ++t.worlds;
  t.failed += failed != 0;
  std::printf("%-9s W=%d nblocks=%-2d %-7s seed=%-4" PRIu64 " %6.2fs %s\n", name.c_str(), cfg.world, cfg.nblocks,
              cfg.processes ? "procs" : "threads", cfg.seed, seconds, failed ? "FAILED" : "ok");
  std::fflush(stdout);
}

void run(Totals& t, const std::string& only, const std::string& name, Config cfg, const RankBody& body,
         const WorldSetup& setup = nullptr) {
  if (!only.empty() && only != name) return;
  if (cfg.max_bytes == 0) cfg.max_bytes = round_up(3 * kChunkBytes * cfg.nblocks * cfg.world + 4096, kAlignment);
  const auto t0 = std::chrono::steady_clock::now();
  const int failed = run_world(name, cfg, body, setup);
  report(t, name, cfg, failed, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

}  // namespace

int main(int argc, char** argv) {
  std::string suite = "plain", mode = "both", only;
  uint64_t seed = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--suite") suite = v;
    else if (k == "--mode") mode = v;
    else if (k == "--seed") seed = std::stoull(v);
    else if (k == "--only") only = v;
    else {
      std::fprintf(stderr, "usage: %s [--suite plain|quick|tsan] [--mode threads|procs|both] [--seed N] [--only NAME]\n", argv[0]);
      return 2;
    }
  }
  std::vector<bool> proc_modes;
  if (mode != "procs") proc_modes.push_back(false);
  if (mode != "threads") proc_modes.push_back(true);
  if (!graph_slots_ok()) {
    std::fprintf(stderr, "FAIL graph-table slot bookkeeping (call_plan.h)\n");
    return 1;
  }
  const bool quick = suite != "plain";
  const bool tsan = suite == "tsan";  // ~100x slower: the smallest worlds that still race
  Totals t;
  for (bool procs : proc_modes) {
    auto cfg = [&](int w, int nb, uint64_t s) {
      Config c;
      c.world = w;
      c.nblocks = nb;
      c.processes = procs;
      c.seed = seed * 1000 + s;
      return c;
    };
    // Every world size with small grids, random mixed calls.
    for (int w = 1; w <= kMaxRanks; ++w) {
      const int nb = 1 + (w + int(procs)) % 4;
      if ((quick && w > 4) || (tsan && (w == 1 || w > 3))) continue;
      run(t, only, "random", cfg(w, tsan ? 1 + w % 2 : nb, uint64_t(w)),
          random_script(tsan ? 6 : quick ? 8 : w <= 4 ? 24 : 10, true));
    }
    if (!quick) {
      for (int nb = 1; nb <= 4; ++nb) run(t, only, "random", cfg(3, nb, 50 + uint64_t(nb)), random_script(12, true));
      // The default grid (32 blocks), sampled: fewer calls, W 2 and 4 (8 with threads).
      run(t, only, "default", cfg(2, 32, 60), random_script(4, false));
      if (!procs) run(t, only, "default", cfg(8, 32, 61), random_script(2, false));
    }
    for (int w = 2; w <= 4 && !tsan; ++w) {
      if (procs && w != 3) continue;
      run(t, only, "balance", cfg(w, 3, 40 + uint64_t(w)), balance_script());
    }
    // Reduce-scatter and all-gather: every world size, several grids; every
    // size in every dtype where W <= 4 (threads, plain suite).
    for (int w = 1; w <= kMaxRanks; ++w) {
      const int nb = 1 + (w + 2 * int(procs)) % 4;
      if ((quick && w > 4) || (procs && w % 3 != 1) || (tsan && w != 2)) continue;
      run(t, only, "segments", cfg(w, nb, 20 + uint64_t(w)), segments_script(!quick && !procs && w <= 4));
    }
    if (!tsan) run(t, only, "streams", cfg(procs ? 2 : 3, 2, 30), streams_script(quick ? 12 : 24));
    for (int w : {2, 3}) {
      if ((quick && w == 3 && procs) || (tsan && w == 3)) continue;
      run(t, only, "mismatch", cfg(w, 2, 70 + uint64_t(w)), mismatch_script(tsan ? 1 : 3));
    }
    {
      // Short, to keep the failing call short; but each world's first call must
      // make it, which under TSan (~100x slower) 300 ms missed 3 runs in 12.
      const int64_t deadline_ns = (tsan ? 3000 : 300) * 1000000ll;
      Config c = cfg(3, 2, 80);
      c.timeout_ns = deadline_ns;
      run(t, only, "deadline", c, deadline_script(1));
      c = cfg(2, 1, 81);
      c.timeout_ns = deadline_ns;
      run(t, only, "deadline", c, deadline_script(0));
      c = cfg(3, 2, 84);
      c.timeout_ns = deadline_ns;
      run(t, only, "deadline", c, mismatch_then_deadline_script(1));
      c = cfg(3, 2, 82);
      c.timeout_ns = int64_t(20) * 1000000000;
      run(t, only, "abort", c, abort_script(2));
      if (!tsan) run(t, only, "abort", cfg(2, 2, 83), abort_after_start_script());
    }
    // Across the 32-bit wrap: from the old protocol's state (mid flags 0),
    // with the next call at 0xFFFFFFFF - 2 (two one-shot calls, then two-shot
    // at 0xFFFFFFFF and 0), and from a state right at the wrap.
    // Reduce-scatter and all-gather as the calls before the wrap: they must
    // store the mid flags as one-shot does.
    for (int w : {2, 3}) {
      if (quick && w == 3) continue;
      run(t, only, "wrap", cfg(w, 1, 90 + uint64_t(w)), wrap_script(2), wrap_setup(0xFFFFFFFCu, false));
      run(t, only, "wrap", cfg(w, 2, 95 + uint64_t(w)), wrap_script(0), wrap_setup(0xFFFFFFFEu, true));
      run(t, only, "wrap", cfg(w, 2, 85 + uint64_t(w)), wrap_script(2, kReduceScatter),
          wrap_setup(0xFFFFFFFCu, false));
      run(t, only, "wrap", cfg(w, 1, 87 + uint64_t(w)), wrap_script(2, kAllGather), wrap_setup(0xFFFFFFFCu, false));
    }
  }
  std::printf("%d worlds, %d failed\n", t.worlds, t.failed);
  return t.failed == 0 ? 0 : 1;
}
