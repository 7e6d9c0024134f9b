// The torch side of the CUDA backend (adapter.cpp), as csrc/module.cpp sees
// it: the checks of a CUDA communicator and the cuda_* functions of
// pyallreduce._C. Everything below it (glue.h, runtime.h) is torch-free.
#pragma once

namespace pybind11 {
class module_;
}

namespace pyallreduce {

struct Context;

// Waits for the communicator's kernels launched so far (not while capturing)
// and raises what they recorded (cuda::check) on the current stream.
void cuda_check(Context& ctx);

// abort_context's part on CUDA: the communicator's kernels stop waiting for
// peers (cuda::interrupt). Never waits.
void cuda_interrupt(const Context& ctx);

// Whether the current stream of `device` is capturing a CUDA graph.
bool cuda_current_stream_capturing(int device);

// Adds the cuda_* functions to pyallreduce._C.
void bind_cuda(pybind11::module_& m);

}  // namespace pyallreduce
