"""transport.topology.check_topology's cache, across processes, with the CUDA
queries stubbed: every rank must hit or miss it together, or the rank that
misses waits in a gather the others never make."""
import pytest
import torch.distributed as dist

from launch import run_ranks

pytestmark = pytest.mark.quick


def cache_after_a_failed_query(rank, world):
    from pyallreduce.transport import cuda_ipc, topology

    queries = []

    def pci_bus_id(index):
        queries.append(index)
        if rank == 1 and len(queries) == 1:
            raise RuntimeError("cudaDeviceGetPCIBusId failed")
        return f"0000:{rank + 1:02x}:00.0"

    cuda_ipc._C.cuda_pci_bus_id = pci_bus_id
    cuda_ipc._device_index = lambda device: 0
    topology._check_peers = lambda index, bus, rank, facts: None
    topology._ipc_probe = lambda group, index, rank, world: None

    ok, why = topology.check_topology()  # rank 1's query fails: no rank caches
    assert not ok and why == "rank 1: cudaDeviceGetPCIBusId failed", why
    assert topology.check_topology() == (True, "same host, P2P mesh, IPC probe passed")  # every rank asks again
    real_gather = cuda_ipc.gather
    cuda_ipc.gather = lambda *a: (_ for _ in ()).throw(AssertionError("a cached answer made a gather"))
    assert topology.check_topology()[0]  # now cached on every rank
    cuda_ipc.gather = real_gather
    assert len(queries) == 2
    dist.barrier()


def test_a_failed_gpu_query_on_one_rank_leaves_every_rank_uncached():
    run_ranks(cache_after_a_failed_query, 2, timeout=60)
