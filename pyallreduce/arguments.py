"""What the Communicator's arguments must be, and the outputs it allocates:
each check states its rule and says what to do when it fails. Checks only;
what runs is the Communicator's decision."""
from __future__ import annotations

import datetime
import math

import torch
import torch.distributed as dist

from . import _C

ALGOS = {"one_shot": _C.ONE_SHOT, "two_shot": _C.TWO_SHOT}
# op -> average? (the kernels sum, and divide in fp32 when averaging)
AVERAGE = {"sum": False, "avg": True}
REDUCE_OPS = ((dist.ReduceOp.SUM, False), (dist.ReduceOp.AVG, True))
_REDUCE_OP_TYPES = (dist.ReduceOp, type(dist.ReduceOp.SUM))


def average_or_none(op):
    """'sum' | 'avg' | dist.ReduceOp.SUM | dist.ReduceOp.AVG -> average?; None
    for anything else (the fast paths then leave the call to parse_op).
    Strings first, in a dict of strings alone: Dynamo before torch 2.14 cannot
    trace a lookup in a dict that also has ReduceOp keys (torch.compile of the op)."""
    if isinstance(op, str):
        return AVERAGE.get(op)
    if isinstance(op, _REDUCE_OP_TYPES):
        for reduce_op, average in REDUCE_OPS:
            if op == reduce_op:
                return average
    return None


def parse_op(op):
    """average_or_none, raising for an unknown op."""
    average = average_or_none(op)
    if average is None:
        raise ValueError(f"pyallreduce: op must be 'sum' or 'avg', got {op!r}")
    return average


def algo_id(algo, crossover, nbytes):
    """The kernel id of `algo` ("auto": the crossover row's choice for nbytes)."""
    if algo == "auto":
        algo = crossover.algo_for(nbytes)
    try:
        return ALGOS[algo]
    except KeyError:
        raise ValueError(f"pyallreduce: algo must be 'auto', 'one_shot' or 'two_shot', got {algo!r}") from None


def timeout_seconds(timeout):
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    if not seconds > 0:
        raise ValueError(f"pyallreduce: timeout must be positive, got {timeout!r}")
    return seconds


def staging_bytes(max_bytes):
    """max_bytes rounded up to the protocol's alignment."""
    if int(max_bytes) <= 0:
        raise ValueError(f"pyallreduce: max_bytes must be positive, got {max_bytes}")
    return -(-int(max_bytes) // _C.ALIGNMENT) * _C.ALIGNMENT


def check_tensor(tensor, name, device):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"pyallreduce: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device != device:
        raise ValueError(f"pyallreduce: {name} is on {tensor.device} but this communicator serves "
                         f"{device}; move the tensor or create a Communicator(device=...)")


def check_same_as(tensor, out):
    """An all-reduce's out: the input's shape and dtype."""
    if out.shape != tensor.shape or out.dtype != tensor.dtype:
        raise ValueError(f"pyallreduce: out has shape {tuple(out.shape)} and dtype {out.dtype}; "
                         f"expected {tuple(tensor.shape)} and {tensor.dtype} like the input")


def check_numel(tensor, out, numel):
    """A reduce-scatter's or all-gather's out: numel elements of the input's dtype."""
    if out.numel() != numel or out.dtype != tensor.dtype:
        raise ValueError(f"pyallreduce: out has {out.numel()} elements of {out.dtype}; expected {numel} of "
                         f"{tensor.dtype}")


def output(tensor, out, shape, device, same_shape=False):
    """`out` checked (on `device`, the input's dtype; `shape`, or as many
    elements), or a new tensor of `shape`."""
    if out is None:
        return torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    check_tensor(out, "out", device)
    if same_shape:
        check_same_as(tensor, out)
    else:
        check_numel(tensor, out, math.prod(shape))
    return out


def scattered_shape(tensor, world_size):
    """reduce_scatter's out: (d0 // world_size, *rest), flat when d0 does not
    divide; the input must hold world_size equal segments."""
    if tensor.numel() % world_size:
        raise ValueError(f"pyallreduce: reduce_scatter needs tensor.numel() to be a multiple of the world size "
                         f"{world_size}, got {tensor.numel()}")
    if tensor.dim() and tensor.shape[0] % world_size == 0:
        return (tensor.shape[0] // world_size, *tensor.shape[1:])
    return (tensor.numel() // world_size,)


def gathered_shape(tensor, world_size):
    """all_gather's out: (world_size * d0, *rest)."""
    return (world_size * tensor.shape[0], *tensor.shape[1:]) if tensor.dim() else (world_size,)


def data(tensor):
    """The tensor itself, or a view of its data outside autograd if it requires grad."""
    return tensor.detach() if tensor.requires_grad else tensor
