// POSIX shared-memory segments for the host transport (pyallreduce/transport.py
// decides names and lifetime; this only creates, maps and removes).
#pragma once

#include <torch/extension.h>

namespace pyallreduce {
void bind_shm(pybind11::module_& m);
}
