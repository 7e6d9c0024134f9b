"""The collective kernels in Triton (installed as pyallreduce.triton_kernels):
all-reduce (one-shot, two-shot), reduce-scatter and all-gather.

Same protocol and same bits as the C++ backends (csrc/common/protocol.h,
docs/architecture.md). On CUDA tensors the regions are CUDA IPC mappings; on
CPU tensors the kernels run under TRITON_INTERPRET=1 over POSIX shared
memory, which must be set before this package is first imported (see
signal.py).
"""
import torch

from pyallreduce import _C
from pyallreduce.engines import relaxed_capture_mode, stream_capturing
from pyallreduce.protocol import is_own_segment, not_reduced_reason, overlaps, partial_overlap_problem

from . import one_shot, scatter_gather, signal, two_shot
from .status import STATUS_ABORTED, STATUS_WORDS, CallMismatch, new_generation, raise_recorded

__all__ = ["CallMismatch", "agree", "all_gather", "all_reduce", "interrupt", "prepare", "reduce_scatter", "release"]


_LAUNCHERS = {_C.ONE_SHOT: one_shot.launch, _C.TWO_SHOT: two_shot.launch}
# (regions, device) -> (int64 tensor of the region bases, the int32 status
# record, a numpy view of it), so a call costs one launch and one read of the
# record's code. On a GPU the record lives in pinned host memory (status.py
# explains why). Made by prepare() when a communicator is created (never inside
# a CUDA graph capture, where pinned allocation and the copy to the device are
# not permitted) and dropped by release() when it closes, after its kernels
# finished: a kernel may still write the record until then. The region table
# has one slot more: the record's claim word (signal.claim_word), so that it
# is device memory on a GPU.
_device_args = {}


def prepare(regions, device):
    """Makes the arguments every call on these regions passes (see _device_args)."""
    key = (tuple(regions), torch.device(device))
    if key not in _device_args:
        if stream_capturing(key[1]):
            raise RuntimeError("pyallreduce: the first Triton call on these regions is inside a CUDA graph "
                               "capture, which does not permit allocating its status record; create the "
                               "Communicator (or make one call) before capturing")
        with relaxed_capture_mode(key[1]):  # pinned and device allocations, a wait
            status = torch.zeros(STATUS_WORDS, dtype=torch.int32, pin_memory=key[1].type == "cuda")
            new_generation(status, 1)
            table = torch.tensor([*key[0], 0], dtype=torch.int64, device=key[1])  # + the claim word, 0
            if key[1].type == "cuda":  # copied before any kernel, on whatever stream, can use it
                torch.cuda.current_stream(key[1]).synchronize()
        _device_args[key] = (table, status, status.numpy())
    return _device_args[key]


def interrupt(regions, device):
    """An interpreted kernel on these regions waiting for a peer gives up at
    its next round, as at its deadline, and records CODE_ABORTED (status.py
    STATUS_ABORTED; a compiled one does not look yet: wait_peers): for an
    abort (Communicator.abort(), torch.distributed's abort of the group).
    From any thread; never waits. Nothing to do before prepare()."""
    args = _device_args.get((tuple(regions), torch.device(device)))
    if args is not None:
        args[2][STATUS_ABORTED.value] = 1  # a plain host store: the interpreted kernel sees it at its next load


def release(regions, device):
    """Drops what prepare() made; no kernel on these regions may still run."""
    _device_args.pop((tuple(regions), torch.device(device)), None)


def _args_for(regions, device):
    return _device_args.get((tuple(regions), device)) or prepare(regions, device)


def _check_group(regions, rank, world_size, nblocks, device):
    if not 1 <= world_size <= _C.MAX_RANKS or len(regions) != world_size or not 0 <= rank < world_size:
        raise ValueError(f"pyallreduce: rank {rank}, world size {world_size} and {len(regions)} regions "
                         f"do not fit (at most {_C.MAX_RANKS} ranks)")
    if not 1 <= nblocks <= _C.MAX_BLOCKS:
        raise ValueError(f"pyallreduce: nblocks must be in 1..{_C.MAX_BLOCKS}, got {nblocks}")
    if (device.type == "cuda") == signal.INTERPRET:
        raise RuntimeError("pyallreduce: the Triton kernels run CUDA tensors compiled and CPU tensors under "
                           "TRITON_INTERPRET=1, which must be set before pyallreduce.triton_kernels is "
                           f"imported (it is {'set' if signal.INTERPRET else 'not set'}; tensors on "
                           f"{device})")


def _check_reduced(dtype):
    reason = not_reduced_reason(dtype)
    if reason is not None:
        raise TypeError(f"pyallreduce: {reason}")


def _check(input, out, regions, rank, world_size, max_bytes, nblocks, algo):
    _check_reduced(input.dtype)
    if out.dtype != input.dtype or out.numel() != input.numel() or out.device != input.device:
        raise ValueError("pyallreduce: out must have the input's dtype, numel and device")
    if not (input.is_contiguous() and out.is_contiguous()):
        raise ValueError("pyallreduce: the Triton kernels need contiguous tensors")
    if max_bytes <= 0 or max_bytes % _C.ALIGNMENT != 0:
        raise ValueError(f"pyallreduce: max_bytes must be a positive multiple of {_C.ALIGNMENT}")
    if input.nbytes > max_bytes:
        raise ValueError(f"pyallreduce: {input.nbytes} bytes exceed the staging buffer (max_bytes={max_bytes})")
    if algo not in _LAUNCHERS:
        raise ValueError(f"pyallreduce: unknown algorithm id {algo}")
    problem = partial_overlap_problem(input, out)
    if problem is not None:
        raise ValueError(problem)
    _check_group(regions, rank, world_size, nblocks, input.device)


def _check_segments(input, out, regions, rank, world_size, max_bytes, nblocks, scatters):
    """The checks of reduce_scatter (scatters) and all_gather, before any
    signalling; returns whether the call is in place (protocol.h: the one
    aliasing allowed, the segment being exactly segment `rank` of the whole)."""
    name, whole_name, segment_name = ("reduce_scatter", "input", "out") if scatters else ("all_gather", "out", "input")
    segment, whole = (out, input) if scatters else (input, out)
    _check_group(regions, rank, world_size, nblocks, input.device)
    if scatters:
        _check_reduced(input.dtype)
    if out.dtype != input.dtype or out.device != input.device:
        raise ValueError(f"pyallreduce: {name} needs input and out of one dtype and device")
    if whole.numel() != world_size * segment.numel():
        raise ValueError(f"pyallreduce: {name} needs {whole_name}.numel() == world size ({world_size}) x "
                         f"{segment_name}.numel(), got {whole.numel()} and {segment.numel()}")
    if not (input.is_contiguous() and out.is_contiguous()):
        raise ValueError("pyallreduce: the Triton kernels need contiguous tensors")
    if max_bytes <= 0 or max_bytes % _C.ALIGNMENT != 0:
        raise ValueError(f"pyallreduce: max_bytes must be a positive multiple of {_C.ALIGNMENT}")
    if scatters:
        # Segments sit segment_stride(S) apart in staging (protocol.h).
        staged = world_size * _C.segment_stride(segment.nbytes)
        if staged > max_bytes:
            raise ValueError(f"pyallreduce: reduce_scatter of {segment.nbytes}-byte segments stages {world_size} x "
                             f"{_C.segment_stride(segment.nbytes)} bytes (segments start {_C.SEGMENT_UNIT}-byte "
                             f"aligned), {staged} in all, more than the staging buffer (max_bytes={max_bytes}); "
                             "the caller chunks")
    elif segment.nbytes > max_bytes:
        raise ValueError(f"pyallreduce: all_gather of {segment.nbytes} bytes per rank exceeds the staging buffer "
                         f"(max_bytes={max_bytes}); the caller chunks")
    in_place = is_own_segment(segment, whole, rank)
    if overlaps(input, out) and not in_place:
        raise ValueError(f"pyallreduce: the input and out of {name} overlap; pass separate tensors, or as "
                         f"{segment_name} exactly this rank's segment of {whole_name} ({whole_name}[{rank} * n:"
                         f"{rank + 1} * n], n = {segment.numel()})")
    return in_place


def _on_device(device, fn):
    """Triton launches on the current CUDA device."""
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return fn()
    with torch.cuda.device(device):
        return fn()


def all_reduce(input, out, regions, rank, world_size, max_bytes, nblocks, algo, average, timeout_s, call=0):
    """out = sum (or mean when average) of `input` over the ranks.

    input, out: contiguous tensors of one dtype (float32, float16, bfloat16)
        and numel, on CPU (shared memory) or CUDA (IPC regions); out may be
        input. input.nbytes <= max_bytes (the caller chunks).
    regions: every rank's region base address as mapped in this process.
    nblocks: programs per rank, fixed for the communicator's life.
    algo: pyallreduce._C.ONE_SHOT or TWO_SHOT.
    timeout_s: deadline of every barrier wait.
    call: the user's call number on the communicator, for error messages.

    Raises CallMismatch (nothing written, every rank raises it, the ranks stay
    in step) when the ranks' calls differ, and RuntimeError naming the missing
    ranks past a deadline (the ranks' epochs are out of step afterwards: the
    communicator cannot be used again). On CPU tensors both come from this
    call. On a GPU the kernel records them and a later call raises them
    (status.py): a mismatch names the first skipped call and how many followed.
    """
    _check(input, out, regions, rank, world_size, max_bytes, nblocks, algo)
    regions_t, status, record = _args_for(regions, input.device)
    raise_recorded(status, record, rank, world_size, timeout_s, input.device, mismatch_too=False)
    kind = _C.desc_kind(_C.dtype_code(input.dtype), algo, _C.MODE_STAGED, average, input.data_ptr() == out.data_ptr())
    args = (input, out, regions_t, status, rank, world_size, max_bytes, nblocks, average,
            max(1, int(timeout_s * 1e9)), input.nbytes, kind, call)
    _on_device(input.device, lambda: _LAUNCHERS[algo](*args))
    raise_recorded(status, record, rank, world_size, timeout_s, input.device)


def reduce_scatter(input, out, regions, rank, world_size, max_bytes, nblocks, average, timeout_s, call=0):
    """out = sum (or mean when average) over the ranks q = 0..W-1, in that
    order, of segment `rank` of rank q's input: the bits all_reduce gives
    those elements.

    input: W = world_size segments, input.numel() == W * out.numel()
        (contiguous, float32, float16 or bfloat16; CPU shared memory or CUDA
        IPC regions, as all_reduce). out: one segment of the input's dtype; it
        may be exactly segment `rank` of input (in place), no other overlap.
    max_bytes: each segment is staged at a multiple of _C.segment_stride(S)
        (S = out.nbytes), so W * segment_stride(S) <= max_bytes (the caller
        chunks).
    Everything else, errors included, as all_reduce: asynchronous on a GPU,
    finished when it returns under the interpreter.
    """
    in_place = _check_segments(input, out, regions, rank, world_size, max_bytes, nblocks, scatters=True)
    regions_t, status, record = _args_for(regions, input.device)
    raise_recorded(status, record, rank, world_size, timeout_s, input.device, mismatch_too=False)
    kind = _C.desc_kind(_C.dtype_code(input.dtype), _C.REDUCE_SCATTER, _C.MODE_STAGED, average, in_place)
    args = (input, out, regions_t, status, rank, world_size, max_bytes, nblocks, average,
            max(1, int(timeout_s * 1e9)), input.nbytes, kind, call)
    _on_device(input.device, lambda: scatter_gather.launch_reduce_scatter(*args))
    raise_recorded(status, record, rank, world_size, timeout_s, input.device)


def all_gather(input, out, regions, rank, world_size, max_bytes, nblocks, timeout_s, call=0):
    """Segment q of out = rank q's input, for q = 0..W-1 (W = world_size).

    input: any dtype (the bytes are copied), contiguous, input.nbytes <=
        max_bytes (the caller chunks). out: W * input.numel() elements of the
        input's dtype; input may be exactly segment `rank` of out (in place),
        no other overlap.
    Everything else, errors included, as all_reduce.
    """
    in_place = _check_segments(input, out, regions, rank, world_size, max_bytes, nblocks, scatters=False)
    regions_t, status, record = _args_for(regions, input.device)
    raise_recorded(status, record, rank, world_size, timeout_s, input.device, mismatch_too=False)
    kind = _C.desc_kind(_C.dtype_code(input.dtype), _C.ALL_GATHER, _C.MODE_STAGED, False, in_place)
    args = (input, out, regions_t, status, rank, world_size, max_bytes, nblocks, max(1, int(timeout_s * 1e9)),
            out.nbytes, kind, call)
    _on_device(input.device, lambda: scatter_gather.launch_all_gather(*args))
    raise_recorded(status, record, rank, world_size, timeout_s, input.device)


def agree(dtype_code, nbytes, mode, average, in_place, regions, rank, world_size, nblocks, timeout_s, device, call=0,
          algo=_C.AGREE_ONLY):
    """The agreement round (protocol.h kAgreeOnly) for a call that moves no data
    through the kernels (a torch.distributed fallback: mode MODE_FALLBACK; an
    empty tensor: MODE_STAGED). Publishes the call's descriptor, meets the
    peers at the start barrier and raises CallMismatch unless every rank
    published the same. Synchronous on a GPU too: the caller acts on the answer.
    algo: the descriptor's algo field: AGREE_ONLY for an all-reduce,
    REDUCE_SCATTER or ALL_GATHER for the round of such a call, so that
    fallbacks of different collectives do not pair."""
    device = torch.device(device)
    _check_group(regions, rank, world_size, nblocks, device)
    regions_t, status, record = _args_for(regions, device)
    raise_recorded(status, record, rank, world_size, timeout_s, device, mismatch_too=False)
    kind = _C.desc_kind(dtype_code, algo, mode, average, in_place)

    def run():
        signal._agree_kernel[(nblocks,)](regions_t, status, rank, max(1, int(timeout_s * 1e9)), nbytes, kind, call,
                                         WORLD_SIZE=world_size, num_warps=1)
        if device.type == "cuda":
            with relaxed_capture_mode(device):
                torch.cuda.current_stream().synchronize()

    _on_device(device, run)
    raise_recorded(status, record, rank, world_size, timeout_s, device)
