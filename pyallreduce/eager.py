"""The eager fast path: an eager call whose tensors fit a kernel as they are
runs in one C++ call, without the dispatcher's argument boxing and without
the Communicator's general path. The all-reduce is one C++ callable made per
communicator (`pyallreduce._C.eager_all_reduce`, csrc/module.cpp), which
decides the whole call itself; reduce-scatter and all-gather go through
`_C.try_collective_eager`. The torch.distributed backend's eager calls take
the same entry from C++ (csrc/backend.cpp, given backend_args()).

It decides nothing of its own: an "auto" call's kernel is the Communicator's
crossover row's, and whatever the kernels would not take as it is (an op,
dtype or algo the general path must check, a size the reference wins, a
tensor subclass; dispatch and torch function modes, the JIT tracer and
functorch wrappers, which the C++ side declines) is declined having done
nothing, and the Communicator's general path decides. Under torch.compile
the Communicator does not call it (torch.compiler.is_dynamo_compiling(),
which Dynamo reads as True, is checked first): compiled code runs the op.
"""
from __future__ import annotations

import torch

from . import _C


def declined(*args):
    """The all-reduce of a communicator without an eager path: declines every call."""
    return None


class EagerPath:
    """One communicator's eager calls: its C++ context and crossover row, read
    once at construction. OFF, without a context, declines every call: a
    fallback, the debug mode, an engine without a C++ context (Triton), a
    closed communicator.

    all_reduce(src, dst, op, algo): dst = all_reduce(src) (dst None: a new
    tensor) and returns dst; or returns None having done nothing."""
    __slots__ = ("handle", "crossover", "all_reduce")

    def __init__(self, handle, crossover):
        self.handle, self.crossover = handle, crossover
        self.all_reduce = declined if handle is None else _C.eager_all_reduce(handle, *self._crossover_args())

    def _crossover_args(self):
        reference_min = self.crossover.reference_min_bytes
        return self.crossover.two_shot_min_bytes, -1 if reference_min is None else reference_min

    def scatter_or_gather(self, collective, src, dst, average):
        """Whether it ran dst = reduce_scatter(src) or all_gather(src)
        (collective: _C.REDUCE_SCATTER, _C.ALL_GATHER; average None: an op the
        general path rejects)."""
        handle = self.handle
        return (handle is not None and average is not None and type(src) is type(dst) is torch.Tensor
                and not torch.compiler.is_dynamo_compiling()
                and _C.try_collective_eager(src, dst, handle, collective, average))

    def backend_args(self):
        """What the backend's C++ path needs to run these calls as this does
        (ServingBackend.set_fast): (context handle, two_shot_min_bytes,
        reference_min_bytes or -1); None where no call goes direct."""
        if self.handle is None:
            return None
        return self.handle, *self._crossover_args()


OFF = EagerPath(None, None)
