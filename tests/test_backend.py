"""The "pyallreduce" torch.distributed backend (pyallreduce/backend.py) on CPU.

Each rank first computes the reference with the gloo group run_ranks set up,
then re-initialises torch.distributed with backend "pyallreduce" (a FileStore
in the test's tmp_path) and compares bitwise: the inputs are small integers, so
every sum and every average over 2 ranks is exact in every dtype.
"""
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp  # noqa: F401  (for the check that it has fully_shard)
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import pyallreduce  # noqa: F401  (registers the "pyallreduce" backend)
from pyallreduce.backend import SERVES_IN_CPP  # torch >= 2.9: the C++ fast path
from pyallreduce.group import backend_of

from launch import own_segments_mapped, run_ranks, wait_for_file
from work_contract import EXCEPTION_BINDING_WORKS  # torch < 2.13 cannot answer exception()
from work_contract import gloo_has_list_reduce_scatter


WORLD = 2
TIMEOUT = 90.0
# torch 2.6 has the function too, but it aborts only NCCL groups (a no-op, with a warning, for others).
ABORTS_EVERY_BACKEND = torch.__version__ >= (2, 7)
NUMEL = 1000
CPU = torch.device("cpu")


def served_calls(impl):
    """The calls the backend's CPU Communicator ran: in C++ (csrc/backend.cpp's
    fast path) or through Python."""
    return impl.fast_calls + impl._comms[CPU]._calls


def reinit(backend, store_file):
    """Replaces run_ranks' gloo group by one of `backend`; returns its CPU backend."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.destroy_process_group()
    dist.init_process_group(backend, init_method=f"file://{store_file}", rank=rank, world_size=world_size)
    return backend_of(dist.group.WORLD, torch.device("cpu"))


def assert_a_new_group_sums(rank, world_size, store_file):
    """After the group ended: a new "pyallreduce" group starts and sums exactly."""
    dist.init_process_group("pyallreduce", init_method=f"file://{store_file}.2", rank=rank, world_size=world_size)
    x = torch.full((4,), float(rank + 1))
    dist.all_reduce(x)
    assert torch.equal(x, torch.full((4,), float(world_size * (world_size + 1) // 2)))


def exact_input(rank, dtype):
    return ((torch.arange(NUMEL) % 17) * (rank + 1)).to(dtype)


def _all_reduce(rank, world_size, backend, store_file):
    from pyallreduce.transport.host_shm import leaked_segments

    dtypes = (torch.float32, torch.bfloat16)
    expected = {}
    for dtype in dtypes:
        x = exact_input(rank, dtype)
        dist.all_reduce(x)  # gloo: its SUM is the reference; it has no AVG
        expected[dtype] = x
    impl = reinit(backend, store_file)
    assert type(impl) is pyallreduce.backend.PyallreduceBackend, type(impl)
    for dtype in dtypes:
        x = exact_input(rank, dtype)
        dist.all_reduce(x)
        assert torch.equal(x, expected[dtype]), f"sum {dtype}"

        x = exact_input(rank, dtype)
        dist.all_reduce(x, op=dist.ReduceOp.AVG)
        assert torch.equal(x, expected[dtype] / world_size), f"avg {dtype}"

        x = exact_input(rank, dtype)
        work = dist.all_reduce(x, async_op=True)
        assert work.wait()
        work.synchronize()  # the Work's other waits: a CPU call has finished
        if hasattr(work, "block_current_stream"):  # torch >= 2.9
            work.block_current_stream()
        assert torch.equal(x, expected[dtype]), f"async sum {dtype}"
        assert work.is_completed() and work.is_success()
        assert not EXCEPTION_BINDING_WORKS or work.exception() is None
        assert len(work.result()) == 1 and work.result()[0] is x
        future_value = work.get_future().wait()
        assert len(future_value) == 1 and torch.equal(future_value[0], x)
    comm = impl._comms[CPU]
    assert comm is not None and comm.fallback_reason is None, comm
    assert not SERVES_IN_CPP or impl.fast_calls >= 3 * len(dtypes) - 1, "the calls did not take the C++ fast path"

    # Served by the inner gloo backend.
    b = torch.full((4,), float(rank))
    dist.broadcast(b, src=1)
    assert torch.equal(b, torch.ones(4))
    dist.barrier()
    objects = [None] * world_size
    dist.all_gather_object(objects, ("rank", rank))
    assert objects == [("rank", r) for r in range(world_size)]
    d = torch.full((3,), rank + 1, dtype=torch.float64)  # a dtype pyallreduce does not reduce
    dist.all_reduce(d)
    assert torch.equal(d, torch.full((3,), 3.0, dtype=torch.float64))

    dist.destroy_process_group()
    assert comm.closed and not impl._comms
    return sorted(leaked_segments())


def test_import_names_the_backends_path_once():
    """`import pyallreduce` says once how the backend serves calls with this
    torch: in C++ (torch >= 2.9) or in Python."""
    said = subprocess.run([sys.executable, "-c", "import logging; logging.basicConfig(level=logging.INFO); "
                           "import pyallreduce, pyallreduce.backend"], capture_output=True, text=True, timeout=120)
    assert said.returncode == 0, said.stderr
    path = "serves eager calls in C++" if SERVES_IN_CPP else "serves every call in Python"
    assert said.stderr.count(path) == 1 and said.stderr.count("torch.distributed backend 'pyallreduce'") == 1, \
        said.stderr


@pytest.mark.quick
@pytest.mark.parametrize("backend", ["pyallreduce", "cpu:pyallreduce"])
def test_all_reduce_matches_gloo(tmp_path, backend):
    leftovers = run_ranks(_all_reduce, WORLD, backend, str(tmp_path / "store"), timeout=TIMEOUT)
    assert leftovers == [[]] * WORLD, leftovers


def _errors(rank, world_size, store_file):
    impl = reinit("pyallreduce", store_file)
    dist.all_reduce(torch.ones(4))  # makes the Communicator: the C++ fast path serves the next calls
    mismatched = torch.ones(16384 if rank == 0 else 1)  # the communicator's call descriptors differ
    work = dist.all_reduce(mismatched, async_op=True)  # returns; the error is the Work's
    assert impl.fast_calls == SERVES_IN_CPP
    assert work.is_completed() and not work.is_success()
    assert not EXCEPTION_BINDING_WORKS or "ranks disagree" in str(work.exception())
    with pytest.raises(RuntimeError, match="ranks disagree"):
        work.wait()
    with pytest.raises(RuntimeError, match="ranks disagree"):
        work.get_future().wait()
    with pytest.raises(RuntimeError, match="ranks disagree"):
        dist.all_reduce(torch.ones(16384 if rank == 0 else 1))  # synchronous: raises from the call
    # A dtype the kernels reduce on one rank, one they leave to gloo on the other: the
    # Communicator's agreement round catches it on both, neither waits for the other.
    with pytest.raises(RuntimeError, match="ranks disagree"):
        dist.all_reduce(torch.ones(8, dtype=torch.float32 if rank == 0 else torch.float64))
    x = torch.ones(8)
    dist.all_reduce(x)  # a mismatch leaves the communicator usable
    assert torch.equal(x, torch.full((8,), float(world_size)))


def test_errors_raise_from_wait(tmp_path):
    run_ranks(_errors, WORLD, str(tmp_path / "store"), timeout=TIMEOUT)


def _two_hosts(rank, world_size, store_file):
    from pyallreduce.protocol import HOSTNAME_ENV

    os.environ[HOSTNAME_ENV] = f"host{rank}"  # a group the Communicator cannot serve
    impl = reinit("pyallreduce", store_file)
    for op, expected in ((dist.ReduceOp.SUM, 3.0), (dist.ReduceOp.AVG, 1.5)):
        x = torch.full((8,), float(rank + 1))
        dist.all_reduce(x, op=op)  # the Communicator's fallback re-enters the backend: gloo serves it
        assert torch.equal(x, torch.full((8,), expected)), (op, x)
    assert "2 hosts" in impl._comms[CPU].fallback_reason


@pytest.mark.quick
def test_communicator_fallback_goes_to_gloo(tmp_path):
    run_ranks(_two_hosts, WORLD, str(tmp_path / "store"), timeout=TIMEOUT)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(10, 32)
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        return self.head(torch.tanh(self.hidden(x)))


def _train(rank, world_size, steps=3):
    torch.manual_seed(0)
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 10, generator=g), torch.randint(5, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _ddp(rank, world_size, store_file):
    from pyallreduce.transport.host_shm import leaked_segments

    reference = _train(rank, world_size)  # backend "gloo"
    impl = reinit("pyallreduce", store_file)
    params = _train(rank, world_size)
    comm = impl._comms[CPU]
    assert comm is not None and served_calls(impl) > 0, "DDP's all-reduces did not run on the communicator"
    for k, (p, q) in enumerate(zip(params, reference)):
        assert torch.equal(p, q), f"parameter {k} differs from gloo's by {(p - q).abs().max().item()}"
    import gc

    gc.collect()  # DDP's reference cycles hold the group
    dist.destroy_process_group()
    assert comm.closed
    return sorted(leaked_segments())


def test_ddp_matches_gloo(tmp_path):
    leftovers = run_ranks(_ddp, WORLD, str(tmp_path / "store"), timeout=TIMEOUT)
    assert leftovers == [[]] * WORLD, leftovers


def exact(numel, rank, dtype=torch.float32, salt=0):
    """Small integers: every sum over <= 8 ranks is exact, whatever the order."""
    return ((torch.arange(numel) * 7 + salt + 5 * rank) % 9 - 4).to(dtype)


def _scatter_gather(rank, world_size, store_file):
    """Each collective with gloo first (the reference), then the same calls on
    "pyallreduce": bitwise equal, and run by the communicator."""
    seg = 3000

    def calls():
        results = []
        for dtype in (torch.float32, torch.bfloat16):
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                out = torch.empty(seg, dtype=dtype)
                if op == dist.ReduceOp.AVG and dist.get_backend() == "gloo":  # gloo has no AVG
                    dist.reduce_scatter_tensor(out, exact(world_size * seg, rank, dtype))
                    out /= world_size
                else:
                    dist.reduce_scatter_tensor(out, exact(world_size * seg, rank, dtype), op=op)
                results.append(out)
        for dtype in (torch.float32, torch.int64, torch.uint8):
            out = torch.empty(world_size * seg, dtype=dtype)
            dist.all_gather_into_tensor(out, exact(seg, rank, dtype).abs())
            results.append(out)
            # FSDP2's layout: the input is this rank's segment of the output
            out = torch.zeros(world_size * seg, dtype=dtype)
            out[rank * seg:(rank + 1) * seg] = exact(seg, rank, dtype).abs()
            work = dist.all_gather_into_tensor(out, out[rank * seg:(rank + 1) * seg], async_op=True)
            work.wait()
            results.append(out)
        listed = [torch.empty(seg) for _ in range(world_size)]
        dist.all_gather(listed, exact(seg, rank, salt=1))
        results += listed
        if reduce_scatter_list:
            out = torch.empty(seg)
            dist.reduce_scatter(out, [exact(seg, rank, salt=q) for q in range(world_size)])
            results.append(out)
        coalesced = [exact(100, rank, salt=2), exact(7, rank, salt=3)]
        dist.all_reduce_coalesced(coalesced)
        results += coalesced
        outs = [torch.empty(world_size * 64), torch.empty(world_size * 5)]
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.all_gather_into_tensor(outs[0], exact(64, rank, salt=4))
            dist.all_gather_into_tensor(outs[1], exact(5, rank, salt=5))
        cm.wait()
        results += outs
        outs = [torch.empty(64), torch.empty(5)]
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.reduce_scatter_tensor(outs[0], exact(world_size * 64, rank, salt=6))
            dist.reduce_scatter_tensor(outs[1], exact(world_size * 5, rank, salt=7))
        cm.wait()
        return results + outs

    reduce_scatter_list = gloo_has_list_reduce_scatter(dist.group.WORLD)
    reference = calls()
    impl = reinit("pyallreduce", store_file)
    got = calls()
    for k, (a, b) in enumerate(zip(got, reference, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"result {k} ({a.dtype}) differs from gloo's"
    # 4 reduce-scatters, 6 all-gathers, the list forms, 2 coalesced all-reduces, 2 x 2 coalesced
    assert served_calls(impl) >= 4 + 6 + 1 + reduce_scatter_list + 2 + 4, served_calls(impl)


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_all_gather_and_their_forms_match_gloo(tmp_path, world):
    run_ranks(_scatter_gather, world, str(tmp_path / "store"), timeout=TIMEOUT * 2)


def _train_on_both(train, store_file, what):
    """train() with gloo (run_ranks' group), then with "pyallreduce": the largest
    difference of each parameter, after checking `what` ran on the communicator."""
    reference = train()
    impl = reinit("pyallreduce", store_file)
    params = train()
    assert served_calls(impl) > 0, f"{what} did not run on the communicator"
    return [(p - q).abs().max().item() for p, q in zip(params, reference, strict=True)]


def assert_matches_gloo(diffs, world):
    # 2 ranks: a + b is one rounding whatever the order, so bitwise equal. More:
    # gloo's order is not ours (rank order 0..W-1), so the last bits may differ.
    limit = 0.0 if world == 2 else 1e-5
    assert max(max(d) for d in diffs) <= limit, diffs


def _fsdp2(rank, world_size, store_file):
    from torch.distributed.fsdp import fully_shard

    def train():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        for layer in model[0], model[2]:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + rank)
            loss = model(torch.randn(8, 16, generator=g)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return [p.full_tensor().detach().clone() for p in model.parameters()]

    return _train_on_both(train, store_file, "FSDP2's collectives")


@pytest.mark.skipif(not hasattr(torch.distributed.fsdp, "fully_shard"),
                    reason=f"FSDP2 (fully_shard) came in torch 2.6 (this is {torch.__version__})")
@pytest.mark.skipif(torch.__version__ < (2, 9), reason="the reference is wrong before 2.9: FSDP2 averages its "
                    "gradients with ReduceOp.AVG, which torch 2.8's gloo sums instead (reduce_scatter_tensor: 1 and 2 "
                    "give 3, where 2.15's give 1.5), so gloo's parameters are not what FSDP2 means")
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_fully_shard_matches_gloo(tmp_path, world):
    assert_matches_gloo(run_ranks(_fsdp2, world, str(tmp_path / "store"), timeout=TIMEOUT * 2), world)


def _tensor_parallel(rank, world_size, store_file):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def train():
        mesh = init_device_mesh("cpu", (world_size,))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step)  # tensor parallel: one batch for every rank
            loss = model(torch.randn(4, 16, generator=g)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return [p.full_tensor().detach().clone() for p in model.parameters()]

    return _train_on_both(train, store_file, "the row-parallel all-reduces")


@pytest.mark.skipif(torch.__version__ < (2, 8), reason="torch's gloo itself can hang in destroy_process_group before "
                    "2.8 (scripts/gloo_destroy_hang.py), which this test calls on the gloo group that trained the "
                    "reference (2.4.1: 1 run in 9 at 4 ranks; 2.7.1: 1 run in 5 at 2 ranks, before any pyallreduce "
                    "group existed)")
@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_row_and_column_parallel_linear_matches_gloo(tmp_path, world):
    assert_matches_gloo(run_ranks(_tensor_parallel, world, str(tmp_path / "store"), timeout=TIMEOUT * 2), world)


def _subgroup(rank, world_size, store_file):
    reinit("pyallreduce", store_file)
    group = dist.new_group([0, 2], backend="pyallreduce")
    if rank in (0, 2):
        x = torch.full((1000,), float(rank + 1))
        dist.all_reduce(x, group=group)
        assert torch.equal(x, torch.full((1000,), 4.0))
        out = torch.empty(2 * 10)
        dist.all_gather_into_tensor(out, torch.full((10,), float(rank)), group=group)
        assert torch.equal(out, torch.cat([torch.zeros(10), torch.full((10,), 2.0)]))
        comm = backend_of(group, CPU)._comms[CPU]
        assert (comm.world_size, comm.rank) == (2, rank // 2)
    y = torch.ones(5)
    dist.all_reduce(y)  # the world group, on its own communicator
    assert torch.equal(y, torch.full((5,), 3.0))


def test_subgroups_get_their_own_communicator(tmp_path):
    run_ranks(_subgroup, 3, str(tmp_path / "store"), timeout=TIMEOUT * 2)


def _timeout(rank, world_size, store_file):
    import datetime
    import time

    dist.destroy_process_group()
    dist.init_process_group("pyallreduce", init_method=f"file://{store_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=3))
    dist.all_reduce(torch.ones(4))  # the communicator exists on both ranks
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"never arrived"):
            dist.all_reduce(torch.ones(4))  # rank 1 never makes this call
        waited = time.monotonic() - start
        assert 2.5 < waited < 60, waited
        with pytest.raises(RuntimeError, match="unusable after an earlier failure"):
            dist.all_reduce(torch.ones(4))
        open(f"{store_file}.done", "w").close()
    else:  # waits outside torch.distributed, whose every wait now ends after 3 s
        wait_for_file(f"{store_file}.done")


def test_the_process_group_timeout_applies(tmp_path):
    run_ranks(_timeout, WORLD, str(tmp_path / "store"), timeout=TIMEOUT)


def _collective_close(rank, world_size, store_file):
    """A CUDA Communicator's close agrees with its peers through the group
    (CudaIpcTransport.close -> agree -> all_gather_object), which torch still
    routes to this backend during destroy_process_group. The CPU close is
    local, so the test gives it the same collective step."""
    reinit("pyallreduce", store_file)
    dist.all_reduce(torch.ones(4))  # the communicator exists
    comm = backend_of(dist.group.WORLD, CPU)._comms[CPU]
    close, gathered = comm.close, []

    def collective_close():
        every = [None] * world_size
        dist.all_gather_object(every, ("closing", rank), group=comm.group)
        gathered.append(every)
        close()

    comm.close = collective_close
    dist.destroy_process_group()
    assert gathered == [[("closing", r) for r in range(world_size)]]
    assert comm.closed
    assert_a_new_group_sums(rank, world_size, store_file)  # torch's tables were cleared


@pytest.mark.quick
def test_destroy_process_group_closes_collectively(tmp_path):
    run_ranks(_collective_close, WORLD, str(tmp_path / "store"), timeout=TIMEOUT)


def _abort(rank, world_size, store_file):
    """torch's _abort_process_group while this rank's served call (the C++
    fast path, holding the turn) waits on another thread for a peer that never
    makes it: the call raises at once instead of at the group's deadline, the
    abort needs nothing from the peer, and a new group works afterwards."""
    import datetime
    import threading

    from torch.distributed.distributed_c10d import _abort_process_group

    dist.destroy_process_group()
    dist.init_process_group("pyallreduce", init_method=f"file://{store_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=600))
    backend = backend_of(dist.group.WORLD, CPU)
    dist.all_reduce(torch.ones(4))  # the communicator exists on both ranks
    comm = backend._comms[CPU]
    if rank == 0:
        errors = []

        def blocked():
            try:
                dist.all_reduce(torch.ones(4))  # rank 1 never makes this call
            except RuntimeError as e:
                errors.append(str(e))

        t = threading.Thread(target=blocked)
        t.start()
        time.sleep(2.0)  # the call waits for rank 1 by now
        start = time.monotonic()
        _abort_process_group()
        aborted_in = time.monotonic() - start
        t.join(60)
        assert not t.is_alive()
        assert aborted_in < 60, aborted_in  # the deadline is 600 s
        assert len(errors) == 1 and "was aborted" in errors[0] and "rank(s) 1" in errors[0], errors
        open(f"{store_file}.done", "w").close()
    else:  # waits outside torch.distributed, then leaves the group the same way
        wait_for_file(f"{store_file}.done")
        _abort_process_group()
    assert comm.closed and backend._comms == {}
    assert not dist.is_initialized()
    assert not own_segments_mapped(), "a segment stays mapped after the abort"
    assert_a_new_group_sums(rank, world_size, store_file)


@pytest.mark.quick
@pytest.mark.skipif(not ABORTS_EVERY_BACKEND,
                    reason=f"_abort_process_group aborts other backends than NCCL from torch 2.7 (this is "
                           f"{torch.__version__})")
def test_abort_ends_a_served_call_waiting_for_a_peer(tmp_path):
    run_ranks(_abort, WORLD, str(tmp_path / "store"), timeout=240)


def _second_thread(rank, world_size, store_file):
    """A collective from a second thread while a served call runs waits its
    turn for the Communicator: both ranks serve both calls in the same order."""
    import threading

    reinit("pyallreduce", store_file)
    dist.all_reduce(torch.ones(4))
    backend = backend_of(dist.group.WORLD, CPU)
    comm = backend._comms[CPU]
    with backend._scope(turn=True, serve=False):
        backend._clear_fast()  # every call through Python (the fast path's turn: the next test)
    started, inner_calls = threading.Event(), []
    real = comm.all_reduce_

    def slow_all_reduce(t, op="sum", algo="auto"):
        if t.numel() == 5:  # the main thread's call: let the other thread try meanwhile
            started.set()
            time.sleep(0.5)
        return real(t, op, algo)

    comm.all_reduce_ = slow_all_reduce
    inner = backend._inner_call
    backend._inner_call = lambda name, why, *a: inner_calls.append(name) or inner(name, why, *a)
    y = torch.full((3,), float(rank + 1))

    def other():
        started.wait(30)
        dist.all_reduce(y)

    t = threading.Thread(target=other)
    t.start()
    x = torch.full((5,), float(rank + 1))
    dist.all_reduce(x)
    t.join(60)
    assert not t.is_alive()
    assert torch.equal(x, torch.full((5,), 3.0)) and torch.equal(y, torch.full((3,), 3.0))
    assert inner_calls == [], f"served by the inner backend: {inner_calls}"
    assert comm._calls >= 3


def test_a_second_thread_waits_its_turn(tmp_path):
    run_ranks(_second_thread, WORLD, str(tmp_path / "store"), timeout=TIMEOUT)


def _second_thread_fast(rank, world_size, store_file):
    """The same in the C++ fast path: rank 0's call holds the turn while it
    waits for rank 1 (2 s late); rank 0's second thread calls meanwhile and
    must wait for the turn, not enter the Communicator beside the first call
    (which would raise, or pair with rank 1's calls in another order). Rank 1
    makes the two calls in that order from its two threads too."""
    import threading

    backend = reinit("pyallreduce", store_file)
    dist.all_reduce(torch.ones(4))  # creates the Communicator: the fast path from here on
    fast_before = backend.fast_calls
    x, y = torch.full((5,), float(rank + 1)), torch.full((3,), float(rank + 1))
    errors = []

    def other():
        try:
            dist.all_reduce(y)
        except Exception as e:
            errors.append(e)

    t = threading.Thread(target=other)
    if rank == 0:
        threading.Timer(0.5, t.start).start()  # while the main thread's call waits for rank 1
    else:
        time.sleep(2.0)
    dist.all_reduce(x)
    if rank != 0:
        t.start()
    t.join(60)
    assert not t.is_alive() and errors == [], errors
    assert torch.equal(x, torch.full((5,), 3.0)) and torch.equal(y, torch.full((3,), 3.0))
    assert backend.fast_calls == fast_before + 2 * SERVES_IN_CPP, "the calls did not take the C++ fast path"


def _delegated(rank, world_size, store_file):
    """Every collective the backend leaves to its inner gloo backend reaches it
    through the C++ class's forwarding and comes back right: reduce, gather,
    scatter, all_to_all (both forms), send/recv (and from any source: its Work's
    source rank), a sparse all_reduce, all_gather_coalesced; the Work answers as
    the inner backend's does."""
    import warnings

    reinit("pyallreduce", store_file)
    w = world_size
    x = torch.full((4,), float(rank + 1))
    work = dist.reduce(x, dst=0, async_op=True)
    assert work.wait() and work.is_completed() and work.is_success()  # the inner Work's answers
    if rank == 0:
        assert torch.equal(x, torch.full((4,), w * (w + 1) / 2))
    gathered = [torch.empty(3) for _ in range(w)] if rank == 0 else None
    dist.gather(torch.full((3,), float(rank)), gathered, dst=0)
    if rank == 0:
        assert all(torch.equal(g, torch.full((3,), float(q))) for q, g in enumerate(gathered))
    got = torch.empty(2)
    dist.scatter(got, [torch.full((2,), 10.0 + q) for q in range(w)] if rank == 0 else None, src=0)
    assert torch.equal(got, torch.full((2,), 10.0 + rank))
    out = torch.empty(w)
    dist.all_to_all_single(out, torch.arange(w, dtype=torch.float32) + 100 * rank)
    assert torch.equal(out, torch.tensor([100.0 * q + rank for q in range(w)]))
    outs = [torch.empty(1) for _ in range(w)]
    try:
        dist.all_to_all(outs, [torch.tensor([100.0 * rank + q]) for q in range(w)])
        assert [o.item() for o in outs] == [100.0 * q + rank for q in range(w)]
    except RuntimeError as e:  # gloo's own answer before torch 2.13 (2.11's gloo has no list form)
        assert torch.__version__ < (2, 13) and "gloo does not support alltoall" in str(e), e
    t = torch.full((2,), float(rank))
    if rank == 0:
        for q in range(1, w):
            dist.recv(t, src=q)
            assert torch.equal(t, torch.full((2,), float(q)))
            assert dist.recv(t) in range(1, w)  # from any source
    else:
        dist.send(t, dst=0)
        dist.send(t, dst=0)
    sparse = torch.sparse_coo_tensor([[rank]], [1.0], (w,))
    dist.all_reduce(sparse)
    assert torch.equal(sparse.to_dense(), torch.ones(w))
    lists = [[torch.empty(2)] for _ in range(w)]  # per rank, one output per input
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # all_gather_coalesced is deprecated, still served
        dist.all_gather_coalesced(lists, [torch.full((2,), float(rank))])
    assert all(torch.equal(g[0], torch.full((2,), float(q))) for q, g in enumerate(lists))


def test_collectives_left_to_the_inner_backend(tmp_path):
    run_ranks(_delegated, WORLD, str(tmp_path / "store"), timeout=TIMEOUT)


def _interrupted(rank, world_size, store_file):
    """A served call interrupted inside Python (KeyboardInterrupt, which _serve
    does not turn into the Work's error) leaves the turn and this thread's
    serving mark released: the next calls, fast and Python, run."""
    backend = reinit("pyallreduce", store_file)
    dist.all_reduce(torch.ones(4))
    comm = backend._comms[CPU]
    real = comm.all_reduce_

    def interrupted(*args, **kwargs):
        comm.all_reduce_ = real
        raise KeyboardInterrupt

    comm.all_reduce_ = interrupted
    with pytest.raises(KeyboardInterrupt):
        dist.all_reduce(torch.ones(3, 2).t())  # not contiguous: the Python path
    assert not backend._is_serving()
    x = torch.full((5,), float(rank + 1))
    dist.all_reduce(x)  # the fast path: would wait for the turn forever
    y = torch.full((3, 2), float(rank + 1)).t()
    dist.all_reduce(y)  # the Python path: would go to the inner backend if still marked serving
    assert torch.equal(x, torch.full((5,), 3.0)) and torch.equal(y, torch.full((2, 3), 3.0))


def test_an_interrupted_call_releases_the_turn(tmp_path):
    run_ranks(_interrupted, WORLD, str(tmp_path / "store"), timeout=TIMEOUT)


def _reentered(rank, world_size, store_file):
    """abort() and shutdown() on the thread that is inside a served call (a
    signal handler or a finalizer that runs there) would wait for the turn that
    thread holds, forever: each raises at once, saying to call it from another
    thread or after the call returns; the call fails with that error. The group
    is destroyed after, from outside the call, with nothing left mapped."""
    backend = reinit("pyallreduce", store_file)
    dist.all_reduce(torch.ones(4))
    comm = backend._comms[CPU]
    real = comm.all_reduce_
    for end in (backend.shutdown, backend.abort):
        def handler_runs_inside(*args, **kwargs):
            comm.all_reduce_ = real
            end()

        comm.all_reduce_ = handler_runs_inside
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="inside a call of this process group .* would wait for itself: "
                                               "call abort.* from another thread, or after the call returns"):
            dist.all_reduce(torch.ones(3, 2).t())  # not contiguous: the Python path
        assert time.monotonic() - start < 30
    dist.destroy_process_group()
    assert not own_segments_mapped(), "a segment stays mapped after destroy_process_group"
    assert_a_new_group_sums(rank, world_size, store_file)


def test_abort_or_shutdown_inside_a_served_call_raises_instead_of_waiting_for_itself(tmp_path):
    run_ranks(_reentered, WORLD, str(tmp_path / "store"), timeout=TIMEOUT)


def test_a_second_thread_waits_its_turn_in_the_fast_path(tmp_path):
    run_ranks(_second_thread_fast, WORLD, str(tmp_path / "store"), timeout=TIMEOUT)


def _first_cuda_call_in_capture(rank, world_size, store_file):
    """The first served call on a CUDA device would create the Communicator
    (cudaMalloc, IPC handles) inside the capture: refused with what to do,
    before anything is created. The capture state is stubbed (no GPU here)."""
    reinit("pyallreduce", store_file)
    backend = backend_of(dist.group.WORLD, CPU)
    pyallreduce.backend.stream_capturing = lambda device: True
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture.*make one collective call on this device "
                                           "before capturing"):
        backend._communicator(torch.device("cuda", 0))
    assert backend._comms == {}


def test_the_first_cuda_call_inside_a_capture_is_refused(tmp_path):
    run_ranks(_first_cuda_call_in_capture, WORLD, str(tmp_path / "store"), timeout=TIMEOUT)


def _fallback_in_capture(rank, world_size, store_file):
    """Issue 38's third bug: a Communicator's call that goes to torch.distributed
    inside a CUDA graph capture (float64, sizes past the crossover, a group that
    fell back) was refused on a "pyallreduce" group, whose CUDA tensors go to
    its kernels or its inner NCCL backend, both of which a graph captures. The
    check asks the backend that serves the group's CUDA tensors. The capture
    state is stubbed (no GPU here)."""
    from pyallreduce import reference

    reinit("pyallreduce", store_file)
    gloo = dist.new_group(backend="gloo")
    cuda = torch.device("cuda", 0)
    reference.stream_capturing = lambda device: True
    reference.check_capturable(cuda, None, "dtype torch.float64")  # the pyallreduce world group: capturable
    with pytest.raises(RuntimeError, match="backend for CUDA tensors 'gloo' cannot run inside a CUDA graph capture"):
        reference.check_capturable(cuda, gloo, "dtype torch.float64")


def test_a_fallback_inside_a_capture_on_a_pyallreduce_group_is_allowed(tmp_path):
    run_ranks(_fallback_in_capture, WORLD, str(tmp_path / "store"), timeout=TIMEOUT)


def _release_error(rank, world_size, store_file):
    """A communicator whose close raises inside destroy_process_group: torch's
    destroy returns (the error is logged, not raised out of it half done), the
    inner backends are shut down, and a new group works."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("pyallreduce").addHandler(handler)
    impl = reinit("pyallreduce", store_file)
    dist.all_reduce(torch.ones(4))
    comm = impl._comms[CPU]
    real_close = comm.close

    def failing_close():
        real_close()
        raise RuntimeError("an unmapping failed")

    comm.close = failing_close
    dist.destroy_process_group()
    assert not dist.is_initialized() and comm.closed
    assert any("closing its communicator failed: an unmapping failed" in r.getMessage() for r in records)
    assert_a_new_group_sums(rank, world_size, store_file)


def test_an_error_closing_a_communicator_does_not_escape_destroy_process_group(tmp_path):
    run_ranks(_release_error, WORLD, str(tmp_path / "store"), timeout=TIMEOUT)


def _debug_detail(rank, world_size, store_file):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL, what users set to debug a hang: torch
    wraps the group in its collective checker, which asks the backend for
    sequence numbers before each collective. The collectives run and are exact
    (the fast path and the Python path), calls that differ across ranks raise
    on every rank instead of hanging, and monitored_barrier runs on the inner
    gloo backend, naming the rank that did not arrive."""
    import datetime

    dist.set_debug_level_from_env()  # torch read it at import, before run_ranks set it
    checker = reinit("pyallreduce", store_file)
    backend = checker.wrapped_pg
    assert backend.name() == "pyallreduce"
    before = backend._get_sequence_number_for_group()
    for _ in range(2):  # the first call goes through Python, the second down the fast path
        x = exact_input(rank, torch.float32)
        dist.all_reduce(x)
        assert torch.equal(x, exact_input(0, torch.float32) * 3)
    out = torch.empty(2 * NUMEL)
    dist.all_gather_into_tensor(out, exact_input(rank, torch.float32))
    assert torch.equal(out, torch.cat([exact_input(0, torch.float32), exact_input(1, torch.float32)]))
    sequence = backend._get_sequence_number_for_group()  # the Communicator's setup exchanges count too
    assert sequence >= before + 3
    sequences = [None] * world_size
    dist.all_gather_object(sequences, sequence)
    assert sequences == [sequence] * world_size, sequences
    assert backend.fast_calls >= SERVES_IN_CPP
    with pytest.raises(RuntimeError, match="Detected mismatch between collectives on ranks"):
        dist.all_reduce(torch.ones(4 + rank))
    if torch.__version__ < (2, 14):  # torch.torch_version.TorchVersion compares with tuples
        # torch's own gate, in front of every backend but gloo (2.14 asks the backend)
        with pytest.raises(ValueError, match="monitored_barrier is only implemented for GLOO backend"):
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
    else:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
        if rank == 0:
            with pytest.raises(RuntimeError, match="Rank 1 failed to pass monitoredBarrier"):
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=2))
            open(f"{store_file}.done", "w").close()
        else:
            wait_for_file(f"{store_file}.done")
    dist.destroy_process_group()
    # Before torch 2.13 (seen on 2.11) the checker does not pass the group's
    # shutdown on to the backend: its communicators end at the process's exit.
    assert torch.__version__ < (2, 13) or not own_segments_mapped()


@pytest.mark.skipif(not SERVES_IN_CPP, reason="torch < 2.9 puts no Python ProcessGroup (the backend there) in its "
                    f"collective checker: DETAIL checks nothing on it (this is {torch.__version__})")
def test_torch_distributed_debug_detail_checks_collectives_and_monitored_barrier(tmp_path):
    run_ranks(_debug_detail, WORLD, str(tmp_path / "store"), timeout=TIMEOUT,
              env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
