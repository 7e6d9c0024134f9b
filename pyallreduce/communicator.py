"""Communicator: the one place that decides backend, algorithm, chunking and
fallback for the collectives of one process group on one node."""
import atexit
import contextlib
import datetime
import logging
import os
import weakref

import torch
import torch.distributed as dist

from . import _C, ops, policy  # noqa: F401  (ops: fake impls for torch.compile)
from .protocol import REDUCED_DTYPES, host_id, is_own_segment, not_reduced_reason, overlaps, partial_overlap_problem
from .transport import HostShmTransport

logger = logging.getLogger("pyallreduce")

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)  # torch.distributed's default too
DEFAULT_MAX_BYTES = 32 << 20
BACKENDS = ("auto", "cuda", "triton", "cpu")
ALGOS = {"one_shot": _C.ONE_SHOT, "two_shot": _C.TWO_SHOT}
# Programs per rank for the Triton kernels on CPU, where the interpreter runs
# them one after another: few keeps the per-call cost down.
TRITON_CPU_NBLOCKS = 2
CUDA_NBLOCKS = 32  # not yet measured on a GPU; see README
# Graph-table entries per block (72 bytes of device memory each): one
# comm.capture() can make at least half a block of captured calls zero copy.
GRAPH_TABLE_BLOCK = 8192
CAPTURE_ABORTED = "its capture raised"  # what a rank whose capture failed tells the others at exit
DEBUG_ENV = "PYALLREDUCE_DEBUG"

# The overloads themselves: calling them skips torch.ops' overload resolution.
_all_reduce_out = torch.ops.pyallreduce.all_reduce_out.default
_all_reduce_inplace = torch.ops.pyallreduce.all_reduce_.default
_reduce_scatter_out = torch.ops.pyallreduce.reduce_scatter_out.default
_all_gather_out = torch.ops.pyallreduce.all_gather_out.default
# torch >= 2.14 names the tensor forms *_single and warns on every call of the older names.
_dist_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_dist_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)

_logged = set()


def log_once(message):
    if message not in _logged:
        _logged.add(message)
        logger.warning("pyallreduce: %s", message)


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
        self.device = self._resolve_device(device)
        self.backend = self._resolve_backend(backend)
        if int(max_bytes) <= 0:
            raise ValueError(f"pyallreduce: max_bytes must be positive, got {max_bytes}")
        self.max_bytes = -(-int(max_bytes) // _C.ALIGNMENT) * _C.ALIGNMENT
        self.timeout_s = _timeout_seconds(timeout)
        self.debug = bool(int(os.environ.get(DEBUG_ENV, "0"))) if debug is None else bool(debug)
        self.nblocks = self._resolve_nblocks(nblocks)
        self.crossover = None  # set by _unsupported_group_reason: the same row on every rank
        self._calls = 0
        self._capturing = False
        self._broken_reason = None  # the Triton path's; the C++ context keeps its own
        self._last_stream, self._launched = None, None  # the Triton path's launch order on GPU
        self._transport = None
        self._handle = None
        self._closed = False
        self._gpu = None  # the GPU whose blocks this communicator's kernels hold (policy.resident_nblocks)
        self.fallback_reason = self._unsupported_group_reason()
        if self.fallback_reason is None:
            self._transport = self._make_transport()
            if self.backend == "triton":
                from . import triton_kernels

                triton_kernels.prepare(self._transport.regions, self.device)
            else:
                self._handle = _C.create_context(
                    self._transport.regions, self.rank, self.max_bytes, self.nblocks, self.timeout_s,
                    self.device.index if self.device.type == "cuda" else -1, self._transport.pids)
                if self._cuda_kernels:  # here, not at the first call, which may be inside a capture
                    _C.cuda_prepare(self._handle)
        else:
            self._gpu = None  # no kernels
            log_once(f"using torch.distributed.all_reduce for this group: {self.fallback_reason}")
        _live.add(self)

    # ---- construction helpers --------------------------------------------

    def _resolve_device(self, device):
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

    def _resolve_backend(self, backend):
        if backend not in BACKENDS:
            raise ValueError(f"pyallreduce: backend must be one of {BACKENDS}, got {backend!r}")
        on_gpu = self.device.type == "cuda"
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

    def _resolve_nblocks(self, nblocks):
        if self.backend == "cpu":
            return 1  # the host kernel runs one block per rank
        if nblocks is None:
            nblocks = CUDA_NBLOCKS if self.device.type == "cuda" else TRITON_CPU_NBLOCKS
        if not 1 <= int(nblocks) <= _C.MAX_BLOCKS:
            raise ValueError(f"pyallreduce: nblocks must be in 1..{_C.MAX_BLOCKS}, got {nblocks}")
        return int(nblocks)

    def _unsupported_group_reason(self):
        """Collective: every rank reaches the same answer. Raises on every rank
        when the ranks asked for different settings: a different nblocks makes
        blocks wait for peers that never come, a different max_bytes makes
        odd-epoch reads run past a smaller peer's region. Lowers nblocks on
        every rank alike when ranks share a GPU (policy.resident_nblocks), and
        takes rank 0's crossover row on every rank (a rank whose kind differs,
        e.g. another PYALLREDUCE_CPU_ISA, would otherwise pick other algorithms)."""
        kind, kind_error = None, None
        try:
            kind = policy.device_kind(self.device)
        except RuntimeError as e:  # raised below on every rank, not here on this one alone
            kind_error = str(e)
        gpu = self._gpu_capacity()
        if gpu is not None:  # and the blocks that this rank's live communicators hold on that GPU
            gpu = (*gpu, sum(c.nblocks for c in _live if c._gpu == gpu[0] and not c._closed))
        mine = (host_id(), self.backend, self.device.type, self.max_bytes, self.nblocks, gpu, kind, kind_error)
        every = [None] * self.world_size
        dist.all_gather_object(every, mine, group=self.group)
        failed = [f"rank {q}: {e[7]}" for q, e in enumerate(every) if e[7]]
        if failed:
            raise RuntimeError("pyallreduce: " + "; ".join(failed))
        self.crossover = policy.lookup(every[0][6], self.world_size)
        if len({e[1:5] for e in every}) > 1:
            rows = "\n".join(f"  rank {q}: backend={e[1]!r}, device={e[2]}, max_bytes={e[3]}, nblocks={e[4]}"
                             for q, e in enumerate(every))
            raise ValueError("pyallreduce: the ranks created this Communicator with different settings; "
                             f"every rank must pass the same backend, device type, max_bytes and nblocks:\n{rows}")
        hosts = [e[0] for e in every]
        if len(set(hosts)) > 1:
            return f"the group spans {len(set(hosts))} hosts"
        gpus = [e[5] for e in every]
        if None not in gpus:
            self.nblocks, reason = policy.resident_nblocks(self.nblocks, gpus)
            if reason:
                log_once(reason)
            self._gpu = gpu[0]
        if self.world_size > _C.MAX_RANKS:
            return f"world size {self.world_size} exceeds {_C.MAX_RANKS}"
        if self.device.type == "cuda":
            from .transport.cuda_ipc import check_topology

            ok, reason = check_topology(self.group, self.device)
            if not ok:
                return reason
        return None

    def _gpu_capacity(self):
        """(this rank's GPU, how many blocks of our kernels it holds at once),
        or None (no GPU kernels, or the GPU cannot tell). The Triton kernels'
        occupancy is not queried: one block per SM, which they always fit."""
        if self.device.type != "cuda" or self.world_size > _C.MAX_RANKS:
            return None
        try:
            index = self.device.index
            if self.backend == "cuda":
                blocks = _C.cuda_resident_blocks(index, self.world_size)
            else:
                blocks = torch.cuda.get_device_properties(index).multi_processor_count
            return (_C.cuda_pci_bus_id(index), blocks)
        except RuntimeError:
            return None

    def _make_transport(self):
        if self.device.type == "cuda":
            from .transport.cuda_ipc import CudaIpcTransport

            return CudaIpcTransport(self.group, self.max_bytes, self.device)
        return HostShmTransport(self.group, self.max_bytes)

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
        if not self._cuda_kernels:
            return False
        from .transport.cuda_ipc import RegistrationError

        try:
            addrs = self._transport.register(tensor)
        except RegistrationError as e:
            log_once(f"buffer not registered, the staging copy is used: {e}")
            return False
        _C.cuda_register_buffer(self._handle, tensor.data_ptr(), tensor.nbytes, addrs)
        return True

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
        if not self._cuda_kernels:
            return False
        from .transport.cuda_ipc import agree, park

        ptr, kept, error, found = tensor.data_ptr(), [], None, False
        try:
            _C.cuda_synchronize(self.device.index)
            found = _C.cuda_unregister_buffer(self._handle, ptr)
            kept, error = self._transport.unregister(ptr)
        except RuntimeError as e:
            error = str(e)
        try:
            agree(error, self.group, "unregistering a buffer", RuntimeError)
        except RuntimeError:
            park(self.device.index, None, kept)
            raise
        return bool(found or kept)

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
        if self.device.type != "cuda":
            raise RuntimeError("pyallreduce: capture() is for CUDA graphs; this communicator serves "
                               f"{self.device}")
        if self._capturing:
            raise RuntimeError("pyallreduce: comm.capture() is already open; do not nest it")
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("pyallreduce: enter comm.capture() before torch.cuda.graph(...), not inside it: "
                               "the captured calls are registered when it exits, which talks to the other ranks")
        table = self._cuda_kernels  # read once: a close() inside must not change what the exit does
        if table:
            self._open_graph_table()
        self._capturing = True
        try:
            yield self
        except BaseException:
            self._capturing = False
            if table:
                with contextlib.suppress(Exception):  # the capture's own error is the one to see
                    self._register_captured(aborted=True)
            raise
        self._capturing = False
        if table:
            self._register_captured(aborted=False)

    def _open_graph_table(self):
        """Collective: opens the graph table on every rank, or on none."""
        from .transport.cuda_ipc import agree

        error = None
        try:
            _C.cuda_graph_capture_begin(self._handle, GRAPH_TABLE_BLOCK)
        except RuntimeError as e:
            error = str(e)
        try:
            agree(error, self.group, "opening the graph table for comm.capture()", RuntimeError)
        except RuntimeError:
            if error is None:
                _C.cuda_graph_capture_end(self._handle)  # opened here, but not on every rank
            raise

    def _register_captured(self, aborted):
        """Collective, at capture() exit: makes the captured calls that have a
        graph entry on every rank zero copy on every rank, or on none. Every
        rank makes the same gathers whatever happens here: a rank whose capture
        failed (aborted) or that cannot take part says so in the first one and
        every other rank raises, instead of some waiting for the others."""
        from .transport.cuda_ipc import RegistrationError, agree, gather

        calls, calls_without_entry, problem = [], 0, CAPTURE_ABORTED if aborted else None
        try:
            calls, calls_without_entry = _C.cuda_graph_capture_end(self._handle)
            if torch.cuda.is_current_stream_capturing():
                problem = problem or ("leave comm.capture() after the torch.cuda.graph(...) capture "
                                      "ended, not inside it")
        except RuntimeError as e:
            problem = problem or str(e)
        # Per call: (bytes, in place, algo, dtype, average, has an entry here).
        every = gather(problem or [(*signature, slot >= 0) for slot, _, *signature in calls], self.group)
        if aborted:
            return  # the capture's own error propagates
        mismatch = captures_mismatch(every)
        if mismatch:
            raise RuntimeError(mismatch)
        if calls_without_entry:
            log_once(f"{calls_without_entry} captured calls keep the staging copy: more than "
                     f"{GRAPH_TABLE_BLOCK // 2} in one comm.capture() may not all get a graph entry")
        # A call is zero copy only where every rank could give it an entry
        # (an input a rank had to copy for alignment has none there).
        zero_copy = [k for k in range(len(calls)) if all(e[k][-1] for e in every)]
        if not zero_copy:
            return
        buffers = [(calls[k][1], calls[k][2]) for k in zero_copy]
        try:  # no kernel of ours may read an entry while it changes, on any rank
            _C.cuda_synchronize(self.device.index)
        except RuntimeError as e:  # the peers still take part in the exchange below
            buffers = [f"synchronising the device failed: {e}"] * len(zero_copy)
        try:
            shared = self._transport.share_buffers(buffers)
        except RegistrationError as e:  # raised on every rank alike
            log_once(f"the captured calls keep the staging copy: {e}")
            return
        kept = [addrs for addrs in shared if isinstance(addrs, str)]
        if kept:
            log_once(f"{len(kept)} of {len(zero_copy)} captured calls keep the staging copy: {kept[0]}")
        slots = [calls[k][0] for k, addrs in zip(zero_copy, shared) if not isinstance(addrs, str)]
        error = None
        try:
            _C.cuda_graph_set_entries(self._handle, slots, [a for a in shared if not isinstance(a, str)])
        except RuntimeError as e:
            error = str(e)
        try:  # also: nobody replays before every rank wrote
            agree(error, self.group, "registering the captured buffers", RuntimeError)
        except RuntimeError:
            _C.cuda_graph_reset_entries(self._handle, slots)  # staged again, like every other rank
            raise

    def check(self):
        """Raises what this communicator's CUDA kernels recorded (the ranks'
        calls differed, a deadline passed). A CUDA call returns before its
        kernel has run, so such an error is otherwise raised by the next call
        (a mismatch leaves the communicator usable; a deadline does not).
        Waits for the device. Calls on the CPU backend raise at once: nothing
        to do there."""
        if self._cuda_kernels:
            _C.check(self._handle)

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
        transport, self._transport = self._transport, None
        regions = list(transport.regions) if transport is not None else []  # close() empties them
        try:
            if self._cuda_kernels:
                from .transport.cuda_ipc import synchronize_quietly

                # No kernel of ours may read the graph table while it is freed. The
                # inputs of zero-copy graph entries, which peers map, come back: the
                # transport drops them with the registered buffers, after every rank
                # has unmapped them (or never, without sync).
                synchronize_quietly(self.device)
                transport.keep(_C.cuda_clear_buffers(self._handle))
        finally:
            try:
                if self._handle is not None:
                    _C.destroy_context(self._handle)
                    self._handle = None
            finally:
                if transport is not None:
                    if self.device.type == "cuda":
                        transport.close(sync=sync)
                    else:
                        transport.close()
                    if self.backend == "triton":  # its kernels have finished (transport.close waited)
                        from . import triton_kernels

                        triton_kernels.release(regions, self.device)

    @property
    def _cuda_kernels(self):
        """Whether calls run the CUDA C++ kernels (zero copy and graph tables are theirs)."""
        return self._handle is not None and self.backend == "cuda"

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
        if (self._handle is not None and src.dtype in REDUCED_DTYPES and 0 < nbytes <= self.max_bytes
                and src.is_contiguous() and dst.is_contiguous() and not self.debug
                and not (algo == "auto" and self.crossover.prefers_reference(nbytes))):
            # The common case, kept short: one call, no views.
            return self._run(src, dst, self._algo_id(algo, nbytes), average)
        self._algo_id(algo, 0)  # reject an unknown name even where the fallback runs
        if self.debug and not self._capturing:  # before any branch: every rank takes part
            self._check_fingerprint(src, average, algo)
        reason = self._reference_reason(src.dtype, src.numel() * src.element_size(), algo)
        if reason is not None:
            if not torch.compiler.is_compiling():
                log_once(f"torch.distributed.all_reduce used: {reason}")
                self._check_reference_capturable(reason)
            self._agree(src, dst, average, _C.MODE_FALLBACK)
            return self._reference_all_reduce(src, dst, average)
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

    def _scatter_or_gather(self, algo, src, dst, average):
        """dst = reduce_scatter(src) or all_gather(src) across ranks (algo: _C.REDUCE_SCATTER,
        _C.ALL_GATHER); checked by the caller. One place decides: kernels or fallback,
        chunking, and the contiguous copies."""
        if (self._handle is not None and not self.debug and _eager(src) and type(dst) is torch.Tensor
                and _C.try_collective_eager(src, dst, self._handle, algo, average)):
            self._calls += 1  # the common case, kept short (as in _direct)
            return
        scatters = algo == _C.REDUCE_SCATTER
        segment = dst if scatters else src  # protocol.h's S: the per-rank part
        nbytes = segment.numel() * segment.element_size()
        if self.debug and not self._capturing:
            self._check_fingerprint(src, average, "reduce_scatter" if scatters else "all_gather")
        reason = self.fallback_reason
        if reason is None and scatters:
            reason = not_reduced_reason(src.dtype)
        if reason is None and self.backend != "cpu" and self._piece_bytes(algo, segment.element_size()) == 0:
            reason = f"max_bytes={self.max_bytes} is too small for {self.world_size} segments"
        if reason is not None:
            if not torch.compiler.is_compiling():
                log_once(f"torch.distributed used for {'reduce_scatter' if scatters else 'all_gather'}: {reason}")
                self._check_reference_capturable(reason)
            self._agree(src, dst, average, _C.MODE_FALLBACK, algo)
            return self._reference_scatter_or_gather(scatters, src, dst, average)
        if nbytes == 0:
            return self._agree(src, dst, average, _C.MODE_STAGED, algo)
        # Contiguous, and not overlapping except as protocol.h allows (this rank's
        # segment of the larger tensor); anything else through copies.
        src_c = src if src.is_contiguous() else src.contiguous()
        dst_c = dst if dst.is_contiguous() else torch.empty(dst.shape, dtype=dst.dtype, device=dst.device)
        whole, part = (src_c, dst_c) if scatters else (dst_c, src_c)
        if overlaps(src_c, dst_c) and not is_own_segment(part, whole, self.rank):
            src_c = src_c.clone()
        self._run_scatter_or_gather(algo, src_c.view(-1), dst_c.view(-1), average)
        if dst_c is not dst:
            dst.copy_(dst_c)

    def _piece_bytes(self, algo, element_size):
        """The GPU backends stage a whole call: the most bytes of each segment one
        call moves (a multiple of the element size), 0 if not one element fits."""
        if algo == _C.REDUCE_SCATTER:
            per = self.max_bytes // self.world_size // _C.SEGMENT_UNIT * _C.SEGMENT_UNIT
        else:
            per = self.max_bytes
        return per // element_size * element_size

    def _run_scatter_or_gather(self, algo, src, dst, average):
        """Flat contiguous src/dst with nonzero bytes. The host backend takes any
        size (its kernels run in rounds); the GPU ones in pieces of every segment
        that staging holds, through contiguous copies of the pieces."""
        scatters = algo == _C.REDUCE_SCATTER
        n = dst.numel() if scatters else src.numel()  # elements per segment
        per = n if self.backend == "cpu" else self._piece_bytes(algo, src.element_size()) // src.element_size()
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
            if self.backend == "triton":
                from . import triton_kernels

                t = self._transport
                if scatters:
                    self._triton(triton_kernels.reduce_scatter, s, d, t.regions, self.rank, self.world_size,
                                 self.max_bytes, self.nblocks, average, self.timeout_s, self._calls)
                else:
                    self._triton(triton_kernels.all_gather, s, d, t.regions, self.rank, self.world_size,
                                 self.max_bytes, self.nblocks, self.timeout_s, self._calls)
            elif scatters:
                _reduce_scatter_out(s, d, self._handle, average)
            else:
                _all_gather_out(s, d, self._handle)
            if not scatters and d is not dst:
                dst.view(self.world_size, n)[:, start:stop].copy_(d.view(self.world_size, -1))

    def _reference_scatter_or_gather(self, scatters, src, dst, average):
        if average and not (src.is_floating_point() or src.is_complex()):
            raise ValueError(f"pyallreduce: op='avg' is not defined for {src.dtype}; use op='sum'")
        work = torch.empty(dst.numel(), dtype=dst.dtype, device=dst.device)
        if scatters:
            _dist_reduce_scatter(work, src.contiguous().view(-1), op=dist.ReduceOp.SUM, group=self.group)
            if average:
                work.div_(self.world_size)
        else:
            _dist_all_gather(work, src.contiguous().view(-1), group=self.group)
        dst.copy_(work.view(dst.shape))

    def _agree(self, src, dst, average, mode, algo=None):
        """The agreement round for a call that does not go through the kernels
        (a torch.distributed fallback, an empty tensor): the peers check it
        against their own call, so a rank whose call differs makes every rank
        raise instead of each waiting in a different collective. Groups the
        communicator does not serve at all have no shared memory to meet in;
        under torch.compile the round is skipped (the compiled graph holds only
        the torch.distributed collective), and so it is inside a CUDA graph
        capture, where it cannot wait for its answer (the captured calls are
        compared when comm.capture() exits)."""
        if (self._transport is None or torch.compiler.is_compiling()
                or (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing())):
            return
        self._calls += 1
        algo = _C.AGREE_ONLY if algo is None else algo
        if algo == _C.AGREE_ONLY:
            nbytes, in_place = src.numel() * src.element_size(), dst is src
        else:  # protocol.h: W segments; "in place" is the one overlap the kernels allow
            whole, part = (src, dst) if algo == _C.REDUCE_SCATTER else (dst, src)
            nbytes = whole.numel() * whole.element_size()
            in_place = is_own_segment(part, whole, self.rank)
        if self.backend == "triton":
            from . import triton_kernels

            return self._triton(triton_kernels.agree, _C.dtype_code(src.dtype), nbytes, mode, average, in_place,
                                self._transport.regions, self.rank, self.world_size, self.nblocks,
                                self.timeout_s, src.device, self._calls, algo=algo)
        _C.agree(self._handle, _C.dtype_code(src.dtype), nbytes, mode, average, in_place, algo)

    def _triton(self, fn, *args, **kwargs):
        """Runs a Triton collective, keeping the C++ backends' rules: a
        communicator that failed mid-protocol refuses further use; a mismatch
        (every rank raises it, epochs back in step) does not break it."""
        from . import triton_kernels

        if self._broken_reason is not None:
            raise RuntimeError(f"pyallreduce: this communicator is unusable after an earlier failure "
                               f"({self._broken_reason}); close() it and create a new Communicator on every rank")
        # On GPU, each launch runs after the previous one whatever stream each is on
        # (csrc/cuda/call_plan.h LaunchOrder: two kernels of one communicator at once
        # race on its epochs); captured launches are not chained, as there.
        stream = None
        if self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            stream = torch.cuda.current_stream(self.device)
            if self._last_stream is not None and self._last_stream != stream:
                stream.wait_event(self._launched)
        try:
            result = fn(*args, **kwargs)
        except triton_kernels.CallMismatch as e:
            raise RuntimeError(str(e)) from None
        except RuntimeError as e:
            self._broken_reason = str(e).split("\n", 1)[0]  # epochs are out of step across ranks now
            raise
        finally:
            if stream is not None:
                self._launched = self._launched or torch.cuda.Event()
                self._launched.record(stream)
                self._last_stream = stream
        return result

    def _run(self, src, dst, algo_id, average):
        self._calls += 1
        if self.backend == "triton":
            from . import triton_kernels

            t = self._transport
            return self._triton(triton_kernels.all_reduce, src, dst, t.regions, self.rank, self.world_size,
                                self.max_bytes, self.nblocks, algo_id, average, self.timeout_s, self._calls)
        if src is dst:
            _all_reduce_inplace(dst, self._handle, algo_id, average)
        else:
            _all_reduce_out(src, dst, self._handle, algo_id, average)

    def _check_reference_capturable(self, reason):
        """A CUDA graph captures torch.distributed's all-reduce only over NCCL:
        over gloo it invalidates the capture with an error that does not say
        why this call went there."""
        if self.device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            return
        backend = str(dist.get_backend(self.group))
        if "nccl" not in backend:
            raise RuntimeError(
                f"pyallreduce: this collective goes to torch.distributed ({reason}), and the group's backend "
                f"{backend!r} cannot run inside a CUDA graph capture; give the Communicator a group with NCCL "
                "for CUDA tensors, or make this call outside the capture")

    def _reference_all_reduce(self, src, dst, average):
        if average and not (src.is_floating_point() or src.is_complex()):
            raise ValueError(f"pyallreduce: op='avg' is not defined for {src.dtype}; use op='sum'")
        # `is`, not data pointers: torch.compile traces this (fallback dtypes under fullgraph=True).
        work = dst if dst is src and dst.is_contiguous() else src.contiguous().clone()
        dist.all_reduce(work, op=dist.ReduceOp.SUM, group=self.group)
        if average:
            work.div_(self.world_size)
        if work is not dst:
            dst.copy_(work)

    def _check_fingerprint(self, src, average, algo):
        mine = (self._calls, "avg" if average else "sum", str(src.dtype), src.numel(), algo)
        every = [None] * self.world_size
        dist.all_gather_object(every, mine, group=self.group)
        if any(f != mine for f in every):
            rows = "\n".join(f"  rank {q}: (call, op, dtype, numel, algo) = {f}" for q, f in enumerate(every))
            raise RuntimeError(f"pyallreduce: the ranks disagree about this collective:\n{rows}")


def captures_mismatch(every):
    """None, or the error for ranks whose captures inside comm.capture() differ.
    every[q]: rank q's (bytes, in place, algo, dtype, average, has an entry)
    per captured call, or why rank q cannot take part (CAPTURE_ABORTED: its
    capture raised)."""
    failed = [f"rank {q}: {calls}" for q, calls in enumerate(every) if isinstance(calls, str)]
    if failed:
        return ("pyallreduce: comm.capture() failed on " + "; ".join(failed) + ". Do not replay this "
                "graph on the other ranks: its calls would wait for ranks that never replay")
    if all([c[:-1] for c in calls] == [c[:-1] for c in every[0]] for calls in every):
        return None
    rows = "\n".join(f"  rank {q}: {len(calls)} calls, (bytes, in place, algo, dtype, avg) of the first: "
                     f"{[c[:-1] for c in calls[:3]]}" for q, calls in enumerate(every))
    return ("pyallreduce: the ranks captured different all_reduce calls inside comm.capture(); every "
            "rank must capture the same calls in the same order, or the replays wait for each other "
            f"until the deadline:\n{rows}")


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


@atexit.register
def _close_all():
    for comm in list(_live):
        comm._close(sync=False)  # the peers may already be gone
