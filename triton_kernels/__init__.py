"""The all-reduce kernels in Triton (installed as pyallreduce.triton_kernels).

Same protocol and same bits as the C++ backends (csrc/common/protocol.h,
docs/architecture.md). On CUDA tensors the regions are CUDA IPC mappings; on
CPU tensors the kernels run under TRITON_INTERPRET=1 over POSIX shared
memory, which must be set before this package is first imported (see
signal.py).
"""
import time

import torch

from pyallreduce import _C

from . import one_shot, signal, two_shot

__all__ = ["all_reduce"]

_LAUNCHERS = {_C.ONE_SHOT: one_shot.launch, _C.TWO_SHOT: two_shot.launch}
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (regions, device) -> (int64 tensor of the region bases, int32 status record).
# Built once per communicator, so a call costs one launch.
_device_args = {}
_MAX_CACHED = 64


def _args_for(regions, device):
    key = (tuple(regions), device)
    args = _device_args.get(key)
    if args is None:
        if len(_device_args) >= _MAX_CACHED:
            _device_args.clear()
        args = (torch.tensor(key[0], dtype=torch.int64, device=device),
                torch.zeros(signal.STATUS_WORDS, dtype=torch.int32, device=device))
        _device_args[key] = args
    return args


def _check(input, out, regions, rank, world_size, max_bytes, nblocks, algo):
    if input.dtype not in _DTYPES:
        raise TypeError(f"pyallreduce: dtype {input.dtype} is not supported (float32, float16, bfloat16)")
    if out.dtype != input.dtype or out.numel() != input.numel() or out.device != input.device:
        raise ValueError("pyallreduce: out must have the input's dtype, numel and device")
    if not (input.is_contiguous() and out.is_contiguous()):
        raise ValueError("pyallreduce: the Triton kernels need contiguous tensors")
    if not 1 <= world_size <= _C.MAX_RANKS or len(regions) != world_size or not 0 <= rank < world_size:
        raise ValueError(f"pyallreduce: rank {rank}, world size {world_size} and {len(regions)} regions "
                         f"do not fit (at most {_C.MAX_RANKS} ranks)")
    if max_bytes <= 0 or max_bytes % _C.ALIGNMENT != 0:
        raise ValueError(f"pyallreduce: max_bytes must be a positive multiple of {_C.ALIGNMENT}")
    if input.nbytes > max_bytes:
        raise ValueError(f"pyallreduce: {input.nbytes} bytes exceed the staging buffer (max_bytes={max_bytes})")
    if not 1 <= nblocks <= _C.MAX_BLOCKS:
        raise ValueError(f"pyallreduce: nblocks must be in 1..{_C.MAX_BLOCKS}, got {nblocks}")
    if algo not in _LAUNCHERS:
        raise ValueError(f"pyallreduce: unknown algorithm id {algo}")
    if input.is_cuda == signal.INTERPRET:
        raise RuntimeError("pyallreduce: the Triton kernels run CUDA tensors compiled and CPU tensors under "
                           "TRITON_INTERPRET=1, which must be set before pyallreduce.triton_kernels is "
                           f"imported (it is {'set' if signal.INTERPRET else 'not set'}; tensors on "
                           f"{input.device})")


def all_reduce(input, out, regions, rank, world_size, max_bytes, nblocks, algo, average, timeout_s):
    """out = sum (or mean when average) of `input` over the ranks.

    input, out: contiguous tensors of one dtype (float32, float16, bfloat16)
        and numel, on CPU (shared memory) or CUDA (IPC regions); out may be
        input. input.nbytes <= max_bytes (the caller chunks).
    regions: every rank's region base address as mapped in this process.
    nblocks: programs per rank, fixed for the communicator's life.
    algo: pyallreduce._C.ONE_SHOT or TWO_SHOT.
    timeout_s: deadline of every barrier wait. Past it a CPU call raises
        RuntimeError naming the missing ranks; a GPU kernel prints them and
        traps. Either way the ranks' epochs are out of step afterwards: the
        communicator cannot be used again.
    """
    _check(input, out, regions, rank, world_size, max_bytes, nblocks, algo)
    regions_t, status = _args_for(regions, input.device)
    timeout_ns = max(1, int(timeout_s * 1e9))
    launch = _LAUNCHERS[algo]
    if not input.is_cuda:
        started = time.monotonic()
        launch(input, out, regions_t, status, rank, world_size, max_bytes, nblocks, average, timeout_ns)
        _raise_on_deadline(status, rank, world_size, time.monotonic() - started)
        return
    if input.device.index == torch.cuda.current_device():
        launch(input, out, regions_t, status, rank, world_size, max_bytes, nblocks, average, timeout_ns)
    else:
        with torch.cuda.device(input.device):  # Triton launches on the current device
            launch(input, out, regions_t, status, rank, world_size, max_bytes, nblocks, average, timeout_ns)


def _raise_on_deadline(status, rank, world_size, waited):
    barrier_id, program, epoch, mask = status.tolist()
    if barrier_id == 0:
        return
    status.zero_()
    missing = " ".join(str(q) for q in signal.missing_ranks(mask, world_size))
    raise RuntimeError(
        f"pyallreduce: rank {rank} waited {waited:.2f} s in the {signal.BARRIER_NAMES.get(barrier_id, '?')} "
        f"barrier of call {epoch & 0xFFFFFFFF} (Triton program {program}); rank(s) {missing} never arrived. "
        "Every rank must make the same collective calls in the same order.")
