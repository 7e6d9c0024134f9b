"""How long memory that peers map lives, without a GPU.

* DDP across its bucket rebuild: the buffers registered before the rebuild are
  unregistered, so the registered bytes stay those of the current buckets and the
  old buckets are freed (gloo CPU DDP; the communicator's register/unregister
  replaced by a recorder that holds each tensor as the CUDA transport does).
* CudaIpcTransport with pyallreduce._C's CUDA functions stubbed: a peer's
  allocation is unmapped exactly when its last user goes (region, registered
  buffers, graph entries), unregister drops our tensor only after every rank
  unmapped it, and close(sync=False) frees nothing peers may still map.
"""
import functools
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from launch import run_ranks
from test_ddp import BUCKET_CAP_MB, global_batch, make_net

TIMEOUT = 90.0
STEPS = 5  # DDP rebuilds its buckets in the second


# ---- DDP across the bucket rebuild --------------------------------------------------------

class RegistrationRecorder:
    """Communicator.register/unregister as the CUDA backend keeps memory: every
    registered tensor is held (each registration, also of an address registered
    before) until the address is unregistered."""

    def __init__(self):
        self.live = {}  # data_ptr -> [tensors registered there]
        self.log = []  # (op, nbytes) per call: the order every rank must share

    def register(self, tensor):
        self.live.setdefault(tensor.data_ptr(), []).append(tensor)
        self.log.append(("register", tensor.nbytes))
        return True

    def unregister(self, tensor):
        self.log.append(("unregister", tensor.nbytes))
        return self.live.pop(tensor.data_ptr(), None) is not None

    def held(self):
        return [t for ts in self.live.values() for t in ts]


def train_across_rebuild(rank, world_size, compression):
    import pyallreduce.ddp

    model = DDP(make_net(), bucket_cap_mb=BUCKET_CAP_MB)
    state = pyallreduce.ddp.register(model, compression=compression)
    recorder = RegistrationRecorder()
    state.comm.register, state.comm.unregister = recorder.register, recorder.unregister
    state._zero_copy = True  # what a CUDA communicator does; the CPU one never registers
    itemsize = (state.compression or torch.float32).itemsize
    gradient_bytes = sum(p.numel() for p in model.parameters()) * itemsize
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per = len(global_batch(0)[0]) // world_size
    steps, before_rebuild = [], None
    for step in range(STEPS):
        tokens, labels = global_batch(step)
        opt.zero_grad()
        F.cross_entropy(model(tokens[rank * per:(rank + 1) * per]), labels[rank * per:(rank + 1) * per]).backward()
        opt.step()
        gc.collect()
        steps.append((bool(model._has_rebuilt_buckets), sum(t.nbytes for t in recorder.held())))
        if before_rebuild is None:
            before_rebuild = [weakref.ref(t.untyped_storage()) for t in recorder.held()]
    gc.collect()
    out = dict(steps=steps, gradient_bytes=gradient_bytes, log=recorder.log,
               stale_alive=sum(ref() is not None for ref in before_rebuild), stale=len(before_rebuild),
               unregistrations=getattr(state, "unregistrations", 0))
    if compression is not None:
        try:  # raises on every rank alike, before any collective
            out["replaced"] = replace_wire(state, recorder)
        except RuntimeError as e:
            out["replaced"] = dict(error=str(e))
    state.close()
    del model, state, opt
    gc.collect()
    return out


def replace_wire(state, recorder):
    """A bucket whose size changes without a rebuild gets a new wire buffer: the old
    one is unregistered, not kept."""
    state.all_reduce(torch.ones(64), 9)
    old = weakref.ref(state._wire[9].untyped_storage())
    state.all_reduce(torch.ones(96), 9)
    gc.collect()
    return dict(old_alive=old() is not None, held_at_9=[t.nbytes for t in recorder.held() if t is state._wire[9]],
                log=recorder.log[-3:])


@pytest.mark.quick
@pytest.mark.parametrize("compression", [None, "bf16"])
def test_ddp_unregisters_the_buffers_of_before_the_rebuild(compression):
    results = run_ranks(train_across_rebuild, 2, compression, timeout=TIMEOUT)
    assert results[0]["log"] == results[1]["log"], "the ranks (un)registered in different orders"
    got = results[0]
    rebuilt = [step for step, (flag, _) in enumerate(got["steps"]) if flag]
    assert rebuilt and rebuilt[0] == 1 and len(rebuilt) == STEPS - 1, f"DDP did not rebuild as expected: {got}"
    for step, (_, held) in enumerate(got["steps"]):
        assert held == got["gradient_bytes"], (
            f"step {step}: registrations hold {held} bytes, the buckets have {got['gradient_bytes']} "
            f"(the buffers registered before the rebuild were kept): {got['steps']}")
    assert got["stale"] > 0 and got["stale_alive"] == 0, \
        f"{got['stale_alive']} of the {got['stale']} buffers registered before the rebuild are still allocated"
    assert got["unregistrations"] == got["stale"], got
    if compression is not None:
        replaced = got["replaced"]
        assert "error" not in replaced, replaced
        assert not replaced["old_alive"], "the replaced wire buffer is still allocated"
        assert replaced["held_at_9"] == [96 * 2]
        assert replaced["log"] == [("register", 64 * 2), ("unregister", 64 * 2), ("register", 96 * 2)]


# ---- the CUDA transport with pyallreduce._C stubbed -----------------------------------------

ALLOC = 1 << 20  # every fake allocation's size and alignment


def memory(rank, alloc, offset=0):
    """Address of byte `offset` of rank `rank`'s allocation `alloc` (0: its region), in its own process."""
    return ((rank + 1) << 36) + alloc * ALLOC + offset


class FakeCuda:
    """The functions of pyallreduce._C that CudaIpcTransport and Communicator call on
    CUDA, recording what happens in `events`. A handle names its allocation
    (rank, index); opening one maps it at a new address."""

    def __init__(self, rank):
        self.rank, self.fail_close = rank, False
        self.events = []
        self.mapped = {}  # address here -> (rank, alloc) mapped there
        self.table = set()  # the kernels' registration table
        self.clear_returns = []  # what cuda_clear_buffers returns
        self._next = 1 << 44

    def region_bytes(self, max_bytes):
        return 4096

    def cuda_alloc_region(self, device, nbytes):
        return memory(self.rank, 0)

    def cuda_launch_chain(self, handle):
        return 0, False  # nothing captured

    def cuda_wait_for_launches(self, device, launched, captured):
        self.events.append(("sync",))

    def cuda_free_region(self, device, addr):
        self.events.append(("free", addr))

    def cuda_ipc_exportable(self, device, ptr):
        return True

    def cuda_address_range(self, device, ptr):
        return ptr - ptr % ALLOC, ALLOC

    def cuda_ipc_handle(self, device, base):
        return ((base >> 36) - 1, base % (1 << 36) // ALLOC)

    def cuda_ipc_open(self, device, handle):
        assert handle not in self.mapped.values(), f"{handle} is mapped twice"
        self._next += ALLOC
        self.mapped[self._next] = handle
        self.events.append(("open", handle))
        return self._next

    def cuda_ipc_close(self, device, addr):
        handle = self.mapped.pop(addr)  # KeyError: unmapped twice, or never mapped
        self.events.append(("close", handle))
        if self.fail_close:
            raise RuntimeError("cudaIpcCloseMemHandle failed")

    def cuda_register_buffer(self, handle, ptr, nbytes, peer_ptrs):
        self.events.append(("register", ptr))
        self.table.add(ptr)

    def cuda_unregister_buffer(self, handle, ptr):
        self.events.append(("unregister", ptr))
        if ptr not in self.table:
            return False
        self.table.remove(ptr)
        return True

    def cuda_clear_buffers(self, handle):
        self.events.append(("clear",))
        self.table = set()
        returned, self.clear_returns = self.clear_returns, []  # the C++ table's references go to the caller
        return returned

    def seal_context(self, handle):
        self.events.append(("seal",))  # no call of another thread runs or starts from here

    def destroy_context(self, handle, keep_alive=False):
        self.events.append(("destroy",))

    def abort_context(self, handle, end_kernels):
        self.events.append(("interrupt", end_kernels))  # a close without the peers (sync=False) interrupts first

    def closed(self):
        return [e[1] for e in self.events if e[0] == "close"]


class FakeCudaTensor:
    """What the transport reads of a contiguous CUDA tensor (and what can be weakly referenced)."""
    is_cuda = True
    device = torch.device("cuda", 0)

    def __init__(self, ptr, nbytes):
        self.ptr, self.nbytes = ptr, nbytes

    def data_ptr(self):
        return self.ptr

    def numel(self):
        return self.nbytes

    def element_size(self):
        return 1

    def is_contiguous(self):
        return True


def stubbed(fn):
    """Runs fn(rank, world, fake, cuda_ipc, *args) with _C's CUDA functions
    replaced (a wait for the kernels recorded as ("sync",))."""
    @functools.wraps(fn)
    def run(rank, world, *args):
        from unittest import mock

        from pyallreduce.engines import cuda, native
        from pyallreduce.transport import cuda_ipc

        fake = FakeCuda(rank)
        with mock.patch.object(cuda_ipc, "_C", fake), mock.patch.object(cuda, "_C", fake), \
                mock.patch.object(native, "_C", fake), \
                mock.patch.object(cuda_ipc, "_parked", [], create=True):
            return fn(rank, world, fake, cuda_ipc, *args)
    return run


def communicator_over(transport):
    """A CUDA Communicator (context handle 1) over `transport`, without construction."""
    import torch.distributed as dist

    from pyallreduce.communicator import Communicator
    from pyallreduce.engines.cuda import CudaEngine

    engine = object.__new__(CudaEngine)
    engine.handle, engine.transport, engine.group, engine.device = 1, transport, dist.group.WORLD, transport.device
    comm = object.__new__(Communicator)
    comm._engine, comm._closed, comm.device = engine, False, transport.device
    return comm


def make_transport(cuda_ipc):
    import torch.distributed as dist

    return cuda_ipc.CudaIpcTransport(dist.group.WORLD, 1024, "cuda:0",
                                     wait_until_unused=lambda: cuda_ipc._C.cuda_wait_for_launches(0, 0, False))


@stubbed
def refcounted_unmapping(rank, world, fake, cuda_ipc):
    peer = 1 - rank
    t = make_transport(cuda_ipc)
    assert fake.events.count(("open", (peer, 0))) == 1, "the peer's region is mapped once"
    a, b, c = (FakeCudaTensor(memory(rank, 1, 0), 256), FakeCudaTensor(memory(rank, 1, 256), 256),
               FakeCudaTensor(memory(rank, 2, 0), 256))
    for x in (a, b, c):
        t.register(x)
    assert fake.events.count(("open", (peer, 1))) == 1, "two buffers in one allocation map it once"
    t.share_buffers([(memory(rank, 1, 512), 256)])  # a graph entry in the same allocation
    assert fake.events.count(("open", (peer, 1))) == 1

    tensors, error = t.unregister(memory(rank, 1, 0))
    assert tensors == [a] and error is None and fake.closed() == []
    assert t.unregister(memory(rank, 2, 0)) == ([c], None)
    assert fake.closed() == [(peer, 2)], "the allocation's only user went: unmapped at once"
    assert t.unregister(memory(rank, 1, 256)) == ([b], None)
    assert fake.closed() == [(peer, 2)], "a graph entry still reads the allocation"
    assert t.unregister(memory(rank, 1, 0)) == ([], None), "not registered any more"

    t.register(c)
    t.register(FakeCudaTensor(memory(rank, 2, 0), 256))  # the same address again
    assert fake.events.count(("open", (peer, 2))) == 2, "mapped again after it was unmapped"
    tensors, _ = t.unregister(memory(rank, 2, 0))
    assert len(tensors) == 2 and fake.closed() == [(peer, 2)] * 2

    t.register(FakeCudaTensor(memory(rank, 3, 0), 256))
    t.close()
    assert sorted(fake.closed()[2:]) == [(peer, 0), (peer, 1), (peer, 3)], fake.closed()
    assert fake.mapped == {}, "every mapping closed exactly once"
    return True


@pytest.mark.quick
def test_a_peer_allocation_is_unmapped_exactly_when_its_last_user_goes():
    assert run_ranks(refcounted_unmapping, 2, timeout=TIMEOUT) == [True, True]


@stubbed
def unregister_through_the_communicator(rank, world, fake, cuda_ipc, fail_on=None):
    comm = communicator_over(make_transport(cuda_ipc))
    comm._check_tensor = lambda tensor, name: None  # a FakeCudaTensor is not a torch.Tensor
    buffer = FakeCudaTensor(memory(rank, 1), 256)
    alive = weakref.ref(buffer)
    assert comm.register(buffer)
    del buffer  # only the communicator holds it now
    fake.fail_close = rank == fail_on
    fake.events.clear()
    real_agree = cuda_ipc.agree

    def agree(error, group, what, exc=cuda_ipc.RegistrationError):
        fake.events.append(("agree", alive() is not None))
        return real_agree(error, group, what, exc)

    error = None
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cuda_ipc, "agree", agree)
            # Another tensor object of the same memory, as DDP's bucket.buffer() gives.
            assert comm.unregister(FakeCudaTensor(memory(rank, 1), 256)) is True
    except RuntimeError as e:
        error = str(e)
    gc.collect()
    events, parked = list(fake.events), [len(ts) for _, _, ts in cuda_ipc._parked]
    assert comm.unregister(FakeCudaTensor(memory(rank, 2), 256)) is False
    fake.fail_close = False
    comm._close(sync=True)
    return events, alive() is not None, parked, error


def test_unregister_drops_the_tensor_only_after_every_rank_unmapped_it():
    results = run_ranks(unregister_through_the_communicator, 2, timeout=TIMEOUT)
    for rank, (events, alive, parked, error) in enumerate(results):
        peer = 1 - rank
        assert error is None
        assert events == [("sync",), ("unregister", memory(rank, 1)), ("close", (peer, 1)), ("agree", True)], \
            "wait for the kernels, forget the buffer, unmap the peer's, agree with the tensor still held"
        assert not alive and parked == [], "after the agreement the tensor is dropped"


def test_an_unregister_failing_on_one_rank_raises_on_every_rank_and_keeps_the_tensor():
    results = run_ranks(unregister_through_the_communicator, 2, 1, timeout=TIMEOUT)
    for events, alive, parked, error in results:
        assert "unregistering a buffer failed on rank 1: cudaIpcCloseMemHandle failed" in error
        assert alive and parked == [1], "a peer may still map the buffer: it stays until the process exits"


@stubbed
def close_transport(rank, world, fake, cuda_ipc, sync):
    t = make_transport(cuda_ipc)
    buffer = FakeCudaTensor(memory(rank, 1), 256)
    t.register(buffer)
    alive = weakref.ref(buffer)
    del buffer
    fake.events.clear()
    real_gather = cuda_ipc.gather

    def gather(obj, group):  # the transport's collectives, and whether it still holds the tensor
        fake.events.append(("gather", alive() is not None))
        return real_gather(obj, group)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cuda_ipc, "gather", gather)
        t.close(sync=sync)
    gc.collect()
    return fake.events, alive() is not None, [(own, len(ts)) for _, own, ts in cuda_ipc._parked], fake.mapped


@pytest.mark.parametrize("sync", [True, False])
def test_closing_the_transport_frees_only_what_no_peer_maps(sync):
    results = run_ranks(close_transport, 2, sync, timeout=TIMEOUT)
    for rank, (events, alive, parked, mapped) in enumerate(results):
        peer = 1 - rank
        closes = sorted(e for e in events if e[0] == "close")
        assert closes == [("close", (peer, 0)), ("close", (peer, 1))] and mapped == {}, events
        assert events[0] == ("sync",), "our own kernels are waited for before anything is unmapped"
        if sync:
            assert events == [("sync",), ("gather", True), *events[2:4], ("gather", True),
                              ("free", memory(rank, 0))], events
            assert not alive and parked == []
        else:
            assert ("free", memory(rank, 0)) not in events and not any(e[0] == "gather" for e in events), events
            assert alive and parked == [(memory(rank, 0), 1)], "the region and the registered tensor are parked"


@stubbed
def close_communicator(rank, world, fake, cuda_ipc, how, clear_returns_tensors):
    comm = communicator_over(make_transport(cuda_ipc))
    captured = FakeCudaTensor(memory(rank, 1), 256)  # a captured call's input with a zero-copy graph entry
    alive = weakref.ref(captured)
    fake.clear_returns = [captured] if clear_returns_tensors else []
    del captured
    fake.events.clear()
    real_gather = cuda_ipc.gather

    def gather(obj, group):
        fake.events.append(("gather", alive() is not None))
        return real_gather(obj, group)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cuda_ipc, "gather", gather)
        if how == "close":
            comm.close()
        elif how == "abort":
            comm.abort()
        else:
            with pytest.raises(ValueError):
                with comm:
                    raise ValueError("an error inside the with block")
    gc.collect()
    return fake.events, alive() is not None, [(own, len(ts)) for _, own, ts in cuda_ipc._parked]


@pytest.mark.parametrize("clear_returns_tensors", [True, False], ids=["clear_returns_tensors", "clear_returns_nothing"])
@pytest.mark.parametrize("how", ["close", "exception", "abort"])
def test_closing_the_communicator_keeps_captured_inputs_until_peers_unmapped(how, clear_returns_tensors):
    results = run_ranks(close_communicator, 2, how, clear_returns_tensors, timeout=TIMEOUT)
    for rank, (events, alive, parked) in enumerate(results):
        kinds = [e[0] for e in events]
        assert kinds.index("sync") < kinds.index("clear") < kinds.index("destroy") < kinds.index("close"), events
        # Issue 38's second bug: a call of another thread freed under (the status record, by
        # clear) or launching a kernel after the wait: the context is sealed before either.
        assert kinds.index("seal") < kinds.index("sync"), events
        if how == "close":
            assert kinds[-1] == "free" and kinds.count("gather") == 2 and kinds.count("close") == 1, events
            assert all(e == ("gather", clear_returns_tensors) for e in events if e[0] == "gather"), \
                "the captured input is held through both barriers"
            assert not alive and parked == [] and "interrupt" not in kinds
        else:
            assert "free" not in kinds and "gather" not in kinds, events
            assert kinds.index("interrupt") < kinds.index("sync"), "a call of another thread must end first"
            # Its kernels only on an abort: an error inside `with` is no reason to drop pending results.
            assert ("interrupt", how == "abort") in events, events
            assert alive == clear_returns_tensors
            assert parked == [(memory(rank, 0), int(clear_returns_tensors))], "the region (and input) are parked"
