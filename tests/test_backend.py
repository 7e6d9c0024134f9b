"""The "pyallreduce" torch.distributed backend (pyallreduce/backend.py) on CPU.

Each rank first computes the reference with the gloo group run_ranks set up,
then re-initialises torch.distributed with backend "pyallreduce" (a FileStore
in the test's tmp_path) and compares bitwise: the inputs are small integers, so
every sum and every average over 2 ranks is exact in every dtype.
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import pyallreduce  # noqa: F401  (registers the "pyallreduce" backend)
from launch import run_ranks

WORLD = 2
TIMEOUT = 90.0
NUMEL = 1000


def reinit(backend, store_file):
    """Replaces run_ranks' gloo group by one of `backend`; returns its CPU backend."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.destroy_process_group()
    dist.init_process_group(backend, init_method=f"file://{store_file}", rank=rank, world_size=world_size)
    return dist.group.WORLD._get_backend(torch.device("cpu"))


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
        assert torch.equal(x, expected[dtype]), f"async sum {dtype}"
        future_value = work.get_future().wait()
        assert len(future_value) == 1 and torch.equal(future_value[0], x)
    comm = impl._comm
    assert comm is not None and comm.fallback_reason is None, comm
    assert comm._calls >= 3 * len(dtypes), "the calls did not run on the communicator"

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
    assert comm.closed and impl._comm is None
    return sorted(leaked_segments())


@pytest.mark.parametrize("backend", ["pyallreduce", "cpu:pyallreduce"])
def test_all_reduce_matches_gloo(tmp_path, backend):
    leftovers = run_ranks(_all_reduce, WORLD, backend, str(tmp_path / "store"), timeout=TIMEOUT)
    assert leftovers == [[]] * WORLD, leftovers


def _errors(rank, world_size, store_file):
    reinit("pyallreduce", store_file)
    mismatched = torch.ones(16384 if rank == 0 else 1)  # the communicator's call descriptors differ
    work = dist.all_reduce(mismatched, async_op=True)  # returns; the error is the Work's
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
    from pyallreduce.communicator import HOSTNAME_ENV

    os.environ[HOSTNAME_ENV] = f"host{rank}"  # a group the Communicator cannot serve
    impl = reinit("pyallreduce", store_file)
    for op, expected in ((dist.ReduceOp.SUM, 3.0), (dist.ReduceOp.AVG, 1.5)):
        x = torch.full((8,), float(rank + 1))
        dist.all_reduce(x, op=op)  # the Communicator's fallback re-enters the backend: gloo serves it
        assert torch.equal(x, torch.full((8,), expected)), (op, x)
    assert "2 hosts" in impl._comm.fallback_reason


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
    comm = impl._comm
    assert comm is not None and comm._calls > 0, "DDP's all-reduces did not run on the communicator"
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
