// One-shot and two-shot all-reduce, reduce-scatter and all-gather over host
// shared memory (protocol in csrc/common/protocol.h). One "block" per rank: the rank's thread runs the
// barriers, and at::parallel_for spreads the copies and sums over the intra-op
// threads between them (one thread with OMP_NUM_THREADS=1).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
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
// A long wait inside a call makes this rank report contended cores for this
// many calls (see run_rounds): once merged, a call has few inner waits
// left to notice contention with, so one short call must not end it.
constexpr int kContendedCalls = 100;

// Waiting for a peer, in stages, each bounded in wall time (wait_reached):
//   spin with pause   for kSpinFor: the peer is running and microseconds away,
//                     the common case on an idle machine, where latency is all;
//                     but where the peer last ran on our own core (its
//                     kCpuOffset word: each rank has a core, yet the scheduler
//                     put two on one, most often at a wake-up), a yield at
//                     every look, before each sleep too: the peer waits behind
//                     us (the hand-over), and running now it may spare us the
//                     sleep and its wake-up, which would put us beside it
//                     again. Two unbound ranks on 2 idle cores, 256 B back to
//                     back, the spin alone: p90 ~60 us a call in some rows
//                     (spin 20 us, sleep, wake-up, in turn), 1.6-17.5 us with
//                     the hand-over. A look kSliceLost or more after the last (a
//                     yield gave another process its slice; a sleep) ends the
//                     hand-overs of that wait: at most one slice given away.
//                     Where that lasts (kMoveAfterSharedWaits waits in a
//                     row), the higher rank of the two moves to a CPU no
//                     rank uses (move_off_shared_cpu): 2 unbound ranks,
//                     256 B-4 KiB back to back, p90 14-22 us a call taking
//                     turns, 1-4 us apart (bench/busy.py);
//   or, where the ranks outnumber their cores (Context::ranks_outnumber_cores),
//   sched_yield       for kYieldFor instead: some peer we wait for is not
//                     running, most likely queued behind us on our own core,
//                     so every spin delays the very peer it waits for, and a
//                     yield hands it the core at once, where a futex sleep
//                     costs it a wake-up (4 ranks on 2 cores, 256 B: spin
//                     ~100-160 us a call, sleep at once ~35-80, yield ~10-20;
//                     docs/architecture.md);
//   sleep on a futex  past that: the peer is descheduled (another process or
//                     rank holds its core) or far away (uneven compute). Our
//                     core goes to whoever wants it, maybe the very peer we
//                     wait for, and the peer's flag store wakes us
//                     (signal_peers checks our sleep word, so an idle waker
//                     makes no syscall). One sleep lasts at most
//                     kLivenessCheckPeriod, so the deadline, a dead peer
//                     and an abort (Context::aborted) are noticed in time.
// No yield stage where each rank has a core: under EEVDF (Linux >= 6.6) one yield
// beside a busy process can hand it a whole slice (ms) while our peer runs on
// another core (docs/architecture.md, "Waiting on a busy CPU"). Where the
// ranks outnumber the cores the same happens beside other busy processes
// (4 ranks on 2 cores, 2 processes spinning: ~4 ms a 256 B call): a yield
// that took kSliceLost or more while more tasks than ranks were runnable
// (others_runnable: a long yield can also be a peer on our core computing)
// ends the stage, and the second such yield within kSliceLostAgainWithin
// calls marks this rank's cores contended (Context::contended_calls), which
// turns the yield stage off for that many calls (the spin stage instead) and
// merges the rounds (run_rounds). Not the first alone: others_runnable reads
// one instant, where a task may be runnable for that instant only (a
// launcher's or a library's thread), and such lone yeses (4 in 2400 calls of
// 256 B, 4 ranks on 2 cores, bench/busy.py) each turned 100 calls to the spin
// stage: p90 102 us at 4 KiB on an idle machine, 96 us at 256 B beside two
// spinning processes, against 37 and 48 us with the second one required.
// Contention that lasts loses slices again within a few calls.
// The clock is read every kSpinsPerClockCheck pauses (a vDSO read costs tens
// of nanoseconds), so a spin that was descheduled ends at its next look, and
// after every yield.
constexpr auto kSpinFor = std::chrono::microseconds(20);
constexpr auto kYieldFor = std::chrono::microseconds(50);
constexpr auto kSliceLost = std::chrono::milliseconds(1);
constexpr int64_t kSliceLostAgainWithin = 10;  // calls
constexpr int kMoveAfterSharedWaits = 3;  // waits in a row that found a peer on our core (move_off_shared_cpu)
constexpr int kRetryMoveAfterWaits = 1000;  // such waits after a move that failed
constexpr int kSpinsPerClockCheck = 16;
constexpr auto kLivenessCheckPeriod = std::chrono::milliseconds(100);

// Test only (tests/test_wait.py): PYALLREDUCE_TEST_WAIT_DELAY_US=N makes a
// long wait sleep a random 0..N us at each point where a lost wake-up could
// hide (after the clock read that the deadline check uses, between the
// sleep-word store and the futex call, after the futex returns), and sleep on
// the futex until the deadline: the periodic wake-up would turn a lost
// wake-up into 100 ms of delay, the test wants it to fail the call.
int64_t test_wait_delay_us() {
  static const int64_t us = [] {
    const char* v = std::getenv("PYALLREDUCE_TEST_WAIT_DELAY_US");
    return v != nullptr ? std::max<int64_t>(0, std::atoll(v)) : 0;
  }();
  return us;
}
void test_wait_delay() {
  if (test_wait_delay_us() == 0) return;
  thread_local std::minstd_rand draws(static_cast<uint32_t>(getpid()));
  usleep(static_cast<useconds_t>(draws() % (test_wait_delay_us() + 1)));
}

uint32_t* flags(char* region, int64_t offset) {
  return reinterpret_cast<uint32_t*>(region + offset);
}
uint32_t* sleep_word(char* region) { return flags(region, kSleepOffset); }
uint32_t* cpu_word(char* region) { return flags(region, kCpuOffset); }

// The CPU this thread runs on, plus one (glibc reads it from rseq: no syscall).
uint32_t current_cpu() { return static_cast<uint32_t>(sched_getcpu() + 1); }

// Says which CPU this rank runs on (kCpuOffset), where that changed: at each
// flag store and wake-up, so a peer spinning for this rank can tell that it
// waits behind it on its own core (wait_reached).
void publish_cpu(const Context& ctx) {
  uint32_t* word = cpu_word(ctx.own_region());
  const uint32_t cpu = current_cpu();
  if (__atomic_load_n(word, __ATOMIC_RELAXED) != cpu) __atomic_store_n(word, cpu, __ATOMIC_RELAXED);
}

// The CPUs that share the last-level cache with `cpu` (sysfs, "0-15,32-47";
// empty where it cannot be read).
cpu_set_t cpus_sharing_llc(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::ifstream list("/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/cache/index3/shared_cpu_list");
  std::string range;
  while (std::getline(list, range, ',')) {
    int first = -1, last = -1;
    const int fields = std::sscanf(range.c_str(), "%d-%d", &first, &last);
    if (fields < 1) break;
    if (fields == 1) last = first;
    for (int c = std::max(0, first); c <= last && c < CPU_SETSIZE; ++c) CPU_SET(c, &set);
  }
  return set;
}

// Set by PYALLREDUCE_CPU_MOVE=0: ranks that share a core never move (wait_reached).
bool moves_allowed() {
  static const bool allowed = [] {
    const char* v = std::getenv("PYALLREDUCE_CPU_MOVE");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return allowed;
}

// Moves this thread to a CPU of its affinity that no rank last ran on (their
// kCpuOffset words), one sharing our last-level cache where there is one
// (else the next by number), then sets back the affinity it had, which the
// move leaves as it was. The scheduler keeps two ranks that wake each other on
// one core (a wake-up puts the woken task beside its waker, and the balancer
// does not move a task that ran a moment ago), where the hand-over alone
// leaves them taking turns (wait_reached, kMoveAfterSharedWaits). What is set
// back is the affinity as the kernel reports it (the CPUs online and in the
// cpuset then): a thread left to run anywhere keeps running anywhere, but a
// cpuset widened later does not widen it (README; PYALLREDUCE_CPU_MOVE=0 turns
// moves off). Returns whether it moved.
bool move_off_shared_cpu(const Context& ctx) {
  const int here = sched_getcpu();
  cpu_set_t allowed;
  if (here < 0 || sched_getaffinity(0, sizeof allowed, &allowed) != 0) return false;
  auto free_cpu = [&](int cpu) {
    if (!CPU_ISSET(cpu, &allowed)) return false;
    for (int q = 0; q < ctx.world_size; ++q) {
      if (__atomic_load_n(cpu_word(ctx.regions[q]), __ATOMIC_RELAXED) == static_cast<uint32_t>(cpu + 1)) return false;
    }
    return true;
  };
  const cpu_set_t near = cpus_sharing_llc(here);
  int target = -1;
  for (int pass = 0; pass < 2 && target < 0; ++pass) {  // first the CPUs sharing our cache, then any
    for (int i = 1; i < CPU_SETSIZE; ++i) {
      const int cpu = (here + i) % CPU_SETSIZE;
      if ((pass == 1 || CPU_ISSET(cpu, &near)) && free_cpu(cpu)) {
        target = cpu;
        break;
      }
    }
  }
  if (target < 0) return false;
  cpu_set_t only;
  CPU_ZERO(&only);
  CPU_SET(target, &only);
  if (sched_setaffinity(0, sizeof only, &only) != 0) return false;
  if (sched_setaffinity(0, sizeof allowed, &allowed) != 0) {
    // The cpuset shrank away from `allowed` meanwhile: every CPU, which the kernel limits to the cpuset.
    cpu_set_t every;
    std::memset(&every, 0xff, sizeof every);
    sched_setaffinity(0, sizeof every, &every);
  }
  publish_cpu(ctx);
  return true;
}

// A shared (not FUTEX_PRIVATE) futex: the word lives in memory mapped by
// several processes, at different addresses.
void futex_wait(uint32_t* word, uint32_t seen, std::chrono::nanoseconds timeout) {
  timespec ts{static_cast<time_t>(timeout.count() / 1000000000), static_cast<long>(timeout.count() % 1000000000)};
  syscall(SYS_futex, word, FUTEX_WAIT, seen, &ts, nullptr, 0);  // EAGAIN, EINTR, ETIMEDOUT: the caller re-checks
}
void futex_wake(uint32_t* word) { syscall(SYS_futex, word, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0); }

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

// Stores e into flags[kBlock][me] of every rank's region (release), for each
// of the flag arrays given, then wakes any peer asleep on them. The fence
// pairs with the sleeper's (wait_reached): either the sleeper's re-check
// sees our flag, or we see its sleep word and wake it.
void signal_peers(const Context& ctx, std::initializer_list<int64_t> flag_arrays, uint32_t e) {
  publish_cpu(ctx);
  for (int q = 0; q < ctx.world_size; ++q) {
    for (int64_t offset : flag_arrays) {
      __atomic_store_n(flags(ctx.regions[q], offset) + flag_index(kBlock, ctx.rank), e, __ATOMIC_RELEASE);
    }
  }
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  for (int q = 0; q < ctx.world_size; ++q) {
    if (q == ctx.rank || __atomic_load_n(sleep_word(ctx.regions[q]), __ATOMIC_RELAXED) == 0) continue;
    for (int64_t offset : flag_arrays) futex_wake(flags(ctx.regions[q], offset) + flag_index(kBlock, ctx.rank));
  }
}

// Whether more tasks are runnable on this machine right now than the
// communicator has ranks awake (/proc/loadavg's count of running tasks, us
// included; a rank asleep on its futex says so in its sleep word): after a
// long yield, it tells another process's slice from a rank's own (a peer on
// our core that computed for a while). Read only then.
bool others_runnable(const Context& ctx) {
  std::ifstream loadavg("/proc/loadavg");
  double one, five, fifteen;
  int64_t running = 0;
  if (!(loadavg >> one >> five >> fifteen >> running)) return true;  // cannot tell: assume the worst
  int64_t awake = 0;
  for (int q = 0; q < ctx.world_size; ++q) awake += __atomic_load_n(sleep_word(ctx.regions[q]), __ATOMIC_RELAXED) == 0;
  return running > awake;
}

// Waits until every peer's flag in the array at flags_offset of our own region
// has reached e (acquire); returns whether the wait was long: it slept, where
// each rank has a core (where the ranks outnumber their cores, a lost slice
// marks contention itself, see kSliceLost).
// Raises naming the ranks that never arrived when the deadline passes or a
// peer's process is gone.
bool wait_reached(Context& ctx, int64_t flags_offset, uint32_t e, const char* where) {
  uint32_t* own = flags(ctx.own_region(), flags_offset);
  auto arrived = [&](int q) {
    return epoch_reached(__atomic_load_n(own + flag_index(kBlock, q), __ATOMIC_ACQUIRE), e);
  };
  using Clock = std::chrono::steady_clock;
  Clock::time_point start{}, deadline{}, sleep_from{}, next_liveness_check{};
  bool slept = false;
  bool yielding = false;  // the stage before the sleep: spin, or yield (see kYieldFor)
  bool hand_over = !ctx.ranks_outnumber_cores;  // yield to a peer on our core (see kSpinFor)
  bool counted_shared = false;  // this wait found a peer on our core (Context::shared_cpu_waits)
  Clock::time_point last_look{};
  for (int q = 0; q < ctx.world_size; ++q) {
    for (int64_t spins = 1; !arrived(q); ++spins) {
      if (yielding) {
        sched_yield();
      } else {
        _mm_pause();
      }
      if (!yielding && spins % kSpinsPerClockCheck != 0) continue;  // a yield may have taken a slice: look
      const auto now = Clock::now();
      if (yielding && now - last_look >= kSliceLost && others_runnable(ctx)) {  // see kSliceLost
        if (ctx.calls - ctx.slice_lost_call <= kSliceLostAgainWithin) ctx.contended_calls = kContendedCalls;
        ctx.slice_lost_call = ctx.calls;
        yielding = false;
        sleep_from = now;
      }
      if (hand_over && last_look != Clock::time_point{} && now - last_look >= kSliceLost) {
        hand_over = false;  // a look long after the last (a slice given away, a sleep): no more hand-overs
      }
      last_look = now;
      if (hand_over) {
        const uint32_t peer_cpu = __atomic_load_n(cpu_word(ctx.regions[q]), __ATOMIC_RELAXED);
        if (peer_cpu != 0 && peer_cpu == current_cpu()) {
          if (!counted_shared) {
            counted_shared = true;
            ctx.shared_cpu_waits = std::min(ctx.shared_cpu_waits + 1, kMoveAfterSharedWaits);
          }
          // The higher rank of the two moves, so that two ranks do not move at once. Also beside other
          // busy processes: the balancer counts tasks, so two ranks on one core and two spinners on the
          // other look balanced to it (2 ranks, 2 spinners, 256 B: p90 26 us staying, 2 us moving).
          if (ctx.rank > q && ctx.shared_cpu_waits >= kMoveAfterSharedWaits && moves_allowed()) {
            // A move that failed (no free CPU; affinity calls refused) is tried again after as many waits.
            ctx.shared_cpu_waits = move_off_shared_cpu(ctx) ? 0 : -kRetryMoveAfterWaits;
          } else {
            sched_yield();  // the peer waits for our core (see kSpinFor); before a sleep too, which it may spare
          }
        } else if (peer_cpu != 0) {
          ctx.shared_cpu_waits = 0;  // apart: the count starts again
        }
      }
      if (start == Clock::time_point{}) {  // the clock is read only once a wait is not short
        start = now;
        deadline = start + std::chrono::nanoseconds(ctx.timeout_ns);
        yielding = ctx.ranks_outnumber_cores && ctx.contended_calls == 0;
        sleep_from = start + (yielding ? std::chrono::duration_cast<Clock::duration>(kYieldFor)
                                       : std::chrono::duration_cast<Clock::duration>(kSpinFor));
        next_liveness_check = start + kLivenessCheckPeriod;
      }
      if (now < sleep_from) continue;
      test_wait_delay();
      bool dead = false;
      if (now >= next_liveness_check && !ctx.pids.empty()) {
        dead = rank_process_gone(ctx.pids[q]);
        next_liveness_check = now + kLivenessCheckPeriod;
      }
      const bool aborted = ctx.aborted.load(std::memory_order_relaxed);
      if (!dead && !aborted && now < deadline) {
        uint32_t* word = own + flag_index(kBlock, q);
        uint32_t* sleeping = sleep_word(ctx.own_region());
        __atomic_store_n(sleeping, 1u, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);  // pairs with signal_peers' fence
        const uint32_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
        if (!epoch_reached(seen, e)) {
          test_wait_delay();
          const Clock::duration left = deadline - now;
          futex_wait(word, seen,
                     test_wait_delay_us() > 0 ? left : std::min<Clock::duration>(left, kLivenessCheckPeriod));
          test_wait_delay();
          publish_cpu(ctx);  // the wake-up may have moved us (to the waker's core, most often)
          slept = true;
        }
        __atomic_store_n(sleeping, 0u, __ATOMIC_RELAXED);
        continue;
      }
      std::ostringstream missing;
      for (int p = 0; p < ctx.world_size; ++p) {
        if (!arrived(p)) missing << " " << p;
      }
      double waited = std::chrono::duration<double>(Clock::now() - start).count();
      TORCH_CHECK(!aborted, "pyallreduce: collective call ", ctx.calls, " on this communicator was aborted (",
                  kAbortedBy, ") after rank ", ctx.rank,
                  " waited ", waited, " s in the ", where, " barrier for rank(s)", missing.str(),
                  "; create a new Communicator (or process group) on the ranks that go on");
      TORCH_CHECK(false, "pyallreduce: rank ", ctx.rank, " waited ", waited, " s in the ", where,
                  " barrier of collective call ", ctx.calls, " on this communicator; rank(s)", missing.str(),
                  " never arrived there",
                  dead ? " (rank " + std::to_string(q) + "'s process has exited)" : std::string(),
                  ". Every rank must make the same collective calls in the same order.");
    }
  }
  // Where the ranks outnumber their cores, a sleep is how a hand-over ends
  // when the peer's work takes a while, not a sign of contention: only a lost
  // slice is (above).
  return slept && !ctx.ranks_outnumber_cores;
}

// The start of call e (protocol.h): publish our descriptor, signal, wait for
// every peer, and check that every peer published the same call. A call
// without a mid barrier also stores e into the mid flags (the wrap fix).
// On a mismatch, leaves every rank's epoch and mid flags in step (protocol.h)
// and throws CallMismatch. Returns whether any rank's cores are contended
// (kDescContended), and in *long_wait whether this wait was long.
bool start_call(Context& ctx, CallDesc mine, bool has_mid_barrier, bool* long_wait) {
  const uint32_t e = mine.epoch;
  for (int q = 0; q < ctx.world_size; ++q) {
    std::memcpy(ctx.regions[q] + desc_offset(e, kBlock, ctx.rank), &mine, sizeof mine);
  }
  if (has_mid_barrier) {
    signal_peers(ctx, {kStartFlagsOffset}, e);
  } else {
    signal_peers(ctx, {kStartFlagsOffset, kMidFlagsOffset}, e);
  }
  *long_wait = wait_reached(ctx, kStartFlagsOffset, e, "start");
  CallDesc descs[kMaxRanks];
  std::memcpy(descs, ctx.own_region() + desc_offset(e, kBlock, 0), ctx.world_size * sizeof(CallDesc));
  if (calls_agree(mine, descs, ctx.world_size)) {
    bool contended = false;
    for (int q = 0; q < ctx.world_size; ++q) contended |= (descs[q].kind & kDescContended) != 0;
    return contended;
  }
  // The epoch counter is e already (every host call uses one epoch).
  if (has_mid_barrier) signal_peers(ctx, {kMidFlagsOffset}, e);
  throw CallMismatch(mismatch_message(ctx.calls, e, descs, ctx.world_size));
}

uint32_t next_epoch(Context& ctx) { return ++*(flags(ctx.own_region(), kEpochOffset) + kBlock); }

// dst[i] = cast(sum over q in order 0..W-1 of float(src[q][i])) (/ W), i in [0, n),
// also stored to dst2 unless it is null. Fixed order and fp32 accumulation make
// every rank's bits identical. The generic kernels (no AVX2) and the scalar
// tails of the vector kernels below; always_inline puts it inside each of them.
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

// The vector ISA the reduction kernels use: the best this CPU has, or a lower
// one named by PYALLREDUCE_CPU_ISA (avx512, avx2, generic), which is how the
// AVX2 kernels are measured on an AVX-512 machine (bench/compare_nccl.py).
enum class Isa { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };
const char* const kIsaNames[] = {"generic", "avx2", "avx512"};

Isa detect_isa() {
  const Isa best = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") ? Isa::kAvx512
                   : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")      ? Isa::kAvx2
                                                                                           : Isa::kGeneric;
  const char* asked = std::getenv("PYALLREDUCE_CPU_ISA");
  if (asked == nullptr || *asked == '\0') return best;
  for (int level = 0; level <= static_cast<int>(best); ++level) {
    if (std::strcmp(asked, kIsaNames[level]) == 0) return static_cast<Isa>(level);
  }
  TORCH_CHECK(false, "pyallreduce: PYALLREDUCE_CPU_ISA=", asked, ": this CPU supports up to ",
              kIsaNames[static_cast<int>(best)], " (one of generic, avx2, avx512 at most that)");
}

Isa cpu_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

// fp32 without AVX2: plain conversions (the compiler vectorises with SSE2).
void reduce_f32_generic(const float* const* s, int w, float* d, float* d2, int64_t n, bool avg) {
  reduce_tiles(s, w, d, d2, n, avg);
}

// fp32, 4 vectors of 8 (AVX2) or 16 (AVX-512) lanes per step, the sum in
// registers: loads of every source, adds in rank order, one store (two with
// d2). Each vector's W loads come before its store, so d may be one of the
// sources (in place). reduce_tiles' L1 accumulator tile cost four extra L1
// passes per element, which made the reduction, not the memory, the limit.
#define PYALLREDUCE_REDUCE_F32(NAME, TARGET, VEC, LANES, LOAD, STORE, ADD, DIV, SET1)                    \
  __attribute__((target(TARGET))) void NAME(const float* const* s, int w, float* d, float* d2, int64_t n, \
                                            bool avg) {                                                  \
    const VEC wv = SET1(static_cast<float>(w));                                                          \
    int64_t i = 0;                                                                                       \
    for (; i + 4 * (LANES) <= n; i += 4 * (LANES)) {                                                     \
      VEC a0 = LOAD(s[0] + i), a1 = LOAD(s[0] + i + (LANES)), a2 = LOAD(s[0] + i + 2 * (LANES)),         \
          a3 = LOAD(s[0] + i + 3 * (LANES));                                                             \
      for (int q = 1; q < w; ++q) {                                                                      \
        a0 = ADD(a0, LOAD(s[q] + i));                                                                    \
        a1 = ADD(a1, LOAD(s[q] + i + (LANES)));                                                          \
        a2 = ADD(a2, LOAD(s[q] + i + 2 * (LANES)));                                                      \
        a3 = ADD(a3, LOAD(s[q] + i + 3 * (LANES)));                                                      \
      }                                                                                                  \
      if (avg) {                                                                                         \
        a0 = DIV(a0, wv), a1 = DIV(a1, wv), a2 = DIV(a2, wv), a3 = DIV(a3, wv);                          \
      }                                                                                                  \
      STORE(d + i, a0), STORE(d + i + (LANES), a1), STORE(d + i + 2 * (LANES), a2),                      \
          STORE(d + i + 3 * (LANES), a3);                                                                \
      if (d2 != nullptr) {                                                                               \
        STORE(d2 + i, a0), STORE(d2 + i + (LANES), a1), STORE(d2 + i + 2 * (LANES), a2),                 \
            STORE(d2 + i + 3 * (LANES), a3);                                                             \
      }                                                                                                  \
    }                                                                                                    \
    if (i < n) reduce_tail(s, w, d, d2, i, n, avg);                                                      \
  }
PYALLREDUCE_REDUCE_F32(reduce_f32_avx2, "avx2", __m256, 8, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_add_ps,
                       _mm256_div_ps, _mm256_set1_ps)
PYALLREDUCE_REDUCE_F32(reduce_f32_avx512, "avx512f", __m512, 16, _mm512_loadu_ps, _mm512_storeu_ps,
                       _mm512_add_ps, _mm512_div_ps, _mm512_set1_ps)
#undef PYALLREDUCE_REDUCE_F32

void reduce_f32(const char* const* s, int w, char* d, char* d2, int64_t n, bool avg) {
  const auto* src = reinterpret_cast<const float* const*>(s);
  auto* dst = reinterpret_cast<float*>(d);
  auto* dst2 = reinterpret_cast<float*>(d2);
  switch (cpu_isa()) {
    case Isa::kAvx512: return reduce_f32_avx512(src, w, dst, dst2, n, avg);
    case Isa::kAvx2: return reduce_f32_avx2(src, w, dst, dst2, n, avg);
    default: return reduce_f32_generic(src, w, dst, dst2, n, avg);
  }
}

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
  if (cpu_isa() >= Isa::kAvx2) {
    reduce_bf16_avx2(reinterpret_cast<const uint16_t* const*>(s), w, reinterpret_cast<uint16_t*>(d),
                     reinterpret_cast<uint16_t*>(d2), n, avg);
  } else {
    reduce_bf16_generic(reinterpret_cast<const Bf16* const*>(s), w, reinterpret_cast<Bf16*>(d),
                        reinterpret_cast<Bf16*>(d2), n, avg);
  }
}

void reduce_f16(const char* const* s, int w, char* d, char* d2, int64_t n, bool avg) {
  if (cpu_isa() >= Isa::kAvx2) {
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
      return reduce_f32(s, world, dst, dst2, n, average);
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

// What one round learnt about waiting (see run_rounds).
struct RoundWaits {
  bool contended = false;    // some rank's descriptor says its cores are contended
  bool long_start = false;   // this rank waited long in the start barrier
  bool long_mid = false;     // ... in the mid barrier
};

// One protocol round (one epoch) over bytes [0, bytes) of src into dst;
// `call` describes the whole call (protocol.h CallDesc), the same in every round.
RoundWaits all_reduce_round(Context& ctx, CallDesc call, at::ScalarType dtype, const char* src, char* dst,
                            int64_t bytes, int64_t algo, bool average) {
  RoundWaits waits;
  const int64_t elem = at::elementSize(dtype);
  const int world = ctx.world_size;
  call.epoch = next_epoch(ctx);
  const uint32_t e = call.epoch;
  const int64_t staging = staging_offset(e, ctx.max_bytes);
  char* bufs[kMaxRanks];
  for (int q = 0; q < world; ++q) bufs[q] = ctx.regions[q] + staging;
  char* own = bufs[ctx.rank];

  if (algo == kOneShot) {
    parallel_copy(own, src, bytes);
    waits.contended = start_call(ctx, call, false, &waits.long_start);
    at::parallel_for(0, bytes / elem, kParallelGrainBytes / elem, [&](int64_t b, int64_t end) {
      reduce_range(dtype, bufs, world, dst, nullptr, b * elem, end * elem, average);
    });
    return waits;
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
  // Only the peers' slices of the input go to the staging buffer: this rank
  // alone reads its own slice, from the input itself (in place too: each tile
  // is read before its result is stored). A copy of S / W fewer per round.
  const int64_t own_begin = slice_begin(ctx.rank), own_end = slice_begin(ctx.rank + 1);
  parallel_copy(own, src, own_begin);
  parallel_copy(own + own_end, src + own_end, bytes - own_end);
  waits.contended = start_call(ctx, call, true, &waits.long_start);
  char* sources[kMaxRanks];
  std::copy(bufs, bufs + world, sources);
  sources[ctx.rank] = const_cast<char*>(src);
  for_slice(ctx.rank, [&](int64_t b, int64_t end) {
    reduce_range(dtype, sources, world, dst, own, b, end, average);
  });
  signal_peers(ctx, {kMidFlagsOffset}, e);
  waits.long_mid = wait_reached(ctx, kMidFlagsOffset, e, "mid");
  for (int i = 1; i < world; ++i) {
    const int q = (ctx.rank + i) % world;  // ranks start on different owners
    for_slice(q, [&](int64_t b, int64_t end) { std::memcpy(dst + b, bufs[q] + b, end - b); });
  }
  return waits;
}

// Large messages go in rounds of ctx.round_bytes: each round's staging copy is still
// in cache when the peers read it, where one round over the whole message would
// have evicted its start by then (L2 is a few MiB). Costs a barrier or two per
// round, which is cheap while every rank has a core to itself, and not when the
// ranks share cores with other busy processes: then each barrier waits for a
// descheduled peer to get a core back. So a rank that waited long inside a
// call (it slept on the futex; where the ranks outnumber their cores, a yield
// lost a slice instead, wait_reached: there the ranks' own hand-overs are
// yields, cheap enough that rounds still win) says so in the descriptors of
// its next kContendedCalls calls (kDescContended), and after a call in which
// any rank said so, every rank runs its next call in as few rounds as staging
// allows.
// Every rank reads the same descriptors, so the ranks always agree on the rounds.
//
// run_rounds calls round(done, len) for [0, total) in pieces of round_len, or
// merged_len after contention, and keeps that bookkeeping.
template <typename Round>
void run_rounds(Context& ctx, int64_t total, int64_t round_len, int64_t merged_len, Round&& round) {
  const int64_t len = ctx.merge_rounds ? merged_len : round_len;
  bool any_contended = false, long_inside = false;
  for (int64_t done = 0; done < total; done += len) {
    const RoundWaits waits = round(done, std::min(len, total - done));
    any_contended = any_contended || waits.contended;
    // The first wait of a call also waits for ranks still computing: not contention.
    long_inside = long_inside || waits.long_mid || (done > 0 && waits.long_start);
  }
  ctx.merge_rounds = any_contended;
  ctx.contended_calls = long_inside ? kContendedCalls : std::max(0, ctx.contended_calls - 1);
}

// One round of a reduce-scatter (protocol.h kReduceScatter) over bytes
// [a, a + len) of every segment of S bytes: the peers' pieces of the input go
// to staging, `stride` apart; this rank's piece, which only it reads, is
// reduced from the input itself (also when out is that very piece: each
// vector is loaded before its sum is stored).
RoundWaits reduce_scatter_round(Context& ctx, CallDesc call, at::ScalarType dtype, const char* src, char* dst,
                                int64_t segment, int64_t a, int64_t len, bool average) {
  RoundWaits waits;
  const int world = ctx.world_size;
  const int64_t elem = at::elementSize(dtype);
  const int64_t stride = (len + kSliceAlignBytes - 1) / kSliceAlignBytes * kSliceAlignBytes;
  call.epoch = next_epoch(ctx);
  const int64_t staging = staging_offset(call.epoch, ctx.max_bytes);
  char* own = ctx.own_region() + staging;
  for (int q = 0; q < world; ++q) {
    if (q != ctx.rank) parallel_copy(own + q * stride, src + q * segment + a, len);
  }
  waits.contended = start_call(ctx, call, false, &waits.long_start);
  char* sources[kMaxRanks];
  for (int q = 0; q < world; ++q) sources[q] = ctx.regions[q] + staging + ctx.rank * stride;
  sources[ctx.rank] = const_cast<char*>(src) + ctx.rank * segment + a;
  at::parallel_for(0, len / elem, kParallelGrainBytes / elem, [&](int64_t b, int64_t end) {
    reduce_range(dtype, sources, world, dst + a, nullptr, b * elem, end * elem, average);
  });
  return waits;
}

// One round of an all-gather (protocol.h kAllGather): bytes [a, a + len) of
// the input to staging, then that piece of every peer's into its segment of
// out. This rank's own piece comes from the input (nothing to do when the
// input is that segment of out).
RoundWaits all_gather_round(Context& ctx, CallDesc call, const char* src, char* dst, int64_t segment, int64_t a,
                            int64_t len) {
  RoundWaits waits;
  call.epoch = next_epoch(ctx);
  const int64_t staging = staging_offset(call.epoch, ctx.max_bytes);
  parallel_copy(ctx.own_region() + staging, src + a, len);
  waits.contended = start_call(ctx, call, false, &waits.long_start);
  for (int i = 0; i < ctx.world_size; ++i) {
    const int q = (ctx.rank + i) % ctx.world_size;  // ranks start on different peers
    char* to = dst + q * segment + a;
    const char* from = q == ctx.rank ? src + a : ctx.regions[q] + staging;
    if (to != from) parallel_copy(to, from, len);
  }
  return waits;
}

void host_collective(Context& ctx, const at::Tensor& input, at::Tensor& out, int64_t algo, bool average) {
  const auto* src = static_cast<const char*>(input.data_ptr());
  auto* dst = static_cast<char*>(out.data_ptr());
  const bool scatters = algo == kReduceScatter, gathers = algo == kAllGather;
  const int64_t segment = scatters ? out.nbytes() : input.nbytes();
  const bool in_place = collective_in_place(reinterpret_cast<uintptr_t>(src), reinterpret_cast<uintptr_t>(dst),
                                            segment, ctx.rank, algo);
  const int64_t bytes = scatters || gathers ? ctx.world_size * segment : segment;
  const uint32_t kind = desc_kind(dtype_code(input.scalar_type()), algo, kModeStaged, average, in_place) |
                        (ctx.contended_calls > 0 ? kDescContended : 0u);
  const CallDesc call{static_cast<uint64_t>(bytes), 0, kind};
  if (!(scatters || gathers)) {
    return run_rounds(ctx, bytes, ctx.round_bytes, bytes, [&](int64_t done, int64_t len) {
      return all_reduce_round(ctx, call, input.scalar_type(), src + done, dst + done, len, algo, average);
    });
  }
  // A round moves a piece of every segment: W pieces of round_bytes / W, as
  // much traffic as an all-reduce round; merged, as much as staging holds.
  // Multiples of kSliceAlignBytes, which every element size divides.
  auto piece = [&](int64_t total) {
    return std::max(kSliceAlignBytes, total / ctx.world_size / kSliceAlignBytes * kSliceAlignBytes);
  };
  const int64_t round_len = piece(std::min(ctx.round_bytes, ctx.max_bytes));
  if (scatters) {
    return run_rounds(ctx, segment, round_len, piece(ctx.max_bytes), [&](int64_t a, int64_t len) {
      return reduce_scatter_round(ctx, call, input.scalar_type(), src, dst, segment, a, len, average);
    });
  }
  run_rounds(ctx, segment, round_len, ctx.max_bytes, [&](int64_t a, int64_t len) {
    return all_gather_round(ctx, call, src, dst, segment, a, len);
  });
}

void host_agree(Context& ctx, CallDesc desc) {
  desc.epoch = next_epoch(ctx);
  bool long_wait;
  start_call(ctx, desc, false, &long_wait);
}

}  // namespace

const char* host_isa() { return kIsaNames[static_cast<int>(cpu_isa())]; }

}  // namespace pyallreduce

PYALLREDUCE_REGISTER_BACKEND(CPU, ::pyallreduce::host_collective)
static const bool pyallreduce_agree_cpu =
    ::pyallreduce::register_agree_impl(c10::DeviceType::CPU, ::pyallreduce::host_agree);
