// The only translation unit with device code: instantiates every kernel of
// all_reduce.cuh (3 element types x world sizes 1..8 x one-shot/two-shot x
// with/without a graph-table entry; reduce-scatter per element type; all-gather
// per word size) behind the launchers kernel_api.h declares. No torch header
// here, so nvcc's per-architecture passes stay short. tests/test_cuda_build.py
// checks what it compiles to, read from the built extension (cuobjdump).
#include "all_reduce.cuh"

namespace pyallreduce {
namespace cuda {
namespace kernels {

namespace {
template <typename F>
bool with_element(Element element, F f) {
  switch (element) {
    case Element::kFloat32: return f(float{});
    case Element::kFloat16: return f(__half{});
    case Element::kBFloat16: return f(__nv_bfloat16{});
  }
  return false;
}

template <int W>
cudaError_t fewest_blocks_for_world(int* fewest) {
  cudaError_t err = cudaSuccess;
  auto query = [&](auto kernel) {
    int n = 0;
    if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0);
    if (err == cudaSuccess && n < *fewest) *fewest = n;
  };
  auto for_type = [&](auto zero) {
    using T = decltype(zero);
    query(one_shot_kernel<T, W, false>);
    query(one_shot_kernel<T, W, true>);
    query(two_shot_kernel<T, W, false>);
    query(two_shot_kernel<T, W, true>);
    query(reduce_scatter_kernel<T, W>);
  };
  for_type(float{});
  for_type(__half{});
  for_type(__nv_bfloat16{});
  query(all_gather_kernel<uint8_t, W>);
  query(all_gather_kernel<uint16_t, W>);
  query(all_gather_kernel<uint32_t, W>);
  query(all_gather_kernel<uint64_t, W>);
  return err;
}
}  // namespace

bool all_reduce(Element element, int world_size, const Call& call, int nblocks, cudaStream_t stream) {
  return with_element(element, [&](auto zero) {
    return launch_all_reduce<decltype(zero)>(world_size, call, nblocks, stream);
  });
}

bool reduce_scatter(Element element, int world_size, const Call& call, int nblocks, cudaStream_t stream) {
  return with_element(element, [&](auto zero) {
    return launch_reduce_scatter<decltype(zero)>(world_size, call, nblocks, stream);
  });
}

bool all_gather(int world_size, const Call& call, int nblocks, cudaStream_t stream) {
  return launch_all_gather(world_size, call, nblocks, stream);
}

cudaError_t fewest_resident_blocks_per_sm(int world_size, int* blocks) {
  *blocks = INT32_MAX;
  cudaError_t err = cudaErrorInvalidValue;
  with_world_size(world_size, [&](auto w) { err = fewest_blocks_for_world<decltype(w)::value>(blocks); });
  return err;
}

}  // namespace kernels
}  // namespace cuda
}  // namespace pyallreduce
