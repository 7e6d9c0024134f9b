// Instantiates every kernel of csrc/cuda/all_reduce.cuh (3 dtypes x world
// sizes 1..8 x one-shot/two-shot x with/without a graph-table entry) through
// the same launch_all_reduce() that csrc/cuda/all_reduce.cu calls, without
// torch, so tests/test_cuda_build.py can check ptxas's report and the PTX
// quickly on a machine without a GPU.
#include "cuda/all_reduce.cuh"

namespace pyallreduce {
namespace cuda {
template bool launch_all_reduce<float>(int, const Call&, int, cudaStream_t);
template bool launch_all_reduce<__half>(int, const Call&, int, cudaStream_t);
template bool launch_all_reduce<__nv_bfloat16>(int, const Call&, int, cudaStream_t);
}  // namespace cuda
}  // namespace pyallreduce
