// The "pyallreduce" torch.distributed backend's C++ base class (backend.cpp).
#pragma once

namespace pybind11 {
class module_;
}

namespace pyallreduce {

// Adds ServingBackend to pyallreduce._C.
void bind_backend(pybind11::module_& m);

}  // namespace pyallreduce
