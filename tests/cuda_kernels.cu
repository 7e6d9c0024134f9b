// Instantiates every kernel of csrc/cuda/all_reduce.cuh (3 dtypes x world
// sizes 1..8 x one-shot/two-shot x with/without a graph-table entry; the
// reduce-scatter kernels of the 3 dtypes and the all-gather kernels of the 4
// word sizes, x world sizes 1..8) through the same launchers that
// csrc/cuda/all_reduce.cu calls, without
// torch, so tests/test_cuda_build.py can check ptxas's report and the PTX
// quickly on a machine without a GPU.
#include "cuda/all_reduce.cuh"

namespace pyallreduce {
namespace cuda {
template bool launch_all_reduce<float>(int, const Call&, int, cudaStream_t);
template bool launch_all_reduce<__half>(int, const Call&, int, cudaStream_t);
template bool launch_all_reduce<__nv_bfloat16>(int, const Call&, int, cudaStream_t);
template bool launch_reduce_scatter<float>(int, const Call&, int, cudaStream_t);
template bool launch_reduce_scatter<__half>(int, const Call&, int, cudaStream_t);
template bool launch_reduce_scatter<__nv_bfloat16>(int, const Call&, int, cudaStream_t);
// launch_all_gather is not a template: a use instantiates its kernels.
bool launch_all_gather_for_test(int world_size, const Call& call, int nblocks, cudaStream_t stream) {
  return launch_all_gather(world_size, call, nblocks, stream);
}
}  // namespace cuda
}  // namespace pyallreduce
