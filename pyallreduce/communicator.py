"""Communicator: the one place that decides, for the collectives of one
process group on one node, kernels or torch.distributed, the algorithm,
chunking, the agreement before a fallback, argument checks and lifetime. It
holds one engine (engines/), which only executes."""
from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import weakref

import torch
import torch.distributed as dist

from . import _C, logs, ops, reference  # noqa: F401  (ops: fake impls for torch.compile)
from .engines import engine_class, graph_capture_problem, resolve_backend, resolve_device, stream_capturing
from .group import agree_on_group
from .protocol import REDUCED_DTYPES, is_own_segment, not_reduced_reason, overlaps, partial_overlap_problem

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)  # torch.distributed's default too
DEFAULT_MAX_BYTES = 32 << 20
ALGOS = {"one_shot": _C.ONE_SHOT, "two_shot": _C.TWO_SHOT}
DEBUG_ENV = "PYALLREDUCE_DEBUG"

_AVERAGE = {"sum": False, "avg": True, dist.ReduceOp.SUM: False, dist.ReduceOp.AVG: True}


def parse_op(op):
    """'sum' | 'avg' | dist.ReduceOp.SUM | dist.ReduceOp.AVG -> average?"""
    try:
        return _AVERAGE[op]
    except (KeyError, TypeError):
        raise ValueError(f"pyallreduce: op must be 'sum' or 'avg', got {op!r}") from None


def _timeout_seconds(timeout):
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    if not seconds > 0:
        raise ValueError(f"pyallreduce: timeout must be positive, got {timeout!r}")
    return seconds


class Communicator:
    """All-reduce among the ranks of `group` (default: the world group) that
    share one host, by reading each other's memory directly.

    device: the tensors' device; None means the current CUDA device when CUDA
        is available, else CPU.
    max_bytes: size of each of the two staging buffers; larger tensors are
        reduced in chunks of this size.
    backend: "auto" (cuda on GPU, cpu on CPU), "cuda", "triton" or "cpu".
    timeout: deadline of every wait (seconds or timedelta); past it the call
        raises naming the ranks that never arrived, and the communicator is
        unusable afterwards.
    nblocks: blocks (programs) per rank for the GPU and Triton kernels.
    debug: compare each call's fingerprint across ranks before moving data
        (slow; also enabled by PYALLREDUCE_DEBUG=1).

    Construction is collective: every rank of the group must create it. Groups
    the backend cannot serve (more than MAX_RANKS ranks, several hosts, no
    full peer-to-peer mesh) fall back to torch.distributed.all_reduce with one
    logged reason, as do dtypes other than float32/float16/bfloat16.
    """

    def __init__(self, group=None, *, device=None, max_bytes=DEFAULT_MAX_BYTES, backend="auto",
                 timeout=DEFAULT_TIMEOUT, nblocks=None, debug=None):
        if not dist.is_initialized():
            raise RuntimeError("pyallreduce: torch.distributed is not initialised; call "
                               "dist.init_process_group(...) before creating a Communicator")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.device = resolve_device(device)
        self.backend = resolve_backend(backend, self.device)
        engine_type = engine_class(self.backend)
        if int(max_bytes) <= 0:
            raise ValueError(f"pyallreduce: max_bytes must be positive, got {max_bytes}")
        self.max_bytes = -(-int(max_bytes) // _C.ALIGNMENT) * _C.ALIGNMENT
        self.timeout_s = _timeout_seconds(timeout)
        self.debug = bool(int(os.environ.get(DEBUG_ENV, "0"))) if debug is None else bool(debug)
        self._calls = 0
        self._capturing = False
        self._closed = False
        self._engine = None  # None: every call goes to torch.distributed (fallback_reason)
        self._handle = None  # the engine's C++ context for the eager fast path, read once here
        setup = agree_on_group(self.group, self.world_size, self.device, self.backend, engine_type, self.max_bytes,
                               engine_type.resolve_nblocks(nblocks, self.device), _blocks_held)
        self.nblocks, self.crossover, self.fallback_reason = setup.nblocks, setup.crossover, setup.fallback_reason
        self._gpu = None  # the GPU whose blocks this communicator's kernels hold (policy.resident_nblocks)
        if self.fallback_reason is None:
            self._engine = engine_type(self.group, self.rank, self.device, self.max_bytes, self.nblocks,
                                       self.timeout_s)
            self._handle = self._engine.handle
            self._gpu = setup.gpu
        else:
            logs.log_once(f"using torch.distributed.all_reduce for this group: {self.fallback_reason}")
        _live.add(self)

    # ---- public API --------------------------------------------------------

    def all_reduce(self, tensor, op="sum", algo="auto", out=None):
        """Returns the reduction of `tensor` across ranks (out-of-place); writes
        into `out` (same shape, dtype, device) when given. The result does not
        require grad: collectives are not differentiated."""
        result = self._direct(tensor, out, op, algo)
        if result is not None:
            return result
        average = parse_op(op)
        self._check_tensor(tensor, "tensor")
        if out is None:
            out = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        else:
            self._check_out(tensor, out)
        self._reduce(_data(tensor), _data(out), average, algo)
        return out

    def all_reduce_(self, tensor, op="sum", algo="auto"):
        """Reduces `tensor` in place across ranks and returns it (its data is
        changed outside autograd, as torch.distributed.all_reduce does)."""
        if self._direct(tensor, tensor, op, algo) is not None:
            return tensor
        average = parse_op(op)
        self._check_tensor(tensor, "tensor")
        data = _data(tensor)
        self._reduce(data, data, average, algo)
        return tensor

    def reduce_scatter(self, tensor, op="sum", out=None):
        """Reduce-scatter: `tensor` holds world_size equal segments (its numel a
        multiple of the world size); rank r gets the reduction of segment r
        over the ranks. Returns it, in `out` when given (numel // world_size
        elements of the same dtype; it may be this rank's segment of `tensor`),
        else in a new tensor of shape (d0 // world_size, *rest) (flat when d0
        does not divide). The sum is the fixed rank-order fp32 sum of
        all_reduce: the bits of all_reduce(tensor) in segment r."""
        average = parse_op(op)
        self._check_tensor(tensor, "tensor")
        segment = self._segment_numel(tensor, "tensor")
        if out is None:
            shape = ((tensor.shape[0] // self.world_size, *tensor.shape[1:])
                     if tensor.dim() and tensor.shape[0] % self.world_size == 0 else (segment,))
            out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
        else:
            self._check_out_numel(tensor, out, segment)
        self._scatter_or_gather(_C.REDUCE_SCATTER, _data(tensor), _data(out), average)
        return out

    def all_gather(self, tensor, out=None):
        """All-gather: every rank's `tensor`, concatenated in rank order. Returns
        it, in `out` when given (world_size x numel elements of the same dtype;
        `tensor` may be this rank's segment of it, as FSDP2 passes), else in a
        new tensor of shape (world_size * d0, *rest). Any dtype (a byte copy)."""
        self._check_tensor(tensor, "tensor")
        if out is None:
            shape = (self.world_size * tensor.shape[0], *tensor.shape[1:]) if tensor.dim() else (self.world_size,)
            out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
        else:
            self._check_out_numel(tensor, out, tensor.numel() * self.world_size)
        self._scatter_or_gather(_C.ALL_GATHER, _data(tensor), _data(out), False)
        return out

    def register(self, tensor):
        """Collective: lets peers read `tensor` in place (zero copy) in later calls.

        For buffers reused across calls (DDP buckets, CUDA-graph inputs) on the
        CUDA backend; every rank registers its corresponding buffer (same size)
        in the same order. Returns True when registered. Memory legacy CUDA IPC
        cannot export (expandable segments) keeps the staging copy, with a log
        line, and returns False; so do the other backends, which always copy.

        Lifetime: the communicator keeps `tensor` alive, and the peers keep
        its memory mapped, until unregister(tensor) or close() on every rank
        (after close(sync=False), until the process exits: see close()). A
        buffer no longer needed must be unregistered, or it stays allocated
        here and mapped by every peer.
        """
        self._check_tensor(tensor, "tensor")
        return self._engine is not None and self._engine.register(tensor)

    def unregister(self, tensor):
        """Collective: undoes register(tensor); every rank unregisters its
        corresponding buffer, in the same order. Returns True when it was
        registered, else False (always on the backends that copy, where
        register() is a no-op too). Later calls with inputs inside it copy
        through the staging buffers again.

        Waits for this device's kernels (the calls of the registered modes
        end at a barrier every rank's kernel passes, so once ours are done no
        peer reads our buffer either), removes it from the kernels' table,
        unmaps the peers' allocations nothing else here still uses, and then
        agrees with the other ranks: only when every rank has unmapped does
        the communicator drop its reference, so the memory may be reused.
        An error on any rank raises on every rank, and the buffer then stays
        allocated until the process exits (a peer may still map it). A CUDA
        graph that captured a call reading the buffer in place holds the
        peers' addresses of it: do not replay it after unregistering.
        """
        self._check_tensor(tensor, "tensor")
        return self._engine is not None and self._engine.unregister(tensor)

    @contextlib.contextmanager
    def capture(self):
        """Collective: wrap CUDA graph captures of all_reduce calls in this::

            with comm.capture():
                with torch.cuda.graph(graph):
                    y = comm.all_reduce(x)

        Replays stay correct however often they run (the epoch advances on
        the device), in step with each other and with eager calls. On the
        CUDA backend, buffers registered beforehand are read in place, and
        every other captured call that can read its input in place (out of
        place, or in place running two-shot) is registered when this context
        exits, so its replays skip the staging copy too; inputs that cannot be
        exported keep the copy (logged once). Every rank must capture the
        same calls; a mismatch, or a capture that failed on some rank, raises
        at exit on every rank. Inside, nothing talks to the host (the debug
        fingerprint is skipped).
        """
        problem = graph_capture_problem(self.device)
        if problem is not None:
            raise RuntimeError(problem)
        if self._capturing:
            raise RuntimeError("pyallreduce: comm.capture() is already open; do not nest it")
        if stream_capturing(self.device):
            raise RuntimeError("pyallreduce: enter comm.capture() before torch.cuda.graph(...), not inside it: "
                               "the captured calls are registered when it exits, which talks to the other ranks")
        # The engine's, read once: a close() inside must not change what the exit does.
        with self._engine.capture() if self._engine is not None else contextlib.nullcontext():
            self._capturing = True
            try:
                yield self
            finally:
                self._capturing = False

    def check(self):
        """Raises what this communicator's CUDA kernels recorded (the ranks'
        calls differed, a deadline passed). A CUDA call returns before its
        kernel has run, so such an error is otherwise raised by the next call
        (a mismatch leaves the communicator usable; a deadline does not).
        Waits for the device. Calls on the CPU backend raise at once: nothing
        to do there."""
        if self._engine is not None:
            self._engine.check()

    def close(self):
        """Releases the mapped memory. Safe to call twice. On CUDA it is
        collective (every rank calls it): an exported allocation must not be
        freed while a peer still maps it. Registered buffers and the inputs
        of captured zero-copy calls are dropped after every rank has unmapped
        them; the graphs captured with this communicator must not be
        replayed any more.

        Leaving `with Communicator(...)` by an exception, garbage collection
        and process exit close without the other ranks (they may be gone):
        this waits for this device's own kernels and unmaps the peers, but
        keeps the own region, the registered buffers and the captured inputs
        allocated until the process exits (peers may still map them), with
        one log line. Call close() on every rank to free them.
        """
        self._close(sync=True)

    def _close(self, sync):
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        engine, self._engine, self._handle = self._engine, None, None
        if engine is not None:
            engine.close(sync)

    @property
    def closed(self):
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        # After an error the peers may never reach a collective close.
        self._close(sync=exc_type is None)

    def __del__(self):
        try:
            self._close(sync=False)
        except Exception:
            pass

    def __repr__(self):
        how = f"fallback ({self.fallback_reason})" if self.fallback_reason else f"backend={self.backend}"
        return (f"Communicator(rank={self.rank}, world_size={self.world_size}, device={self.device}, {how}, "
                f"max_bytes={self.max_bytes})")

    # ---- the decisions -----------------------------------------------------

    def _direct(self, src, dst, op, algo):
        """The common eager call, kept short: a plain tensor of a supported dtype,
        a known op and algo, nothing tracing; the C++ side runs it if
        the tensors fit a kernel as they are (contiguous, on our device, within
        max_bytes). Returns the result (dst, or a new tensor when dst is None),
        or None having done nothing; the general path then checks and handles
        the call."""
        if self._handle is None or self.debug or not _eager(src):  # torch.compile stops here
            return None
        try:
            average = _AVERAGE[op]
        except (KeyError, TypeError):  # parse_op on the general path says what is wrong
            return None
        if src.dtype not in REDUCED_DTYPES:
            return None
        if algo == "auto":
            nbytes = src.nbytes
            if self.crossover.prefers_reference(nbytes):
                return None
            algo = self.crossover.algo_for(nbytes)
        algo_id = ALGOS.get(algo)
        if algo_id is None:
            return None
        if dst is None:
            dst = torch.empty_like(src)
        elif type(dst) is not torch.Tensor:
            return None
        if not _C.try_collective_eager(src, dst, self._handle, algo_id, average):
            return None
        self._calls += 1
        return dst

    def _check_tensor(self, tensor, name):
        if self._closed:
            raise RuntimeError("pyallreduce: this communicator is closed; create a new Communicator")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"pyallreduce: {name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device != self.device:
            raise ValueError(f"pyallreduce: {name} is on {tensor.device} but this communicator serves "
                             f"{self.device}; move the tensor or create a Communicator(device=...)")

    def _check_out(self, tensor, out):
        self._check_tensor(out, "out")
        if out.shape != tensor.shape or out.dtype != tensor.dtype:
            raise ValueError(f"pyallreduce: out has shape {tuple(out.shape)} and dtype {out.dtype}; "
                             f"expected {tuple(tensor.shape)} and {tensor.dtype} like the input")

    def _segment_numel(self, tensor, name):
        if tensor.numel() % self.world_size:
            raise ValueError(f"pyallreduce: reduce_scatter needs {name}.numel() to be a multiple of the world size "
                             f"{self.world_size}, got {tensor.numel()}")
        return tensor.numel() // self.world_size

    def _check_out_numel(self, tensor, out, numel):
        self._check_tensor(out, "out")
        if out.numel() != numel or out.dtype != tensor.dtype:
            raise ValueError(f"pyallreduce: out has {out.numel()} elements of {out.dtype}; expected {numel} of "
                             f"{tensor.dtype}")

    def _algo_id(self, algo, nbytes):
        if algo == "auto":
            algo = self.crossover.algo_for(nbytes)
        try:
            return ALGOS[algo]
        except KeyError:
            raise ValueError(f"pyallreduce: algo must be 'auto', 'one_shot' or 'two_shot', got {algo!r}") from None

    def _reference_reason(self, dtype, nbytes, algo="auto"):
        """Why an all-reduce of nbytes of dtype goes to torch.distributed, or
        None (ddp.py asks the same for its buckets)."""
        if self.fallback_reason is not None:
            return self.fallback_reason
        reason = not_reduced_reason(dtype)
        if reason is None and algo == "auto" and self.crossover.prefers_reference(nbytes):  # a named algo runs ours
            reason = f"messages of {self.crossover.reference_min_bytes} bytes and more are faster with the reference"
        return reason

    def _reduce(self, src, dst, average, algo):
        """dst = reduce(src) across ranks; dst may be src."""
        nbytes = src.numel() * src.element_size()  # not .nbytes: works on symbolic shapes (torch.compile)
        if (self._engine is not None and src.dtype in REDUCED_DTYPES and 0 < nbytes <= self.max_bytes
                and src.is_contiguous() and dst.is_contiguous() and not self.debug
                and not (algo == "auto" and self.crossover.prefers_reference(nbytes))):
            # The common case, kept short: one call, no views.
            return self._run(src, dst, self._algo_id(algo, nbytes), average)
        self._algo_id(algo, 0)  # reject an unknown name even where the fallback runs
        if self.debug and not self._capturing:  # before any branch: every rank takes part
            reference.check_fingerprint(self._calls, src, average, algo, self.group, self.world_size)
        reason = self._reference_reason(src.dtype, src.numel() * src.element_size(), algo)
        if reason is not None:
            if not torch.compiler.is_compiling():
                logs.log_once(f"torch.distributed.all_reduce used: {reason}")
                reference.check_capturable(self.device, self.group, reason)
            self._agree(src, dst, average, _C.MODE_FALLBACK)
            return reference.all_reduce(src, dst, average, self.group, self.world_size)
        if src.numel() == 0:
            self._agree(src, dst, average, _C.MODE_STAGED)
            return
        # Chunks are checked one pair at a time below: chunk k's out could be chunk k+1's input.
        # (Not while tracing: torch.compile cannot compare data pointers.)
        problem = None if dst is src or torch.compiler.is_compiling() else partial_overlap_problem(src, dst)
        if problem is not None:
            raise RuntimeError(problem)
        contiguous_dst = dst if dst.is_contiguous() else torch.empty(dst.shape, dtype=dst.dtype, device=dst.device)
        flat_src = src.contiguous().view(-1)
        flat_dst = contiguous_dst.view(-1)
        per_call = self.max_bytes // src.element_size()
        for start in range(0, flat_src.numel(), per_call):
            s = flat_src[start:start + per_call]
            d = flat_dst[start:start + per_call]
            self._run(s, d, self._algo_id(algo, s.numel() * s.element_size()), average)
        if contiguous_dst is not dst:
            dst.copy_(contiguous_dst)

    def _scatter_or_gather(self, collective, src, dst, average):
        """dst = reduce_scatter(src) or all_gather(src) across ranks (collective: _C.REDUCE_SCATTER,
        _C.ALL_GATHER); checked by the caller. One place decides: kernels or fallback,
        chunking, and the contiguous copies."""
        if (self._handle is not None and not self.debug and _eager(src) and type(dst) is torch.Tensor
                and _C.try_collective_eager(src, dst, self._handle, collective, average)):
            self._calls += 1  # the common case, kept short (as in _direct)
            return
        scatters = collective == _C.REDUCE_SCATTER
        segment = dst if scatters else src  # protocol.h's S: the per-rank part
        nbytes = segment.numel() * segment.element_size()
        if self.debug and not self._capturing:
            reference.check_fingerprint(self._calls, src, average, "reduce_scatter" if scatters else "all_gather",
                                        self.group, self.world_size)
        reason = self.fallback_reason
        if reason is None and scatters:
            reason = not_reduced_reason(src.dtype)
        if reason is None and self._engine.piece_bytes(collective, segment.element_size()) == 0:
            reason = f"max_bytes={self.max_bytes} is too small for {self.world_size} segments"
        if reason is not None:
            if not torch.compiler.is_compiling():
                logs.log_once(f"torch.distributed used for {'reduce_scatter' if scatters else 'all_gather'}: {reason}")
                reference.check_capturable(self.device, self.group, reason)
            self._agree(src, dst, average, _C.MODE_FALLBACK, collective)
            return reference.scatter_or_gather(scatters, src, dst, average, self.group, self.world_size)
        if nbytes == 0:
            return self._agree(src, dst, average, _C.MODE_STAGED, collective)
        # Contiguous, and not overlapping except as protocol.h allows (this rank's
        # segment of the larger tensor); anything else through copies.
        src_c = src if src.is_contiguous() else src.contiguous()
        dst_c = dst if dst.is_contiguous() else torch.empty(dst.shape, dtype=dst.dtype, device=dst.device)
        whole, part = (src_c, dst_c) if scatters else (dst_c, src_c)
        if overlaps(src_c, dst_c) and not is_own_segment(part, whole, self.rank):
            src_c = src_c.clone()
        self._run_scatter_or_gather(collective, src_c.view(-1), dst_c.view(-1), average)
        if dst_c is not dst:
            dst.copy_(dst_c)

    def _run_scatter_or_gather(self, collective, src, dst, average):
        """Flat contiguous src/dst with nonzero bytes, in as many pieces of every
        segment as the engine needs (the GPU ones stage a whole call; the host
        kernels take any size), through contiguous copies of the pieces."""
        scatters = collective == _C.REDUCE_SCATTER
        n = dst.numel() if scatters else src.numel()  # elements per segment
        piece = self._engine.piece_bytes(collective, src.element_size())
        per = n if piece is None else piece // src.element_size()
        for start in range(0, n, per):
            stop = min(n, start + per)
            if per >= n:
                s, d = src, dst
            elif scatters:
                s, d = src.view(self.world_size, n)[:, start:stop].contiguous().view(-1), dst[start:stop]
            else:
                s, d = src[start:stop], torch.empty(self.world_size * (stop - start), dtype=dst.dtype,
                                                    device=dst.device)
            self._calls += 1
            self._engine.scatter_or_gather(collective, s, d, average, self._calls)
            if not scatters and d is not dst:
                dst.view(self.world_size, n)[:, start:stop].copy_(d.view(self.world_size, -1))

    def _agree(self, src, dst, average, mode, collective=_C.AGREE_ONLY):
        """The agreement round for a call that does not go through the kernels
        (a torch.distributed fallback, an empty tensor): the peers check it
        against their own call, so a rank whose call differs makes every rank
        raise instead of each waiting in a different collective. Groups the
        communicator does not serve at all have no shared memory to meet in;
        under torch.compile the round is skipped (the compiled graph holds only
        the torch.distributed collective), and so it is inside a CUDA graph
        capture, where it cannot wait for its answer (the captured calls are
        compared when comm.capture() exits)."""
        if self._engine is None or torch.compiler.is_compiling() or stream_capturing(self.device):
            return
        self._calls += 1
        if collective == _C.AGREE_ONLY:  # an all-reduce
            nbytes, in_place = src.numel() * src.element_size(), dst is src
        else:  # protocol.h: W segments; "in place" is the one overlap the kernels allow
            whole, part = (src, dst) if collective == _C.REDUCE_SCATTER else (dst, src)
            nbytes = whole.numel() * whole.element_size()
            in_place = is_own_segment(part, whole, self.rank)
        self._engine.agree(_C.dtype_code(src.dtype), nbytes, mode, average, in_place, collective, self._calls,
                           src.device)

    def _run(self, src, dst, algo_id, average):
        self._calls += 1
        self._engine.all_reduce(src, dst, algo_id, average, self._calls)


def _eager(tensor):
    """Whether the kernels may be called directly rather than through the torch op
    (a microsecond less per call): plain tensors outside torch.compile/export,
    which trace the op. The C++ side (try_collective_eager) declines under
    dispatch modes, torch function modes, the JIT tracer and functorch wrappers."""
    return not torch.compiler.is_compiling() and type(tensor) is torch.Tensor


def _data(tensor):
    """The tensor itself, or a view of its data outside autograd if it requires grad."""
    return tensor.detach() if tensor.requires_grad else tensor


# Communicators still open at interpreter exit are closed (unmapped) there.
_live = weakref.WeakSet()


def _blocks_held(gpu):
    """The blocks this process's open communicators' kernels hold on `gpu`."""
    return sum(c.nblocks for c in _live if c._gpu == gpu and not c._closed)


@atexit.register
def _close_all():
    for comm in list(_live):
        comm._close(sync=False)  # the peers may already be gone
