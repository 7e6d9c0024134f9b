// The operations of csrc/cuda/all_reduce.cuh that are not plain C++, in two
// forms: inline PTX for the GPU (nvcc), and host forms for tests/sim, the
// CUDA-on-host harness that runs the same kernel source with g++ (each CUDA
// thread a fiber, each block an OS thread: tests/sim/cuda_shim.h, which must be
// included first and supplies the CUDA keywords and sim::launch).
//
// Keep this list short and each host form the strongest reading of its PTX:
// the harness proves the kernels right only up to these equivalences (PTX
// scopes, NVLink visibility and co-residency stay unproven: docs/verification.md).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#else
#include <chrono>
#endif

namespace pyallreduce {
namespace cuda {

#if defined(__CUDACC__)

// System scope: the other side is another process, maybe on another GPU.
__device__ __forceinline__ void store_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(__cvta_generic_to_global(p)), "r"(v)
               : "memory");
}
__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];"
               : "=r"(v)
               : "l"(__cvta_generic_to_global(p))
               : "memory");
  return v;
}
// A word of this device's memory that another block may write meanwhile
// (Call::gave_up): atomic, no ordering.
__device__ __forceinline__ uint32_t load_relaxed_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(__cvta_generic_to_global(p)) : "memory");
  return v;
}
__device__ __forceinline__ void store_relaxed_gpu(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(__cvta_generic_to_global(p)), "r"(v) : "memory");
}
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// True for the one caller that raises *word (device memory) to `generation`
// from below it: the first writer of a status record's generation wins
// (kernel_api.h CallStatus). Device scope: only this process's kernels write
// its status record.
__device__ __forceinline__ bool claim_record(uint32_t* word, uint32_t generation) {
  return atomicMax(word, generation) < generation;
}

// Every kernel launch of the header goes through here (the harness runs the
// blocks on host threads instead).
template <typename Args>
inline void launch(void (*kernel)(Args), int nblocks, int threads, cudaStream_t stream,
                   const Args& args) {
  kernel<<<nblocks, threads, 0, stream>>>(args);
}

#else  // host forms for tests/sim

inline void store_release_sys(uint32_t* p, uint32_t v) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
  sim::flag_point();  // a peer may be waiting on it: let others run
}
inline uint32_t load_acquire_sys(const uint32_t* p) {
  sim::flag_point();  // a spin: let the block's other threads (and other blocks) run
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
inline uint32_t load_relaxed_gpu(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
inline void store_relaxed_gpu(uint32_t* p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
inline uint64_t global_timer_ns() {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch())
                      .count());
}
inline bool claim_record(uint32_t* word, uint32_t generation) {
  uint32_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
  while (seen < generation) {
    if (__atomic_compare_exchange_n(word, &seen, generation, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) return true;
  }
  return false;
}
template <typename Args>
inline void launch(void (*kernel)(Args), int nblocks, int threads, cudaStream_t stream,
                   const Args& args) {
  sim::launch_on(stream, kernel, nblocks, threads, args);
}

#endif

}  // namespace cuda
}  // namespace pyallreduce
