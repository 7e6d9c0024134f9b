// CUDA on the host, just enough to run csrc/cuda/all_reduce.cuh unchanged
// with g++ (the verification ladder's "CUDA kernels on a host shim" rung,
// docs/verification.md). Include it before the kernel header.
//
// * Each CUDA thread is a ucontext fiber; a block's kThreads fibers run on one
//   OS thread and switch only at __syncthreads() and at the flag operations of
//   csrc/cuda/device_ops.h (sim::flag_point), in an order that changes every
//   round (seeded), so code that needs a __syncthreads it lacks sees other
//   threads' work missing.
// * Each block is an OS thread, all blocks of a launch run concurrently, and a
//   launch returns when they all finished (a stream's launches are ordered).
// * __shared__ is per OS thread, i.e. per block: `static thread_local`.
// * int4, __half, __nv_bfloat16 and their conversions are NVIDIA's own host
//   code from the toolkit's headers.
// * A __syncthreads() that some threads of the block can no longer reach
//   (they returned) aborts: the kernels must leave a block together.
//
// Under ASan and TSan the fiber switches are announced to the sanitizer.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <sched.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define SIM_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#define SIM_TSAN 1
#endif

#undef __shared__
#define __shared__ static thread_local
#undef __global__
#define __global__
#define __launch_bounds__(...)

inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
// IEEE division, round to nearest: what div.rn.f32 does (the harness builds
// with SSE arithmetic, no x87 excess precision).
inline float __fdiv_rn(float a, float b) { return a / b; }

namespace sim {

// Knobs of the launches made by the calling thread (a rank), copied into the
// launch's block threads.
struct LaunchOptions {
  uint64_t seed = 1;          // fiber order and delays
  int flag_sleep_us = 0;      // sleep this long at some flag operations (a slow rank)
  int flag_sleep_percent = 0; // ... at this share of them
};
inline thread_local LaunchOptions options;

#if defined(SIM_ASAN) || defined(SIM_TSAN)
constexpr size_t kStackBytes = 256 * 1024;
#else
constexpr size_t kStackBytes = 64 * 1024;
#endif

// Stacks for one block's fibers, reused across launches (mmap is slow, and
// the touched pages stay warm), and under TSan the fibers' TSan states
// (creating one is expensive).
struct StackArena {
  char* base = nullptr;
  int count = 0;
#if defined(SIM_TSAN)
  std::vector<void*> tsan;
#endif
};
inline std::mutex arena_mutex;
inline std::vector<StackArena> free_arenas;

inline StackArena take_arena(int count) {
  {
    std::lock_guard<std::mutex> lock(arena_mutex);
    for (size_t i = 0; i < free_arenas.size(); ++i) {
      if (free_arenas[i].count == count) {
        StackArena a = free_arenas[i];
        free_arenas.erase(free_arenas.begin() + long(i));
        return a;
      }
    }
  }
  void* p = mmap(nullptr, kStackBytes * size_t(count), PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("sim: mmap of fiber stacks");
    std::abort();
  }
  StackArena a;
  a.base = static_cast<char*>(p);
  a.count = count;
#if defined(SIM_TSAN)
  for (int t = 0; t < count; ++t) a.tsan.push_back(__tsan_create_fiber(0));
#endif
  return a;
}
inline void give_arena(StackArena a) {
  std::lock_guard<std::mutex> lock(arena_mutex);
  free_arenas.push_back(a);
}

enum class FiberState { kRunnable, kAtBarrier, kDone };

struct Fiber {
  ucontext_t context;
  FiberState state = FiberState::kRunnable;
  uint3 tid{};
#if defined(SIM_TSAN)
  void* tsan = nullptr;
#endif
#if defined(SIM_ASAN)
  void* fake_stack = nullptr;
#endif
};

struct BlockRun {
  ucontext_t scheduler;
  std::vector<Fiber> fibers;
  int current = -1;
  uint3 block_idx{};
  uint3 grid_dim{};
  void (*body)(const void*) = nullptr;
  const void* args = nullptr;
  LaunchOptions opts;
  uint64_t rng = 0;
#if defined(SIM_TSAN)
  void* tsan_scheduler = nullptr;
#endif
#if defined(SIM_ASAN)
  void* scheduler_fake_stack = nullptr;
  const void* scheduler_stack_bottom = nullptr;
  size_t scheduler_stack_size = 0;
#endif

  uint64_t random() {  // xorshift64*
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return rng * 2685821657736338717ull;
  }
};

inline thread_local BlockRun* block = nullptr;

inline Fiber& this_fiber() { return block->fibers[size_t(block->current)]; }

// Fiber -> scheduler.
inline void switch_to_scheduler(bool exiting) {
  BlockRun* b = block;
  Fiber& f = this_fiber();
#if defined(SIM_ASAN)
  __sanitizer_start_switch_fiber(exiting ? nullptr : &f.fake_stack, b->scheduler_stack_bottom,
                                 b->scheduler_stack_size);
#endif
#if defined(SIM_TSAN)
  __tsan_switch_to_fiber(b->tsan_scheduler, 0);
#endif
  (void)exiting;
  swapcontext(&f.context, &b->scheduler);
#if defined(SIM_ASAN)
  __sanitizer_finish_switch_fiber(f.fake_stack, &b->scheduler_stack_bottom, &b->scheduler_stack_size);
#endif
}

inline void fiber_entry() {
#if defined(SIM_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &block->scheduler_stack_bottom, &block->scheduler_stack_size);
#endif
  block->body(block->args);
  this_fiber().state = FiberState::kDone;
  switch_to_scheduler(true);
  std::abort();  // never resumed
}

// A flag operation: let the block's other threads run (and, now and then,
// pretend this rank is slow).
inline void flag_point() {
  BlockRun* b = block;
  if (b == nullptr || b->current < 0) return;
  if (b->opts.flag_sleep_us > 0 && int(b->random() % 100) < b->opts.flag_sleep_percent) {
    std::this_thread::sleep_for(std::chrono::microseconds(b->opts.flag_sleep_us));
  }
  switch_to_scheduler(false);
}

inline void sync_threads() {
  this_fiber().state = FiberState::kAtBarrier;
  switch_to_scheduler(false);
}

// Runs one block to completion on the calling OS thread.
inline void run_block(BlockRun& b, int threads) {
  block = &b;
  b.fibers.assign(size_t(threads), Fiber{});
  StackArena arena = take_arena(threads);
#if defined(SIM_TSAN)
  b.tsan_scheduler = __tsan_get_current_fiber();
#endif
  for (int t = 0; t < threads; ++t) {
    Fiber& f = b.fibers[size_t(t)];
    f.tid = uint3{uint32_t(t), 0, 0};
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = arena.base + kStackBytes * size_t(t);
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = nullptr;
    makecontext(&f.context, fiber_entry, 0);
#if defined(SIM_TSAN)
    f.tsan = arena.tsan[size_t(t)];
#endif
  }
  int done = 0;
  while (done < threads) {
    int at_barrier = 0;
    done = 0;
    // Each round visits the runnable fibers from a random start, in a random
    // direction.
    const int start = int(b.random() % uint64_t(threads));
    const int step = (b.random() & 1) ? 1 : threads - 1;
    bool spinning = false;
    for (int i = 0, t = start; i < threads; ++i, t = (t + step) % threads) {
      Fiber& f = b.fibers[size_t(t)];
      if (f.state == FiberState::kRunnable) {
        b.current = t;
#if defined(SIM_ASAN)
        __sanitizer_start_switch_fiber(&b.scheduler_fake_stack, arena.base + kStackBytes * size_t(t),
                                       kStackBytes);
#endif
#if defined(SIM_TSAN)
        __tsan_switch_to_fiber(f.tsan, 0);
#endif
        swapcontext(&b.scheduler, &f.context);
#if defined(SIM_ASAN)
        __sanitizer_finish_switch_fiber(b.scheduler_fake_stack, nullptr, nullptr);
#endif
        b.current = -1;
        spinning = spinning || f.state == FiberState::kRunnable;
      }
      if (f.state == FiberState::kAtBarrier) ++at_barrier;
      if (f.state == FiberState::kDone) ++done;
    }
    if (at_barrier > 0 && at_barrier + done == threads) {
      if (done > 0) {
        std::fprintf(stderr, "sim: block %u: __syncthreads() with %d of %d threads returned\n",
                     b.block_idx.x, done, threads);
        std::abort();
      }
      for (Fiber& f : b.fibers) f.state = FiberState::kRunnable;
    } else if (spinning) {
      std::this_thread::yield();  // only flag waiters left running: let other blocks/ranks go
    }
  }
  give_arena(arena);
  block = nullptr;
}

// Called with true before a launch runs and false after it finished, when
// set: the emulated CUDA runtime (tests/emulated) opens device memory to the
// host only while device work runs.
inline void (*device_work_hook)(bool running) = nullptr;

// kernel<<<nblocks, threads>>>(args), returning when the kernel finished.
template <typename Args>
void launch(void (*kernel)(Args), int nblocks, int threads, const Args& args) {
  if (device_work_hook != nullptr) device_work_hook(true);
  struct Thunk {
    void (*kernel)(Args);
    const Args* args;
  };
  static thread_local Thunk thunk;  // read by this launch's blocks only, before it returns
  thunk = Thunk{kernel, &args};
  const Thunk* t = &thunk;
  const LaunchOptions opts = options;
  std::vector<std::thread> blocks;
  blocks.reserve(size_t(nblocks));
  for (int bi = 0; bi < nblocks; ++bi) {
    blocks.emplace_back([t, bi, nblocks, threads, opts] {
      BlockRun b;
      b.block_idx = uint3{uint32_t(bi), 0, 0};
      b.grid_dim = uint3{uint32_t(nblocks), 1, 1};
      b.opts = opts;
      b.rng = opts.seed * 0x9E3779B97F4A7C15ull + uint64_t(bi) * 0xBF58476D1CE4E5B9ull + 1;
      b.args = t;
      b.body = [](const void* p) {
        const Thunk* th = static_cast<const Thunk*>(p);
        th->kernel(*th->args);
      };
      run_block(b, threads);
    });
  }
  for (std::thread& th : blocks) th.join();
  if (device_work_hook != nullptr) device_work_hook(false);
}

// Set by the emulated CUDA runtime (tests/emulated): a launch is enqueued on
// its stream and runs there, after the launching call returned, as on a GPU
// (or is recorded into a graph being captured, and runs at each replay; the
// runtime calls `destroy` when it needs the launch no more). Unset (the
// harness), a launch runs at once and returns when it finished.
inline void (*stream_enqueue_hook)(cudaStream_t, void (*run)(void*), void (*destroy)(void*), void*) = nullptr;

template <typename Args>
void launch_on(cudaStream_t stream, void (*kernel)(Args), int nblocks, int threads, const Args& args) {
  if (stream_enqueue_hook == nullptr) return launch(kernel, nblocks, threads, args);
  struct Work {  // the arguments are copied at the launch, as CUDA copies them
    void (*kernel)(Args);
    int nblocks, threads;
    Args args;
    LaunchOptions opts;
  };
  stream_enqueue_hook(
      stream,
      [](void* p) {
        const Work* w = static_cast<const Work*>(p);
        options = w->opts;
        launch(w->kernel, w->nblocks, w->threads, w->args);
      },
      [](void* p) { delete static_cast<Work*>(p); }, new Work{kernel, nblocks, threads, args, options});
}

}  // namespace sim

#define threadIdx (::sim::this_fiber().tid)
#define blockIdx (::sim::block->block_idx)
#define gridDim (::sim::block->grid_dim)
inline void __syncthreads() { sim::sync_threads(); }
