"""The protocol's rules in Python, each stated once (csrc/common/protocol.h is
the spec and the C++ side's one place): the element types the reductions
take, the one aliasing reduce-scatter and all-gather allow, overlap, and the
host that makes ranks able to share memory. The communicator, ddp.py and
triton_kernels use these; the numbers (collective ids, sizes) come from
pyallreduce._C, i.e. from protocol.h itself.
"""
import os
import socket

import torch

from . import _C

# The reductions' element types (all-reduce, reduce-scatter); all-gather copies any dtype.
REDUCED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The agreement round's collective ids (an all-reduce agrees as AGREE_ONLY) -> the names users call.
COLLECTIVE_NAMES = {_C.AGREE_ONLY: "all_reduce", _C.REDUCE_SCATTER: "reduce_scatter", _C.ALL_GATHER: "all_gather"}
# Overrides the host identity (tests simulate several hosts on one machine).
HOSTNAME_ENV = "PYALLREDUCE_HOSTNAME"


def not_reduced_reason(dtype):
    """Why a reduction of `dtype` goes to torch.distributed, or None."""
    if dtype in REDUCED_DTYPES:
        return None
    return f"dtype {dtype} is not reduced by pyallreduce (float32, float16, bfloat16 are)"


def host_id():
    """This rank's host: ranks on one host share memory (POSIX shared memory,
    CUDA IPC); a group that spans hosts goes to torch.distributed."""
    return os.environ.get(HOSTNAME_ENV) or socket.gethostname()


def nbytes(tensor):
    """tensor.nbytes that also works on symbolic shapes (torch.compile)."""
    return tensor.numel() * tensor.element_size()


def overlaps(a, b):
    """Whether the memory of a and b may overlap (same storage, intersecting byte ranges)."""
    if nbytes(a) == 0 or nbytes(b) == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + nbytes(b) and b0 < a0 + nbytes(a)


def partial_overlap_problem(src, dst):
    """The error for an all-reduce whose out overlaps its input without being
    the same memory, or None (csrc/module.cpp's rule): the kernels and the
    rounds would read input that out has already overwritten."""
    same = src.data_ptr() == dst.data_ptr() and src.shape == dst.shape and src.stride() == dst.stride()
    if not same and overlaps(src, dst):
        return "pyallreduce: out overlaps the input; pass the same tensor (all_reduce_) or a separate one"
    return None


def is_own_segment(part, whole, rank):
    """Whether `part` is exactly segment `rank` of `whole`: the one overlap of
    input and out that reduce-scatter (part = out) and all-gather (part =
    input) accept (protocol.h is_own_segment). Both contiguous, part not
    empty."""
    size = nbytes(part)
    return (size > 0 and part.is_contiguous() and whole.is_contiguous()
            and part.data_ptr() == whole.data_ptr() + rank * size)


def described_bytes(collective, src, dst, rank):
    """A call descriptor's (bytes, in place) (protocol.h CallDesc): an
    all-reduce's tensor; for reduce-scatter and all-gather the W segments,
    and "in place" is the one overlap their kernels allow."""
    if collective == _C.AGREE_ONLY:  # an all-reduce
        return nbytes(src), dst is src
    whole, part = (src, dst) if collective == _C.REDUCE_SCATTER else (dst, src)
    return nbytes(whole), is_own_segment(part, whole, rank)


def staged_piece_bytes(max_bytes, world_size, collective, element_size):
    """The GPU backends stage a whole call: the most bytes of each segment one
    reduce-scatter/all-gather moves (a multiple of the element size), 0 if not
    one element fits (protocol.h: reduce-scatter stages W segments, each
    padded to SEGMENT_UNIT)."""
    if collective == _C.REDUCE_SCATTER:
        per = max_bytes // world_size // _C.SEGMENT_UNIT * _C.SEGMENT_UNIT
    else:
        per = max_bytes
    return per // element_size * element_size
