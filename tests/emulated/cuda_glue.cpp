// csrc/cuda/all_reduce.cpp under another name: torch's extension builder names
// objects by file name, and csrc/cpu/all_reduce.cpp is in the same build.
#include "../../csrc/cuda/all_reduce.cpp"
