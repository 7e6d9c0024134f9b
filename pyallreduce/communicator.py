"""Communicator: the one place that decides, for the collectives of one
process group on one node, kernels or torch.distributed, the algorithm,
chunking, the agreement before a fallback, argument checks and lifetime. It
holds one engine (engines/), which only executes."""
from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist
# Dynamo reads it as True while it traces: compiled code runs the op, not the
# eager path (which it could not trace). torch.compiler.is_compiling() costs
# 3x as much (~110 ns, a fifth of a small call's Python); other tracing (export,
# make_fx) runs the eager path, whose C++ side declines its fake tensors and modes.
from torch.compiler import is_dynamo_compiling

from . import _C, calibrate, live, logs, ops, reference  # noqa: F401  (ops: fake impls for torch.compile)
from .arguments import (algo_id, average_or_none, check_tensor, data, gathered_shape, output, parse_op,
                        scattered_shape, staging_bytes, timeout_seconds)
from .eager import OFF, EagerPath
from .engines import (CLOSED_DURING_CALL, check_capture_entry, engine_class, resolve_backend, resolve_device,
                      stream_capturing)
from .group import agree_on_group
from .pieces import reduce_in_chunks, scatter_or_gather_in_pieces
from .protocol import COLLECTIVE_NAMES, REDUCED_DTYPES, described_bytes, not_reduced_reason, partial_overlap_problem
from .protocol import nbytes as nbytes_of

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)  # torch.distributed's default too
DEFAULT_MAX_BYTES = 32 << 20
DEBUG_ENV = "PYALLREDUCE_DEBUG"


class Communicator:
    """All-reduce, reduce-scatter and all-gather among the ranks of `group`
    (default: the world group) that share one host, by reading each other's
    memory directly.

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
    full peer-to-peer mesh) fall back to torch.distributed with one logged
    reason, as do reductions of dtypes other than float32/float16/bfloat16.
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
        self.max_bytes = staging_bytes(max_bytes)
        self.timeout_s = timeout_seconds(timeout)
        self.debug = bool(int(os.environ.get(DEBUG_ENV, "0"))) if debug is None else bool(debug)
        self._calls = 0  # calls served, numbering them for the debug fingerprint and Triton's records
        self._capturing = False
        self._closed = False
        self._closing = None  # the engine while a close() runs: an abort on another thread still reaches its calls
        self._engine = None  # None: every call goes to torch.distributed (fallback_reason)
        self._eager = OFF  # the eager fast path (eager.py), made once here
        setup = agree_on_group(self.group, self.world_size, self.device, self.backend, engine_type, self.max_bytes,
                               engine_type.resolve_nblocks(nblocks, self.device))
        self.nblocks, self._crossover, self.fallback_reason = setup.nblocks, setup.crossover, setup.fallback_reason
        if self.fallback_reason is None and setup.calibrate:
            self._crossover = calibrate.measure(engine_type, self.group, self.rank, self.world_size, self.device,
                                                self.nblocks, self.timeout_s, setup.kind, setup.crossover,
                                                setup.round_bytes)
        if self.fallback_reason is None:
            self._engine = engine_type(self.group, self.rank, self.device, self.max_bytes, self.nblocks,
                                       self.timeout_s)
            if setup.round_bytes is not None and self._engine.handle is not None:
                _C.set_round_bytes(self._engine.handle, setup.round_bytes)  # the host backend's rounds
            if self._engine.handle is not None and not self.debug:
                self._eager = EagerPath(self._engine.handle, self._crossover)
            live.opened(self, setup.gpu, self.nblocks)
        else:
            logs.log_once(f"using torch.distributed.all_reduce for this group: {self.fallback_reason}")

    def all_reduce(self, tensor, op="sum", algo="auto", out=None):
        """Returns the reduction of `tensor` across ranks (out-of-place); writes
        into `out` (same shape, dtype, device) when given. The result does not
        require grad: collectives are not differentiated."""
        result = None if is_dynamo_compiling() else self._eager.all_reduce(tensor, out, op, algo)
        if result is not None:
            self._calls += 1
            return result
        average = parse_op(op)
        self._check_tensor(tensor, "tensor")
        out = output(tensor, out, tensor.shape, self.device, same_shape=True)
        self._reduce(data(tensor), data(out), average, algo)
        return out

    def all_reduce_(self, tensor, op="sum", algo="auto"):
        """Reduces `tensor` in place across ranks and returns it (its data is
        changed outside autograd, as torch.distributed.all_reduce does)."""
        if not is_dynamo_compiling() and self._eager.all_reduce(tensor, tensor, op, algo) is not None:
            self._calls += 1
            return tensor
        average = parse_op(op)
        self._check_tensor(tensor, "tensor")
        self._reduce(data(tensor), data(tensor), average, algo)
        return tensor

    def reduce_scatter(self, tensor, op="sum", out=None):
        """Reduce-scatter: `tensor` holds world_size equal segments (its numel a
        multiple of the world size); rank r gets the reduction of segment r
        over the ranks. Returns it, in `out` when given (numel // world_size
        elements of the same dtype; it may be this rank's segment of `tensor`),
        else in a new tensor of shape (d0 // world_size, *rest) (flat when d0
        does not divide). The sum is the fixed rank-order fp32 sum of
        all_reduce: the bits of all_reduce(tensor) in segment r."""
        if out is not None and self._direct_segments(_C.REDUCE_SCATTER, tensor, out, average_or_none(op)):
            return out
        average = parse_op(op)
        self._check_tensor(tensor, "tensor")
        tried_direct = out is not None
        out = output(tensor, out, scattered_shape(tensor, self.world_size), self.device)
        self._scatter_or_gather(_C.REDUCE_SCATTER, data(tensor), data(out), average, tried_direct)
        return out

    def all_gather(self, tensor, out=None):
        """All-gather: every rank's `tensor`, concatenated in rank order. Returns
        it, in `out` when given (world_size x numel elements of the same dtype;
        `tensor` may be this rank's segment of it, as FSDP2 passes), else in a
        new tensor of shape (world_size * d0, *rest). Any dtype (a byte copy)."""
        if out is not None and self._direct_segments(_C.ALL_GATHER, tensor, out, False):
            return out
        self._check_tensor(tensor, "tensor")
        tried_direct = out is not None
        out = output(tensor, out, gathered_shape(tensor, self.world_size), self.device)
        self._scatter_or_gather(_C.ALL_GATHER, data(tensor), data(out), False, tried_direct)
        return out

    def register(self, tensor):
        """Collective: lets peers read `tensor` in place (zero copy) in later calls.

        For buffers reused across calls (DDP buckets, CUDA-graph inputs) on the
        CUDA backend; every rank registers its corresponding buffer (same size)
        in the same order. Returns True when registered; False on the backends
        that always copy, and for memory legacy CUDA IPC cannot export
        (expandable segments: logged), which keeps the staging copy.
        The communicator keeps `tensor` alive, and the peers keep it mapped,
        until unregister(tensor) or close() on every rank: unregister a buffer
        no longer needed.
        """
        self._check_tensor(tensor, "tensor")
        return self._engine is not None and self._engine.register(tensor)

    def unregister(self, tensor):
        """Collective: undoes register(tensor), every rank in the same order.
        Returns whether it was registered. Later calls reading it copy again.

        Waits for this device's kernels (once ours are done, no peer reads the
        buffer either: the registered modes end at a barrier every rank's
        kernel passes), unmaps the peers' allocations nothing here still uses,
        and drops the reference only when every rank has unmapped. An error on
        any rank raises on every rank and keeps the buffer allocated until
        exit. Do not replay a CUDA graph that read the buffer in place.
        """
        self._check_tensor(tensor, "tensor")
        return self._engine is not None and self._engine.unregister(tensor)

    @contextlib.contextmanager
    def capture(self):
        """Collective: wrap CUDA graph captures of all_reduce calls in this::

            with comm.capture():
                with torch.cuda.graph(graph):
                    y = comm.all_reduce(x)

        Replays stay correct however often they run, in step with each other
        and with eager calls. On the CUDA backend, buffers registered before
        are read in place, and every captured call that can read its input in
        place is registered when this context exits, so its replays skip the
        staging copy (inputs that cannot be exported keep it; logged). Every
        rank must capture the same calls: a mismatch, or a capture that failed
        on some rank, raises at exit on every rank. Inside, nothing talks to
        the host (the debug fingerprint is skipped).
        """
        check_capture_entry(self.device, self._capturing)
        # The engine's, read once: a close() inside must not change what the exit does.
        with self._engine.capture() if self._engine is not None else contextlib.nullcontext():
            self._capturing = True
            try:
                yield self
            finally:
                self._capturing = False

    def check(self):
        """Raises what this communicator's CUDA kernels recorded (the ranks'
        calls differed, a deadline passed), which the next call raises
        otherwise: a CUDA call returns before its kernel has run. Waits for the
        device. The CPU backend raises at once: nothing to do there."""
        if self._engine is not None:
            self._engine.check()

    def close(self):
        """Releases the mapped memory. Safe to call twice. On CUDA it is
        collective (an exported allocation must not be freed while a peer maps
        it): registered buffers and captured inputs are dropped once every rank
        has unmapped them, and graphs captured with this communicator must not
        be replayed any more.

        Leaving `with Communicator(...)` by an exception, garbage collection
        and process exit close without the other ranks (they may be gone):
        this device's kernels are waited for and the peers unmapped, but the
        own memory stays allocated until exit (logged once).
        """
        self._close(sync=True)

    def abort(self):
        """Ends this communicator without the other ranks, from any thread: for
        a rank that gives up on a peer (a watchdog, a fault-tolerant trainer;
        torch.distributed's abort of a "pyallreduce" group calls it). A CPU
        call waiting for a peer on another thread raises within about 0.1 s,
        a CUDA kernel waiting for one gives up within milliseconds, as with
        ncclCommAbort (not in the last barrier of a zero-copy call, which
        protects the peers' in-place reads; compiled Triton kernels wait for
        their deadline), and no call starts after it; a call inside a
        torch.distributed fallback ends with that collective. Then it closes
        as after an error (see close()), which is what it is: an exception
        inside `with Communicator(...)`, garbage collection and process exit
        interrupt such calls too (not kernels: their peers may be only late).
        Beside a close() running on another thread it only interrupts: that
        close stops waiting for such a call, and stays collective. Safe to
        call twice, and after close().
        """
        self._close(sync=False, end_kernels=True)

    def _interrupt(self, end_kernels=True):
        """abort()'s first half: a call or kernel waiting gives up, none starts
        (Engine.interrupt); also while a close() on another thread waits for one."""
        engine = self._engine  # each read once, in the order _close() moves the engine
        if engine is None:
            engine = self._closing
        if engine is not None:
            engine.interrupt(end_kernels)

    def _close(self, sync, end_kernels=False):
        if self._closed:
            if not sync:  # an abort (or exit) beside a close() that may wait for a call in flight
                self._interrupt(end_kernels)
            return
        self._closed = True
        live.closed(self)
        engine = self._closing = self._engine  # until its close returns: _interrupt() reaches it there
        self._engine, self._eager = None, OFF
        if engine is None:
            return
        try:
            if not sync:  # without the peers: a call waiting on another thread (at exit, a daemon's) gives up first
                engine.interrupt(end_kernels)
        finally:
            try:
                engine.close(sync)
            finally:
                self._closing = None

    @property
    def closed(self):
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self._close(sync=True)
            return
        # After an error the peers may never reach a collective close; and that
        # error, not one of the close after it (say on a GPU a fault left unusable), is the one to see.
        try:
            self._close(sync=False)
        except Exception as e:
            logs.log_once(f"closing after an error failed too: {e}")

    def __del__(self):
        try:
            self._close(sync=False)
        except Exception:
            pass

    def __repr__(self):
        how = f"fallback ({self.fallback_reason})" if self.fallback_reason else f"backend={self.backend}"
        return (f"Communicator(rank={self.rank}, world_size={self.world_size}, device={self.device}, {how}, "
                f"max_bytes={self.max_bytes})")

    @property
    def crossover(self):
        """The crossover row "auto" follows (policy.py; every rank's is rank 0's)."""
        return self._crossover

    @crossover.setter
    def crossover(self, row):
        # Another row (bench/compare_nccl.py times its --crossovers-file's), for the eager path too.
        self._crossover = row
        eager = self._eager  # read once: a close() on another thread sets OFF
        if eager is not OFF:
            self._eager = EagerPath(eager.handle, row)
            if self._closed:  # that close ran meanwhile: its OFF stands
                self._eager = OFF

    def _direct_segments(self, collective, src, dst, average):
        """Whether the eager fast path ran this reduce-scatter or all-gather."""
        if not self._eager.scatter_or_gather(collective, src, dst, average):
            return False
        self._calls += 1
        return True

    def _check_tensor(self, tensor, name):
        if self._closed:
            raise RuntimeError("pyallreduce: this communicator is closed; create a new Communicator")
        check_tensor(tensor, name, self.device)

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
        nbytes = nbytes_of(src)  # not .nbytes: works on symbolic shapes (torch.compile)
        if (self._engine is not None and src.dtype in REDUCED_DTYPES and 0 < nbytes <= self.max_bytes
                and src.is_contiguous() and dst.is_contiguous() and not self.debug
                and not (algo == "auto" and self.crossover.prefers_reference(nbytes))):
            # The common case, kept short: one call, no views.
            return self._run(src, dst, algo_id(algo, self.crossover, nbytes), average)
        algo_id(algo, self.crossover, 0)  # reject an unknown name even where the fallback runs
        if self.debug and not self._capturing:  # before any branch: every rank takes part
            reference.check_fingerprint(self._calls, src, average, algo, self.group, self.world_size)
        reason = self._reference_reason(src.dtype, nbytes, algo)
        if reason is not None:
            return self._fallback(reason, _C.AGREE_ONLY, src, dst, average)
        if src.numel() == 0:
            self._agree(src, dst, average, _C.MODE_STAGED)
            return
        # Chunks are checked one pair at a time below: chunk k's out could be chunk k+1's input.
        # (Not while tracing: torch.compile cannot compare data pointers.)
        problem = None if dst is src or torch.compiler.is_compiling() else partial_overlap_problem(src, dst)
        if problem is not None:
            raise RuntimeError(problem)
        reduce_in_chunks(lambda s, d: self._run(s, d, algo_id(algo, self.crossover, nbytes_of(s)), average),
                         src, dst, self.max_bytes // src.element_size())

    def _scatter_or_gather(self, collective, src, dst, average, tried_direct):
        """dst = reduce_scatter(src) or all_gather(src) across ranks (collective: _C.REDUCE_SCATTER,
        _C.ALL_GATHER); checked by the caller. One place decides: kernels or fallback,
        chunking, and the contiguous copies."""
        if not tried_direct and self._direct_segments(collective, src, dst, average):  # the out made here
            return
        scatters = collective == _C.REDUCE_SCATTER
        segment = dst if scatters else src  # protocol.h's S: the per-rank part
        if self.debug and not self._capturing:
            reference.check_fingerprint(self._calls, src, average, COLLECTIVE_NAMES[collective], self.group,
                                        self.world_size)
        reason = self.fallback_reason
        if reason is None and scatters:
            reason = not_reduced_reason(src.dtype)
        piece = None if reason is not None else self._engine_of_call().piece_bytes(collective, src.element_size())
        if piece == 0:
            reason = f"max_bytes={self.max_bytes} is too small for {self.world_size} segments"
        if reason is not None:
            return self._fallback(reason, collective, src, dst, average)
        if nbytes_of(segment) == 0:
            return self._agree(src, dst, average, _C.MODE_STAGED, collective)

        def run(s, d):
            self._engine_of_call().scatter_or_gather(collective, s, d, average, self._next_call())

        scatter_or_gather_in_pieces(run, scatters, src, dst, self.rank, self.world_size,
                                    None if piece is None else piece // src.element_size())

    def _fallback(self, reason, collective, src, dst, average):
        """The call by torch.distributed for `reason`, after the agreement round."""
        reference.announce(reason, collective, self.device, self.group)
        self._agree(src, dst, average, _C.MODE_FALLBACK, collective)
        reference.run(collective, src, dst, average, self.group, self.world_size)

    def _agree(self, src, dst, average, mode, collective=_C.AGREE_ONLY):
        """The agreement round of a call the kernels do not run (a fallback, an
        empty tensor): a rank whose call differs makes every rank raise instead
        of each waiting in a different collective. Skipped where the group is
        not served (no shared memory to meet in), under torch.compile (the
        compiled graph holds only the torch.distributed collective) and inside
        a CUDA graph capture (comm.capture() compares the captured calls)."""
        if self._engine is None or torch.compiler.is_compiling() or stream_capturing(self.device):
            return
        self._calls += 1
        nbytes, in_place = described_bytes(collective, src, dst, self.rank)
        self._engine_of_call().agree(_C.dtype_code(src.dtype), nbytes, mode, average, in_place, collective,
                                     self._calls, src.device)

    def _run(self, src, dst, kernel, average):
        self._engine_of_call().all_reduce(src, dst, kernel, average, self._next_call())

    def _next_call(self):
        """The number of the call about to run. Not counted while torch.compile
        traces: the counter would be a constant of the graph, which Dynamo
        guards on, so every later call would recompile (and fail at its
        recompile limit); a compiled call's number, which only names it in
        Triton's error records, is that of the last eager call."""
        if not torch.compiler.is_compiling():
            self._calls += 1
        return self._calls

    def _engine_of_call(self):
        """The engine, for the next step of a call the kernels run; raises when
        close() or abort() on another thread ended it since the call began."""
        engine = self._engine
        if engine is None:
            raise RuntimeError(CLOSED_DURING_CALL)
        return engine
