"""Engines: what runs a Communicator's calls, one class per backend.

The Communicator (communicator.py) decides everything — kernels or
torch.distributed, the algorithm, chunking, the agreement before a fallback,
argument checks, lifetime — and hands an engine only calls that fit it. An
engine executes them: the native engine (CPU) through the C++ context, the
CUDA engine on top of it (IPC transport, registered buffers, graph capture,
status checks, closing with parking), the Triton engine through
pyallreduce.triton_kernels. This module is the only place that maps a backend
name to a class; `Engine` is the interface the Communicator relies on.
"""
from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Iterator, Optional, Protocol

import torch

from .. import _C
from ..group import gather, raise_if_failed

if TYPE_CHECKING:
    from ..transport import Transport

BACKENDS = ("auto", "cuda", "triton", "cpu")
# What a call raises that a close() or abort() on another thread ended
# between its steps (chunks, pieces, the agreement and the fallback).
CLOSED_DURING_CALL = ("pyallreduce: this communicator was closed or aborted on another thread during this call; "
                      "create a new Communicator (or process group) on the ranks that go on")


class Engine(Protocol):
    """One communicator's executor. Every call it gets is eager or captured,
    has nonzero bytes, contiguous tensors of a dtype it takes, and fits one
    run (`piece_bytes`); the ranks' agreement on the call is the kernels'.
    Before construction, group.py asks the class two things every rank must
    agree on: resolve_nblocks(nblocks, device) and gpu_capacity(device,
    world_size) (the GPU and how many blocks of its kernels fit at once)."""

    name: str
    transport: Transport
    # The C++ context for the eager fast path (_C.try_collective_eager), or
    # None when calls do not go through it (Triton).
    handle: Optional[int]

    def all_reduce(self, src: torch.Tensor, dst: torch.Tensor, algo: int, average: bool, call: int) -> None:
        """dst = reduce(src) across ranks (dst may be src); algo: _C.ONE_SHOT or _C.TWO_SHOT."""

    def scatter_or_gather(self, collective: int, src: torch.Tensor, dst: torch.Tensor, average: bool,
                          call: int) -> None:
        """One reduce-scatter (_C.REDUCE_SCATTER) or all-gather (_C.ALL_GATHER) piece."""

    def agree(self, dtype_code: int, nbytes: int, mode: int, average: bool, in_place: bool, collective: int,
              call: int, device: torch.device) -> None:
        """The agreement round of a call that does not run here (protocol.h kAgreeOnly)."""

    def piece_bytes(self, collective: int, element_size: int) -> Optional[int]:
        """The most bytes of each segment one reduce-scatter/all-gather run moves
        (a multiple of element_size; 0: not one element fits), or None: any size."""

    # The CUDA-only lifecycle; other engines answer "not here".
    def register(self, tensor: torch.Tensor) -> bool: ...
    def unregister(self, tensor: torch.Tensor) -> bool: ...
    def capture(self) -> contextlib.AbstractContextManager: ...
    def check(self) -> None: ...
    def close(self, sync: bool) -> None: ...

    def interrupt(self, end_kernels: bool) -> None:
        """From any thread (every close without the peers): a host wait of this
        engine in progress gives up and raises, and no later call starts; the
        C++ engines return once no call is in flight. With end_kernels (an
        abort) a CUDA kernel (or an interpreted Triton one) waiting for a peer
        gives up too, within about _C.ABORT_LOOK_NS (not where a peer may
        still read this rank's registered buffer in place:
        csrc/cuda/all_reduce.cuh barrier); garbage collection and exit do not
        ask it, for a kernel's peers may be only late, and its output still
        wanted. Never waits for a kernel: close() does."""


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend a Communicator on `device` runs ("auto" resolved), or a clear error."""
    if backend not in BACKENDS:
        raise ValueError(f"pyallreduce: backend must be one of {BACKENDS}, got {backend!r}")
    on_gpu = device.type == "cuda"
    if backend == "auto":
        backend = "cuda" if on_gpu else "cpu"
    if backend == "cpu" and on_gpu:
        raise ValueError("pyallreduce: backend='cpu' needs device='cpu'; use backend='cuda' or 'triton' for GPUs")
    if backend == "cuda":
        if not on_gpu:
            raise ValueError("pyallreduce: backend='cuda' needs a CUDA device; use backend='cpu' for CPU tensors")
        if not _C.WITH_CUDA:
            raise RuntimeError("pyallreduce: this build has no CUDA kernels (built without a CUDA toolkit "
                               "or with PYALLREDUCE_SKIP_CUDA=1); reinstall with a CUDA toolkit")
    if backend == "triton" and not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("pyallreduce: backend='triton' on CPU tensors runs the Triton interpreter; "
                           "set TRITON_INTERPRET=1 before triton is first imported")
    return backend


def resolve_device(device) -> torch.device:
    """The device a Communicator serves: None means the current CUDA device
    when CUDA is available, else CPU."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"pyallreduce: device must be cpu or cuda, got {device}")
    return device


def check_capture_entry(device: torch.device, already_open: bool) -> None:
    """Raises why comm.capture() cannot be entered now."""
    if device.type != "cuda":
        raise RuntimeError(f"pyallreduce: capture() is for CUDA graphs; this communicator serves {device}")
    if already_open:
        raise RuntimeError("pyallreduce: comm.capture() is already open; do not nest it")
    if stream_capturing(device):
        raise RuntimeError("pyallreduce: enter comm.capture() before torch.cuda.graph(...), not inside it: "
                           "the captured calls are registered when it exits, which talks to the other ranks")


def engine_class(backend: str):
    """The class of a resolved backend."""
    if backend == "cpu":
        from .native import NativeEngine

        return NativeEngine
    if backend == "cuda":
        from .cuda import CudaEngine

        return CudaEngine
    from .triton import TritonEngine

    return TritonEngine


def make_transport(group, max_bytes: int, device: torch.device, wait_until_unused) -> Transport:
    """The regions of a communicator on `device`: CUDA IPC on a GPU (which waits
    with the engine's wait_until_unused before it frees), POSIX shared memory on CPU."""
    if device.type == "cuda":
        from ..transport.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport(group, max_bytes, device, wait_until_unused)
    from ..transport import HostShmTransport

    return HostShmTransport(group, max_bytes)


def set_up_on_every_rank(engine, group, set_up) -> None:
    """Collective, at the end of an engine's construction: runs set_up(), this
    rank's part after the transport is mapped (allocations that can fail on
    one rank alone), and raises on every rank if it failed on any, the engine
    closed on every rank together. Otherwise the others would go on and wait
    in their first call, until its deadline, for a rank that never comes."""
    error = None
    try:
        try:
            set_up()
        except Exception as e:  # any: the others must hear of it (torch.OutOfMemoryError, MemoryError, ...)
            error = str(e)
        errors = gather(error, group)
    except BaseException:
        engine.close(sync=False)
        raise
    if any(errors):
        with contextlib.suppress(Exception):  # the setup's error is the one to see
            engine.close(sync=True)  # every rank is here: unmap together, then free
        raise_if_failed(errors, "setting up the communicator")


def stream_capturing(device: torch.device) -> bool:
    """Whether the current stream of `device` (not of the current device: a
    call on cuda:1 may come while cuda:0 is current) is being captured into a
    CUDA graph."""
    if device.type != "cuda":
        return False
    if _C.WITH_CUDA:
        return _C.cuda_current_stream_capturing(device.index)
    with torch.cuda.device(device):  # the Triton engine in a build without the CUDA kernels
        return torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def relaxed_capture_mode(device: torch.device) -> Iterator[None]:
    """This thread's CUDA graph capture mode relaxed for the block, as the C++
    glue's RelaxedCaptureScope: host waits and allocations are "potentially
    unsafe" calls, which in the default global mode fail, and invalidate the
    capture, while another thread captures in global mode. For the Triton
    engine's own (torch's calls in the block follow the mode too); a build
    without the CUDA kernels cannot change the mode: the block runs as it is."""
    if device.type != "cuda" or not _C.WITH_CUDA:
        yield
        return
    previous = _C.cuda_exchange_capture_mode(_C.CUDA_CAPTURE_MODE_RELAXED)
    try:
        yield
    finally:
        _C.cuda_exchange_capture_mode(previous)


@contextlib.contextmanager
def no_graph_table() -> Iterator[None]:
    """capture() of an engine without a graph table: calls are captured as they are."""
    yield
