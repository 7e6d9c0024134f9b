// The host backend's pieces bound in csrc/module.cpp: POSIX shared-memory
// segments for the host transport (pyallreduce/transport/host_shm.py decides
// names and lifetime; this only creates, maps and removes), and its ISA.
#pragma once

// pybind11 only, not torch: this file compiles in seconds instead of a minute.
#include <pybind11/pybind11.h>

namespace pyallreduce {
void bind_shm(pybind11::module_& m);
// The vector ISA the host backend's reductions use: "avx512", "avx2" or
// "generic" (csrc/cpu/all_reduce.cpp; PYALLREDUCE_CPU_ISA may lower it).
const char* host_isa();
}
