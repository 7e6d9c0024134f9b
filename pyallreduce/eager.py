"""The eager fast path: an eager call whose tensors fit a kernel as they are
runs in one C++ call, `pyallreduce._C.try_collective_eager`, without the
dispatcher's argument boxing (about 1 µs less, half a small CPU all-reduce)
and without the Communicator's general path. The torch.distributed backend's
eager calls take the same entry from C++ (csrc/backend.cpp, given
backend_args()).

It decides nothing of its own: an "auto" call's kernel is the Communicator's
crossover row's, and whatever the kernels would not take as it is (an op,
dtype or algo the general path must check, a size the reference wins, a
tensor subclass; dispatch and torch function modes, the JIT tracer and
functorch wrappers, which the C++ side declines) is declined having done
nothing, and the Communicator's general path decides.
"""
from __future__ import annotations

import torch

from . import _C
from .arguments import ALGOS, average_or_none
from .protocol import REDUCED_DTYPES


def eager(tensor):
    """Whether the kernels may be called directly rather than through the torch
    op: a plain tensor outside torch.compile/export, which trace the op."""
    return not torch.compiler.is_compiling() and type(tensor) is torch.Tensor


class EagerPath:
    """One communicator's eager calls: its C++ context and crossover row, read
    once at construction. OFF, without a context, declines every call: a
    fallback, the debug mode, an engine without a C++ context (Triton), a
    closed communicator."""
    __slots__ = ("handle", "crossover")

    def __init__(self, handle, crossover):
        self.handle, self.crossover = handle, crossover

    def all_reduce(self, src, dst, op, algo):
        """dst = all_reduce(src) (dst None: a new tensor) and returns dst; or
        returns None having done nothing."""
        handle = self.handle
        if handle is None or not eager(src):
            return None
        average = average_or_none(op)
        if average is None or src.dtype not in REDUCED_DTYPES:
            return None
        if algo == "auto":
            nbytes = src.nbytes
            if self.crossover.prefers_reference(nbytes):
                return None
            algo = self.crossover.algo_for(nbytes)
        kernel = ALGOS.get(algo)
        if kernel is None:
            return None
        if dst is None:
            dst = torch.empty_like(src)
        elif type(dst) is not torch.Tensor:
            return None
        return dst if _C.try_collective_eager(src, dst, handle, kernel, average) else None

    def scatter_or_gather(self, collective, src, dst, average):
        """Whether it ran dst = reduce_scatter(src) or all_gather(src)
        (collective: _C.REDUCE_SCATTER, _C.ALL_GATHER; average None: an op the
        general path rejects)."""
        handle = self.handle
        return (handle is not None and average is not None and type(dst) is torch.Tensor and eager(src)
                and _C.try_collective_eager(src, dst, handle, collective, average))

    def backend_args(self):
        """What the backend's C++ path needs to run these calls as this does
        (ServingBackend.set_fast): (context handle, two_shot_min_bytes,
        reference_min_bytes or -1); None where no call goes direct."""
        if self.handle is None:
            return None
        reference_min = self.crossover.reference_min_bytes
        return self.handle, self.crossover.two_shot_min_bytes, -1 if reference_min is None else reference_min


OFF = EagerPath(None, None)
