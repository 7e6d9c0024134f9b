"""Python side of the torch.ops.pyallreduce schemas (defined in csrc/module.cpp):
fake implementations, so torch.compile can trace calls without running them."""
import torch

from . import _C  # noqa: F401  (the schemas must exist before register_fake)


@torch.library.register_fake("pyallreduce::all_reduce")
def _all_reduce_fake(input, handle, algo, average):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


@torch.library.register_fake("pyallreduce::all_reduce_out")
def _all_reduce_out_fake(input, out, handle, algo, average):
    return None


@torch.library.register_fake("pyallreduce::all_reduce_")
def _all_reduce_inplace_fake(tensor, handle, algo, average):
    return None


@torch.library.register_fake("pyallreduce::reduce_scatter_out")
def _reduce_scatter_out_fake(input, out, handle, average):
    return None


@torch.library.register_fake("pyallreduce::all_gather_out")
def _all_gather_out_fake(input, out, handle):
    return None
