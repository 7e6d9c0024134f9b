"""transport.topology.check_topology's cache, across processes, with the CUDA
queries stubbed: every rank must hit or miss it together, or the rank that
misses waits in a gather the others never make."""
import itertools

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

    probes = []
    cuda_ipc._C.cuda_pci_bus_id = pci_bus_id
    cuda_ipc._device_index = lambda device: 0
    topology._check_peers = lambda index, bus, rank, facts: None
    topology._ipc_probe = lambda group, index, rank, world: probes.append(index)

    ok, why = topology.check_topology()  # rank 1's query fails: no rank caches
    assert not ok and why == "rank 1: cudaDeviceGetPCIBusId failed", why
    assert topology.check_topology() == (True, "same host, P2P mesh, IPC probe passed")  # every rank asks again
    assert topology.check_topology()[0]  # now cached on every rank: no probe
    assert len(queries) == 3 and len(probes) == 2, (queries, probes)
    dist.barrier()


def test_a_failed_gpu_query_on_one_rank_leaves_every_rank_uncached():
    run_ranks(cache_after_a_failed_query, 2, timeout=60)


def cache_after_the_devices_changed_on_one_rank(rank, world):
    """Issue 38's fourth bug: the cache was keyed on the caller's own device.
    Both ranks use cuda:0, then rank 0 stays on cuda:0 and rank 1 moves to
    cuda:1: rank 0 hit its cache and skipped the probe that rank 1, missing,
    made; their gathers paired wrongly and every rank raised, for good."""
    from pyallreduce.transport import cuda_ipc, topology

    probes = []
    cuda_ipc._C.cuda_pci_bus_id = lambda index: f"0000:{2 * rank + index + 1:02x}:00.0"
    topology._check_peers = lambda index, bus, rank, facts: None

    def probe(group, index, rank, world):
        probes.append(index)
        dist.barrier(group=group)  # the real probe's barriers: they must pair with the peers' probe

    topology._ipc_probe = probe
    devices = itertools.cycle([[0, 0], [0, 1]][rank])
    cuda_ipc._device_index = lambda device: next(devices)
    for _ in range(4):  # rank 1 alternates between its GPUs, rank 0 keeps one: two keys, each probed once
        assert topology.check_topology() == (True, "same host, P2P mesh, IPC probe passed")
    assert probes == [0, 0] if rank == 0 else probes == [0, 1], probes
    dist.barrier()


def test_ranks_whose_devices_changed_differently_agree_on_the_cache():
    run_ranks(cache_after_the_devices_changed_on_one_rank, 2, timeout=60)
