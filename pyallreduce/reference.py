"""What the Communicator sends to torch.distributed, and how: the calls it does
not run on an engine (a group it cannot serve, a dtype without kernels, sizes
the crossover gives to the reference), and the debug mode's fingerprint
exchange. The decision to come here is the Communicator's."""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import _C, logs
from .engines import stream_capturing
from .group import backend_of
from .protocol import COLLECTIVE_NAMES

# torch >= 2.14 names the tensor forms *_single and warns on every call of the older names.
_dist_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_dist_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def announce(reason, collective, device, group):
    """Says once why a call (collective: _C.AGREE_ONLY for an all-reduce,
    REDUCE_SCATTER, ALL_GATHER) comes here, and raises before anything is
    enqueued where it cannot run now (check_capturable)."""
    if not torch.compiler.is_compiling():
        logs.log_once(f"torch.distributed used for {COLLECTIVE_NAMES[collective]}: {reason}")
        check_capturable(device, group, reason)


def run(collective, src, dst, average, group, world_size):
    """The call by torch.distributed."""
    if collective == _C.AGREE_ONLY:
        all_reduce(src, dst, average, group, world_size)
    else:
        scatter_or_gather(collective == _C.REDUCE_SCATTER, src, dst, average, group, world_size)


def _check_average(dtype, average):
    if average and dtype == torch.bool:
        raise ValueError(f"pyallreduce: op='avg' is not defined for {dtype}; use op='sum'")


def _average(total, world_size):
    """NCCL's ncclAvg: the sum divided by the ranks; integers truncated toward zero, as NCCL's are."""
    if total.dtype.is_floating_point or total.dtype.is_complex:
        total.div_(world_size)
    else:
        total.div_(world_size, rounding_mode="trunc")


def all_reduce(src, dst, average, group, world_size):
    """dst = sum (or mean) of src over the group; dst may be src."""
    _check_average(src.dtype, average)
    # `is`, not data pointers: torch.compile traces this (fallback dtypes under fullgraph=True).
    work = dst if dst is src and dst.is_contiguous() else src.contiguous().clone()
    dist.all_reduce(work, op=dist.ReduceOp.SUM, group=group)
    if average:
        _average(work, world_size)
    if work is not dst:
        dst.copy_(work)


def scatter_or_gather(scatters, src, dst, average, group, world_size):
    """dst = reduce_scatter(src) (scatters) or all_gather(src) over the group."""
    _check_average(src.dtype, average)
    work = torch.empty(dst.numel(), dtype=dst.dtype, device=dst.device)
    if scatters:
        _dist_reduce_scatter(work, src.contiguous().view(-1), op=dist.ReduceOp.SUM, group=group)
        if average:
            _average(work, world_size)
    else:
        _dist_all_gather(work, src.contiguous().view(-1), group=group)
    dst.copy_(work.view(dst.shape))


# The torch.distributed backends whose collectives on CUDA tensors a CUDA graph
# captures: NCCL, and pyallreduce's own (its Communicator's kernels are
# captured, and what it does not run goes to its inner NCCL backend).
CAPTURABLE_BACKENDS = ("nccl", "pyallreduce")


def check_capturable(device, group, reason):
    """Raises, before anything is enqueued, when a call going to
    torch.distributed (for `reason`) cannot run now: a CUDA graph captures
    torch.distributed's all-reduce only over CAPTURABLE_BACKENDS; over gloo it
    invalidates the capture with an error that does not say why this call
    went there. The backend asked is the one the group runs `device`'s
    tensors on, not the group's name ("cpu:gloo,cuda:nccl", "pyallreduce")."""
    if not stream_capturing(device):
        return
    backend = backend_of(group if group is not None else dist.group.WORLD, device).name()
    if backend not in CAPTURABLE_BACKENDS:
        raise RuntimeError(
            f"pyallreduce: this collective goes to torch.distributed ({reason}), and the group's backend "
            f"for CUDA tensors {backend!r} cannot run inside a CUDA graph capture; give the Communicator a "
            "group with NCCL (or pyallreduce) for CUDA tensors, or make this call outside the capture")


def check_fingerprint(call, src, average, algo, group, world_size):
    """The debug mode (PYALLREDUCE_DEBUG=1): every rank compares this call's
    (call number, op, dtype, numel, algo) before any data moves."""
    mine = (call, "avg" if average else "sum", str(src.dtype), src.numel(), algo)
    every = [None] * world_size
    dist.all_gather_object(every, mine, group=group)
    if any(f != mine for f in every):
        rows = "\n".join(f"  rank {q}: (call, op, dtype, numel, algo) = {f}" for q, f in enumerate(every))
        raise RuntimeError(f"pyallreduce: the ranks disagree about this collective:\n{rows}")
