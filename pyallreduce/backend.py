"""The "pyallreduce" torch.distributed backend, for CPU tensors.

    import pyallreduce  # registers it
    dist.init_process_group("pyallreduce", ...)      # or "cpu:pyallreduce,cuda:nccl"
    dist.all_reduce(x)                               # served by a pyallreduce.Communicator

all_reduce of SUM or AVG on one CPU tensor goes to a Communicator: float32,
float16 and bfloat16 run on its shared-memory kernels, other dtypes on its
fallback (gloo), after its agreement round, so ranks whose calls differ all
raise at once instead of each waiting for the other. Everything else (broadcast, barrier,
send/recv, gathers, scatters, other ops and dtypes, object collectives) runs on
an inner gloo backend built on the same store, with one log line per kind.

Why the Communicator is created lazily, at the first all_reduce it serves:
its setup exchanges (all_gather_object, barrier) go through torch.distributed
functions that take a *registered* process group (dist.get_rank(group) looks
the group up in torch's world table). Inside the creator function the group
does not exist yet, and neither does the default group (dist.is_initialized()
is False there). At the first call it does: we find the ProcessGroup that owns
this backend and hand it to the Communicator. Its exchanges then come back
into this backend, which sends them on to gloo (they are not all_reduces of
the kind served here, or they arrive while the Communicator is running, see
_busy). Every rank reaches the first served call at the same collective (the
choice depends only on the op, the dtype and the device, which a correct
program keeps equal across ranks), so the collective construction is safe.
"""
import datetime
import functools

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch._C._distributed_c10d import Work as _C10dWork

from .communicator import Communicator, log_once

NAME = "pyallreduce"
GLOO_PREFIX = "pyallreduce_gloo/"  # the inner gloo backend's keys in the group's store
_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg"}

# Python name of each Backend method (the trampoline's names, torch/csrc/distributed/
# c10d/py/PyBackend.hpp) that the inner gloo backend serves as it is.
DELEGATED = ("broadcast", "allreduce_sparse", "allreduce_coalesced", "reduce", "allgather",
             "all_gather_single", "allgather_coalesced", "all_gather_single_coalesced", "gather",
             "scatter", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced",
             "all_to_all_single", "alltoall", "send", "recv", "recv_anysource", "barrier")


class CompletedWork(_C10dWork):
    """The Work of a call that has already run (the shared-memory kernels are
    synchronous): wait() returns True or raises the call's error; get_future()
    holds the list of tensors, or the error."""

    def __init__(self, tensors, error=None):
        super().__init__()
        self._error = error
        self._future = torch.futures.Future()
        self._future.set_result(tensors)
        if error is not None:
            # Not Future.set_exception: that error lives in the Python wrapper only, and
            # C++ (DDP's reducer, work.get_future() from Python) would see it as the value.
            # A raising callback marks the C++ future itself as failed.
            self._future = self._future.then(functools.partial(_raise, error))

    def wait(self, timeout=None):
        if self._error is not None:
            raise self._error
        return True

    def get_future(self):
        return self._future

    def is_completed(self):
        return True

    def is_success(self):
        return self._error is None

    def exception(self):
        return self._error


def _raise(error, _future):
    raise error


class PyallreduceBackend(_C10dBackend):
    def __init__(self, store, rank, world_size, timeout):
        super().__init__(rank, world_size)
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore(GLOO_PREFIX, store), rank, world_size, timeout)
        self._timeout = timeout
        self._comm = None
        self._busy = False  # inside a Communicator call: its own torch.distributed calls go to gloo
        self._closed = False

    def getBackendName(self):
        return NAME

    # ---- served here ---------------------------------------------------------

    def allreduce(self, tensors, opts):
        op = _OPS.get(opts.reduceOp.op)
        tensor = tensors[0] if len(tensors) == 1 else None
        if (self._busy or op is None or tensor is None or tensor.device.type != "cpu"
                or tensor.layout != torch.strided):
            if not self._busy:
                what = (f"op {opts.reduceOp.op}" if op is None else
                        f"{len(tensors)} tensors" if tensor is None else f"{tensor.dtype} on {tensor.device}")
                log_once(f"backend {NAME}: all_reduce of {what} is served by gloo")
            return self._gloo.allreduce(tensors, opts)
        try:
            comm = self._communicator()
            self._busy = True
            try:
                comm.all_reduce_(tensor, op)
            finally:
                self._busy = False
        except Exception as e:  # raised by wait(), as torch's backends do
            return CompletedWork(tensors, e)
        return CompletedWork(tensors)

    def _communicator(self):
        if self._closed:
            raise RuntimeError(f"pyallreduce: this {NAME} process group was destroyed")
        if self._comm is None:
            self._busy = True  # its setup exchanges go to gloo
            try:
                self._comm = Communicator(self._process_group(), device="cpu", backend="cpu",
                                          timeout=self._timeout)
            finally:
                self._busy = False
        return self._comm

    def _process_group(self):
        """The registered ProcessGroup whose CPU backend this is."""
        cpu = torch.device("cpu")
        for pg in list(dist.distributed_c10d._world.pg_map):
            try:
                if pg._get_backend(cpu) is self:
                    return pg
            except RuntimeError:  # a group without a CPU backend
                continue
        raise RuntimeError(f"pyallreduce: no registered process group uses this {NAME} backend")

    # ---- lifetime ------------------------------------------------------------

    def shutdown(self):
        """destroy_process_group: unmaps the shared memory (no collective on CPU)."""
        self._release()

    def abort(self):
        self._release()

    def _release(self):
        if self._closed:
            return
        self._closed = True
        comm, self._comm = self._comm, None  # also breaks the cycle group -> backend -> comm -> group
        try:
            if comm is not None:
                comm.close()
        finally:
            self._gloo.shutdown()


def _delegate(name):
    def method(self, *args):
        if not self._busy:  # the Communicator's own setup exchanges are not news
            log_once(f"backend {NAME}: {name} is served by gloo")
        return getattr(self._gloo, name)(*args)

    method.__name__ = name
    method.__doc__ = "Served by the inner gloo backend."
    return method


for _name in DELEGATED:
    setattr(PyallreduceBackend, _name, _delegate(_name))


def create_backend(store, rank, world_size, timeout):
    """torch.distributed's creator function (store is already prefixed for this group)."""
    if timeout is None:
        timeout = datetime.timedelta(minutes=30)
    return PyallreduceBackend(store, rank, world_size, timeout)


if NAME.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(NAME, create_backend, devices=["cpu"])
