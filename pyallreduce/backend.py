"""The "pyallreduce" torch.distributed backend.

    import pyallreduce  # registers it
    dist.init_process_group("pyallreduce", ...)      # or "cpu:pyallreduce,cuda:nccl"
    dist.all_reduce(x)                               # served by a pyallreduce.Communicator

Served by a Communicator of the group (one per device, created at the first
call it serves): all_reduce (SUM, AVG), reduce_scatter_tensor and
all_gather_into_tensor, their list forms (all_gather, reduce_scatter) and the
coalesced forms torch routes through (all_reduce_coalesced,
all_gather_into_tensor_coalesced, reduce_scatter_tensor_coalesced). Float32,
float16 and bfloat16 reductions run on its kernels, and all-gathers of any
dtype; other dtypes go to its fallback after its agreement round, so ranks
whose calls differ all raise at once instead of each waiting for the other.
Everything else (broadcast, barrier, send/recv, all_to_all, gather/scatter,
reduce, other ops, object collectives) runs on an inner backend built on the
same store, gloo for CPU tensors and NCCL for CUDA tensors, with one log line
per kind; so do groups the Communicator cannot serve (several hosts).

Why the Communicator is created at the first call, not with the backend: its
setup exchanges (all_gather_object, barrier) go through torch.distributed
functions that need the group *registered* in torch's world table, which it
is only after the creator returns. Torch hands the creator the ProcessGroup
(extended API), which the Communicator is given at the first call. Its
exchanges come back into this backend, which sends them to the inner backend
(they arrive on a thread that is serving a call), as it does the
Communicator's own fallback collectives. "Serving" is per thread: a collective
that another thread issues meanwhile is the user's, and waits its turn for the
Communicator (as NCCL orders a process's collectives) instead of slipping into
the inner backend on one rank and into pyallreduce on another. Every rank
reaches the first served call at the same collective (the choice depends only
on the collective, op and device, which a correct program keeps equal across
ranks), so the collective construction is safe.

The class derives from pyallreduce._C.ServingBackend (csrc/backend.cpp): once
a device's Communicator exists, an eager single-tensor all_reduce,
reduce_scatter_tensor or all_gather_into_tensor that fits its kernels runs
there, in C++, without entering Python (torch's Python trampoline alone costs
more than such a call); everything else comes to the methods below. The turn
and the per-thread "serving" mark live in C++, where that fast path reads them.

torch before 2.9 has no c10d::Backend that the C++ half can be built on. There
the class derives from _PythonProcessGroup instead: a Python ProcessGroup
(torch's Python-backend API of those versions, where a creator's
ProcessGroup is the group itself), with the turn and the mark in Python and
every call served by the methods below: the same results and errors, a few
microseconds slower per call.
"""
import datetime
import threading

import torch
import torch.distributed as dist

from . import _C, logs
from .communicator import Communicator
from .engines import stream_capturing

NAME = "pyallreduce"
INNER_PREFIX = "pyallreduce_inner/"  # the inner backends' keys in the group's store
_SUM, _AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG


def _op_name(reduce_op):
    """The Communicator's op for a c10d ReduceOp, or None (not served here).
    Compared, not looked up: a lookup costs the RedOpType object and its hash."""
    return "sum" if reduce_op == _SUM else "avg" if reduce_op == _AVG else None


_served_devices = {}  # torch.device -> whether the Communicator serves it (device.type costs 0.3 us a call)


def _serves(device):
    served = _served_devices.get(device)
    if served is None:
        served = _served_devices[device] = device.type in ("cpu", "cuda")
    return served


_STRIDED = torch.strided


def _all_strided_on(device, tensors):
    for t in tensors:  # a loop, not any(generator): half the cost for two tensors
        if t.device != device or t.layout is not _STRIDED:
            return False
    return True


# Python name of each Backend method (csrc/backend.cpp forwards them here, by
# torch's trampoline names) that the inner backend serves as it is.
DELEGATED = ("broadcast", "allreduce_sparse", "reduce", "gather", "scatter", "all_to_all_single", "alltoall",
             "send", "recv", "recv_anysource", "barrier", "allgather_coalesced")


# The inner backends' Python names for the methods torch 2.14 renamed: the old
# names, which 2.14 keeps as aliases and older torch knows alone.
_INNER_NAMES = {"all_gather_single": "_allgather_base", "reduce_scatter_single": "_reduce_scatter_base",
                "all_to_all_single": "alltoall_base"}


def _finished(result, error=None, device=None):
    """The Work of a call run here (csrc/backend.cpp FinishedWork, the fast
    path's too): wait() returns True or raises `error`; for CUDA tensors (on
    `device`) it is ordered after the kernels enqueued on its current stream,
    as NCCL's Work (inside a capture the graph orders them: no events).
    A C++ Work, not a Python subclass of Work: torch's Python-Work trampoline
    forwards only wait() and get_future(), so is_completed(), exception() and
    result() would answer for the base class (never completed)."""
    follows = device is not None and device.type == "cuda" and error is None and not stream_capturing(device)
    return _C.finished_work(result, error, device if follows else None)


class _PythonProcessGroup(dist.ProcessGroup):
    """What csrc/backend.cpp's ServingBackend gives PyallreduceBackend, in
    Python, for torch < 2.9. Its method names are torch's of those versions
    (_allgather_base, ...): both its Python callers and its C++ trampoline
    (DDP's reducer) call them."""

    fast_calls = 0  # no C++ fast path

    def __init__(self, rank, size, name):
        super().__init__(rank, size)
        self._name = name
        self._group_name = None
        self._turn = threading.Lock()
        self._turn_holder = None  # the thread ident holding the turn
        self._serving = threading.local()  # .depth: how deep this thread is inside served calls

    def getBackendName(self):
        return self._name

    # The group's name, which torch keeps on a ProcessGroup's C++ backends, of
    # which a Python one has none ("ProcessGroup name not set" for DTensor and
    # the functional collectives).
    def _set_group_name(self, name):
        self._group_name = name

    @property
    def group_name(self):
        return self._group_name

    def _is_serving(self):
        return getattr(self._serving, "depth", 0) > 0

    def _scope(self, turn, serve):
        return _PythonScope(self, turn, serve)

    def _keep_python_object(self):
        pass  # torch holds this object itself

    _drop_python_object = _keep_python_object

    def _set_fast(self, *args):
        pass

    _clear_fast = _keep_python_object


class _PythonScope:
    """ServingBackend::Scope (csrc/backend.cpp), with its rules: the turn is not
    recursive, and a thread that already holds it raises instead of waiting for itself."""

    def __init__(self, group, turn, serve):
        self._group, self._turn, self._serve = group, turn, serve

    def __enter__(self):
        group = self._group
        if self._turn:
            if group._turn_holder == threading.get_ident():
                raise RuntimeError(
                    "pyallreduce: this thread is inside a call of this process group (a signal handler or a "
                    "finalizer interrupted it?), so it would wait for itself: call abort(), "
                    "destroy_process_group() or the collective from another thread, or after the call returns")
            group._turn.acquire()
            group._turn_holder = threading.get_ident()
        if self._serve:
            group._serving.depth = getattr(group._serving, "depth", 0) + 1

    def __exit__(self, *exc):
        group = self._group
        if self._serve:
            group._serving.depth -= 1
        if self._turn:
            group._turn_holder = None
            group._turn.release()
        return False


SERVES_IN_CPP = hasattr(_C, "ServingBackend")  # torch >= 2.9


class PyallreduceBackend(_C.ServingBackend if SERVES_IN_CPP else _PythonProcessGroup):
    def __init__(self, store, rank, world_size, timeout, process_group):
        super().__init__(rank, world_size, NAME)
        self._keep_python_object()  # torch holds the C++ half only
        self._store = dist.PrefixStore(INNER_PREFIX, store)
        self._timeout = timeout
        self._group = process_group
        self._inner = {}  # device type -> the inner gloo / NCCL backend, made at first use
        self._comms = {}  # torch.device -> Communicator
        self._closed = False
        self._inner_backend("cpu")  # gloo's rendezvous now, as every rank creates the group

    # ---- served here ---------------------------------------------------------

    def allreduce(self, tensors, opts):
        op = _op_name(opts.reduceOp)
        if op is None or len(tensors) != 1:
            return self._inner_call("allreduce", f"all_reduce of {len(tensors)} tensors or op {opts.reduceOp.op}",
                                    tensors, opts)
        return self._serve("allreduce", tensors, (tensors, opts), lambda comm: comm.all_reduce_(tensors[0], op))

    def allreduce_coalesced(self, tensors, opts):
        op = _op_name(opts.reduceOp)
        if op is None:
            return self._inner_call("allreduce_coalesced", f"op {opts.reduceOp.op}", tensors, opts)

        def run(comm):
            for t in tensors:
                comm.all_reduce_(t, op)
        return self._serve("allreduce_coalesced", tensors, (tensors, opts), run)

    def reduce_scatter_single(self, output, input, opts):
        op = _op_name(opts.reduceOp)
        if op is None:
            return self._inner_call("reduce_scatter_single", f"op {opts.reduceOp.op}", output, input, opts)
        return self._serve("reduce_scatter_single", [output, input], (output, input, opts),
                           lambda comm: comm.reduce_scatter(input, op, out=output), result=[output])

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        op = _op_name(opts.reduceOp)
        if op is None:
            return self._inner_call("reduce_scatter_single_coalesced", f"op {opts.reduceOp.op}", outputs, inputs,
                                    opts)

        def run(comm):
            for out, x in zip(outputs, inputs, strict=True):
                comm.reduce_scatter(x, op, out=out)
        return self._serve("reduce_scatter_single_coalesced", [*outputs, *inputs], (outputs, inputs, opts), run,
                           result=outputs)

    def reduce_scatter(self, outputs, input_lists, opts):
        op = _op_name(opts.reduceOp)
        if op is None or len(outputs) != 1:
            return self._inner_call("reduce_scatter", f"op {opts.reduceOp.op} or {len(outputs)} outputs", outputs,
                                    input_lists, opts)

        def run(comm):  # the list form: the W inputs side by side, one call
            comm.reduce_scatter(torch.cat([t.reshape(-1) for t in input_lists[0]]), op, out=outputs[0])
        return self._serve("reduce_scatter", [*outputs, *input_lists[0]], (outputs, input_lists, opts), run,
                           result=outputs)

    def all_gather_single(self, output, input, opts):
        return self._serve("all_gather_single", [output, input], (output, input, opts),
                           lambda comm: comm.all_gather(input, out=output), result=[output])

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        def run(comm):
            for out, x in zip(outputs, inputs, strict=True):
                comm.all_gather(x, out=out)
        return self._serve("all_gather_single_coalesced", [*outputs, *inputs], (outputs, inputs, opts), run,
                           result=outputs)

    def allgather(self, output_lists, inputs, opts):
        if len(inputs) != 1:
            return self._inner_call("allgather", f"{len(inputs)} inputs", output_lists, inputs, opts)

        def run(comm):  # the list form: one call into a flat buffer, then the W views
            gathered = comm.all_gather(inputs[0].reshape(-1)).view(self.size(), -1)
            for q, out in enumerate(output_lists[0]):
                out.copy_(gathered[q].view(out.shape))
        return self._serve("allgather", [*output_lists[0], *inputs], (output_lists, inputs, opts), run,
                           result=output_lists[0])

    def _serve(self, name, tensors, args, run, result=None):
        """Runs run(communicator) for a call whose tensors are all on one CPU or
        CUDA device; anything else goes to the inner backend (`args` as given).
        Errors are raised by the Work's wait(), as torch's backends do. Every
        call the C++ fast path declines passes here: kept to plain statements
        (a contextlib.contextmanager or a generator costs a microsecond a call)."""
        serving = self._is_serving()  # inside a Communicator call: its own exchanges go to the inner backend
        device = tensors[0].device if tensors else None
        if serving or device is None or not _serves(device) or not _all_strided_on(device, tensors):
            why = None if serving else "tensors on several devices, sparse, or of a device it does not serve"
            return self._inner_call(name, why, *args)
        if result is None:
            result = tensors
        with self._scope(turn=True, serve=True):  # one served call at a time; other threads wait
            try:
                run(self._comms.get(device) or self._communicator(device))
            except Exception as e:
                return _finished(result, e)
        return _finished(result, device=device)

    def _communicator(self, device):
        """The Communicator for `device`, made at its first call; from then on the
        C++ fast path serves the eager calls it would run directly. Caller holds
        the turn and is serving (its setup exchanges go to the inner backend)."""
        if self._closed:
            raise RuntimeError(f"pyallreduce: this {NAME} process group was destroyed")
        comm = self._comms.get(device)
        if comm is None:
            if stream_capturing(device):
                # Creating one allocates device memory and opens IPC handles, which a
                # capture does not permit (it would invalidate the user's graph).
                raise RuntimeError(f"pyallreduce: the first collective of this {NAME} process group on {device} "
                                   "is inside a CUDA graph capture, where its Communicator cannot be created; "
                                   "make one collective call on this device before capturing")
            comm = Communicator(self._own_group(), device=device, timeout=self._timeout)
            self._comms[device] = comm
            fast_path = comm._eager.backend_args()
            if fast_path is not None:
                self._set_fast(device, *fast_path)
        return comm

    def _own_group(self):
        """The ProcessGroup torch made this backend for: handed to the creator
        from torch 2.14 on; before, found in torch's table of groups, where it
        is by the first call."""
        if not SERVES_IN_CPP:
            return self  # the group itself
        if self._group is None:
            for group in dist.distributed_c10d._world.pg_map:
                for device in group._device_types:
                    backend = group._get_backend(device)  # or, with TORCH_DISTRIBUTED_DEBUG=DETAIL, its checker
                    if backend is self or getattr(backend, "wrapped_pg", None) is self:
                        self._group = group
            if self._group is None:
                raise RuntimeError(f"pyallreduce: this {NAME} backend is in no process group that torch knows")
        return self._group

    def monitored_barrier(self, timeout, wait_all_ranks):
        """The inner gloo backend's (gloo alone has one: it names the ranks
        that did not arrive)."""
        self._inner_backend("cpu").monitored_barrier(timeout, wait_all_ranks)

    # ---- the inner backends ------------------------------------------------

    def _inner_backend(self, device_type):
        inner = self._inner.get(device_type)
        if inner is None:
            store = dist.PrefixStore(f"{device_type}/", self._store)
            if device_type == "cuda":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = self._timeout
                inner = dist.ProcessGroupNCCL(store, self.rank(), self.size(), options)
            else:
                inner = dist.ProcessGroupGloo(store, self.rank(), self.size(), self._timeout)
            self._inner[device_type] = inner
        return inner

    def _inner_call(self, name, why, *args, **kwargs):
        """Backend method `name` of the inner backend for the arguments' device
        (gloo when they hold no CUDA tensor), logging `why` once per kind."""
        if why is not None and not self._is_serving():
            logs.log_once(f"backend {NAME}: {name} is served by the inner backend: {why}")
        inner = self._inner_backend(_device_type(args))
        method = getattr(inner, _INNER_NAMES.get(name, name), None)
        if method is None:  # torch < 2.14 binds no coalesced tensor forms on gloo and NCCL
            raise RuntimeError(f"pyallreduce: {name} of this kind goes to the inner backend "
                               f"({inner.name()}), which torch {torch.__version__} does not offer from Python; "
                               "call the collective once per tensor")
        return method(*args, **kwargs)

    # ---- lifetime ------------------------------------------------------------

    def shutdown(self):
        """destroy_process_group: closes the communicators (collectively) and the inner backends."""
        self._release()

    def abort(self):
        """_abort_process_group: ends without the peers, which may be gone or
        never call it (torch aborts a group to leave it alone), best effort:
        what fails is logged and the rest still ends. First what may keep a
        call of another thread waiting: the inner backends (an NCCL kernel our
        next kernel queues behind; gloo's abort does nothing) and a served call
        or kernel waiting for a peer, which holds the turn (Communicator.abort). Then,
        under the turn, every communicator closes as after an error. (A call
        inside a gloo collective, such as a communicator's construction, holds
        the turn until that ends: gloo cannot be aborted.) On the thread that
        holds the turn (a signal handler inside a served call), the closes
        would wait for that thread itself: the interrupts are done, and taking
        the turn raises, saying so."""
        for inner in list(self._inner.values()):
            if hasattr(inner, "abort"):  # gloo's since torch 2.7
                _logged(inner.abort, "aborting its inner backend")
        for comm in list(self._comms.values()):
            comm._interrupt()
        with self._scope(turn=True, serve=False):
            for comm in self._end():
                _logged(comm.abort, "aborting its communicator")

    def _release(self):
        """Ends every part, each error logged, never raised: torch calls this
        inside destroy_process_group, which an exception would leave with its
        tables half cleared (as NCCL's shutdown, it reports and goes on). Only
        on the thread inside a served call (a signal handler, a finalizer) does
        it raise: it would wait for that call, so for itself."""
        # Under the turn: a call still running on another thread (at worst until its
        # deadline) finishes before its memory is unmapped under it.
        with self._scope(turn=True, serve=False):
            comms = self._end()
            # A CUDA communicator's close is collective (its transport agrees
            # with the peers through this very group, which torch still routes
            # here during destroy_process_group): serving, so that exchange
            # goes to the inner backends, which close only after it.
            with self._scope(turn=False, serve=True):
                for comm in comms:
                    _logged(comm.close, "closing its communicator")
            for inner in self._inner.values():
                if hasattr(inner, "shutdown"):  # gloo's since torch 2.7
                    _logged(inner.shutdown, "shutting down its inner backend")

    def _end(self):
        """Marks the group ended (the caller holds the turn); returns the
        communicators left to end, none the second time."""
        if self._closed:
            return []
        self._closed = True
        self._clear_fast()
        comms, self._comms = list(self._comms.values()), {}
        self._group = None  # breaks the cycle group -> backend -> group
        self._drop_python_object()  # and, before torch 2.14, C++ backend -> this object
        return comms


def _logged(end, what):
    """end(), an error only logged: an abort must reach every part."""
    try:
        end()
    except Exception as e:
        logs.log_once(f"backend {NAME}: {what} failed: {e}")


def _device_type(args):
    """'cuda' if any tensor among the (nested) arguments is a CUDA tensor, else 'cpu'."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.is_cuda:
                return "cuda"
        elif isinstance(a, (list, tuple)) and _device_type(a) == "cuda":
            return "cuda"
    return "cpu"


def _delegate(name):
    def method(self, *args, **kwargs):  # keywords: torch's Python callers before 2.9 (barrier(opts=...))
        return self._inner_call(name, "not served by pyallreduce", *args, **kwargs)

    method.__name__ = name
    method.__doc__ = "Served by the inner backend (gloo or NCCL)."
    return method


for _name in DELEGATED:
    setattr(PyallreduceBackend, _name, _delegate(_name))


def _options_defaulted(method, options_type):
    """`method`, its last argument (the options) made when the caller leaves it
    out, as torch's Python functions do where the C++ signature has a default."""
    def defaulted(self, *args):
        if len(args) < method.__code__.co_argcount - 1:
            args = (*args, options_type())
        return method(self, *args)

    defaulted.__name__, defaulted.__doc__ = method.__name__, method.__doc__
    return defaulted


if not SERVES_IN_CPP:  # the Python ProcessGroup: its Python callers call these directly
    _c10d = torch._C._distributed_c10d  # AllgatherOptions is not re-exported by torch.distributed
    for _options, _names in ((_c10d.AllreduceOptions, ("allreduce",)),
                             (_c10d.AllreduceCoalescedOptions, ("allreduce_coalesced",)),
                             (_c10d.ReduceScatterOptions,
                              ("reduce_scatter_single", "reduce_scatter_single_coalesced", "reduce_scatter")),
                             (_c10d.AllgatherOptions,
                              ("all_gather_single", "all_gather_single_coalesced", "allgather"))):
        for _name in _names:
            setattr(PyallreduceBackend, _name, _options_defaulted(getattr(PyallreduceBackend, _name), _options))
    if not hasattr(dist.ProcessGroup, "shutdown"):
        # torch < 2.7: destroy_process_group tells NCCL alone that a group ends
        # (distributed_c10d._shutdown_backend); the communicators would stay
        # mapped until the process exits. Told here too, after torch's own.
        _torch_shutdown_backend = dist.distributed_c10d._shutdown_backend

        def _shutdown_backend(pg):
            _torch_shutdown_backend(pg)
            if isinstance(pg, PyallreduceBackend):
                pg.shutdown()

        dist.distributed_c10d._shutdown_backend = _shutdown_backend
    # torch's names before 2.14 (_INNER_NAMES and two more) for the methods above
    for _name, _old_name in (*_INNER_NAMES.items(), ("all_gather_single_coalesced", "allgather_into_tensor_coalesced"),
                             ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced")):
        setattr(PyallreduceBackend, _old_name, getattr(PyallreduceBackend, _name))


def create_backend(opts, backend_options):
    """torch.distributed's creator function (extended API: opts.store is already
    prefixed for this group, opts.process_group is the group being made)."""
    timeout = opts.timeout if opts.timeout is not None else datetime.timedelta(minutes=30)
    return PyallreduceBackend(opts.store, opts.group_rank, opts.group_size, timeout,
                              getattr(opts, "process_group", None))  # torch < 2.14: none (_own_group)


if NAME.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(NAME, create_backend, extended_api=True, devices=["cpu", "cuda"])
