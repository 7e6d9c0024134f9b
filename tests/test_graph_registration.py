"""The decisions comm.capture() takes when it exits, from data gathered from
every rank, so every rank must reach the same one: whether a captured buffer
can be read in place, and whether the ranks captured the same calls. (The CUDA
half, the graph table the replays read, runs in tests/test_cuda.py on a GPU.)"""
import pytest

from launch import run_ranks
from pyallreduce.engines.cuda import CAPTURE_ABORTED, captures_mismatch
from pyallreduce.transport.cuda_ipc import buffer_verdict

HANDLE = b"h" * 64


def test_buffers_every_rank_exported_alike_are_read_in_place():
    assert buffer_verdict([(HANDLE, 0, 4096), (HANDLE, 512, 4096), (HANDLE, 16, 4096)]) is None


def test_a_buffer_one_rank_could_not_export_stays_staged_naming_the_rank():
    why = buffer_verdict([(HANDLE, 0, 4096), "memory cannot be exported with legacy CUDA IPC"])
    assert why == "rank 1: memory cannot be exported with legacy CUDA IPC"


def test_buffers_of_different_sizes_stay_staged():
    assert buffer_verdict([(HANDLE, 0, 4096), (HANDLE, 0, 2048)]) == \
        "the ranks' buffers differ in size ([2048, 4096] bytes)"


def test_buffers_off_16_byte_alignment_stay_staged():
    assert buffer_verdict([(HANDLE, 8, 64), (HANDLE, 0, 64), (HANDLE, 4, 64)]) == \
        "the buffers of ranks [0, 2] are not 16-byte aligned"


def call(nbytes, in_place=False, has_entry=True, algo=0, dtype="Float", average=False):
    """One captured call as a rank reports it at capture() exit."""
    return (nbytes, in_place, algo, dtype, average, has_entry)


@pytest.mark.quick
def test_same_captured_calls_on_every_rank_pass():
    calls = [call(4096), call(512, in_place=True, algo=1)]
    assert captures_mismatch([calls, list(calls), list(calls)]) is None
    assert captures_mismatch([[], []]) is None
    # Whether a rank could give a call an entry is not part of the match.
    assert captures_mismatch([[call(64)], [call(64, has_entry=False)]]) is None


@pytest.mark.quick
def test_different_captured_calls_are_an_error_showing_every_rank():
    error = captures_mismatch([[call(4096)], [call(4096), call(64)]])
    assert "ranks captured different all_reduce calls" in error
    assert "rank 0: 1 calls" in error and "rank 1: 2 calls" in error
    # Same count, but any property of a call differs on one rank.
    for other in (call(2048), call(4096, in_place=True), call(4096, algo=1), call(4096, dtype="Half"),
                  call(4096, average=True)):
        assert captures_mismatch([[call(4096)], [other]]) is not None, other


def test_a_capture_that_failed_on_a_rank_is_an_error_on_the_others():
    error = captures_mismatch([[call(4096)], CAPTURE_ABORTED, [call(4096)]])
    assert f"comm.capture() failed on rank 1: {CAPTURE_ABORTED}" in error


# ---- the exchange at capture() exit, across processes, with the CUDA calls stubbed --------
# Communicator._register_captured and CudaIpcTransport.share_buffers run for real
# over gloo; only what needs a GPU is replaced: the graph table (_C.cuda_graph_*),
# exporting and mapping IPC handles, and device synchronisation.

PEER_BASE = 1 << 40  # where rank q's allocation is "mapped" in every process: PEER_BASE * (q + 1)


def input_address(rank, call):
    return (rank + 1) * 0x100000 + call * 0x1000


class FakeGraphTable:
    """What this rank's C++ graph table is told, in place of pyallreduce._C."""

    def __init__(self, calls, fail_set=False, fail_begin=False):
        self.calls, self.fail_set, self.fail_begin = calls, fail_set, fail_begin
        self.opened, self.entries, self.reset = False, None, None

    def cuda_launch_chain(self, handle):
        return 0, True  # its calls were captured

    def cuda_wait_for_launches(self, device, launched, captured):
        pass

    def cuda_graph_capture_begin(self, handle, block_entries):
        if self.fail_begin:
            raise RuntimeError("cudaMalloc failed")
        self.opened = True

    def cuda_graph_capture_end(self, handle):
        self.opened = False
        return self.calls, 0

    def cuda_graph_set_entries(self, handle, slots, peer_ptrs):
        if self.fail_set:
            raise RuntimeError("cudaMemcpy failed")
        self.entries = dict(zip(slots, peer_ptrs))

    def cuda_graph_reset_entries(self, handle, slots):
        self.reset = list(slots)


def exit_capture(rank, world, captured, unexportable=(), fail_set_on=None, aborted=False, fail_begin_on=None):
    """Runs `with comm.capture():` on this rank as if it captured `captured`
    (call(...) tuples); the body raises if `aborted`. Returns (entries set,
    entries reset, error text)."""
    from unittest import mock

    import torch
    import torch.distributed as dist

    from pyallreduce import communicator, engines
    from pyallreduce.engines import cuda
    from pyallreduce.transport import cuda_ipc

    calls = [(10 + k if c[-1] else -1, input_address(rank, k), *c[:-1]) for k, c in enumerate(captured)]
    table = FakeGraphTable(calls, fail_set=rank == fail_set_on, fail_begin=rank == fail_begin_on)
    transport = object.__new__(cuda_ipc.CudaIpcTransport)
    transport.rank, transport._group, transport._opened = rank, dist.group.WORLD, {}

    def export(ptr, nbytes):
        k = (ptr - input_address(rank, 0)) // 0x1000
        if (rank, k) in unexportable:
            return "memory cannot be exported with legacy CUDA IPC"
        return (f"handle of rank {rank}".encode(), ptr % 0x100000, nbytes)

    def open_handle(handle):
        return PEER_BASE * (int(handle.split()[-1]) + 1)

    transport._export, transport._open = export, open_handle
    engine = object.__new__(cuda.CudaEngine)
    engine.handle, engine.transport, engine.group, engine.device = 1, transport, dist.group.WORLD, torch.device("cuda", 0)
    comm = object.__new__(communicator.Communicator)
    comm._engine, comm._capturing, comm.device = engine, False, engine.device
    error = None
    with mock.patch.object(cuda, "_C", table), \
            mock.patch.object(cuda, "stream_capturing", lambda device: False), \
            mock.patch.object(engines, "stream_capturing", lambda device: False):
        try:
            with comm.capture():
                assert table.opened and comm._capturing
                if aborted:
                    raise ValueError("the capture's own error")
        except (RuntimeError, ValueError) as e:
            error = str(e)
    assert not comm._capturing and not table.opened
    return table.entries, table.reset, error


def peers(call, world, own_rank):
    """Every rank's address of captured call `call` as rank own_rank maps it."""
    return [input_address(q, call) if q == own_rank else PEER_BASE * (q + 1) + input_address(q, call) % 0x100000
            for q in range(world)]


@pytest.mark.quick
def test_captured_buffers_get_every_ranks_address_on_every_rank():
    captured = [call(4096), call(512, in_place=True, algo=1)]
    results = run_ranks(exit_capture, 3, captured)
    for rank, (entries, reset, error) in enumerate(results):
        assert error is None and reset is None
        assert entries == {10: peers(0, 3, rank), 11: peers(1, 3, rank)}


def test_a_buffer_one_rank_cannot_export_stays_staged_on_every_rank():
    results = run_ranks(exit_capture, 2, [call(4096), call(4096)], {(1, 0)})
    for rank, (entries, reset, error) in enumerate(results):
        assert error is None
        assert entries == {11: peers(1, 2, rank)}, "call 0 must stay staged on both ranks"


def test_a_call_without_an_entry_on_one_rank_stays_staged_on_every_rank():
    results = run_ranks(exit_capture_one_without_entry, 2)
    for rank, (entries, reset, error) in enumerate(results):
        assert error is None
        assert entries == {11: peers(1, 2, rank)}, "call 0 must stay staged on both ranks"


def exit_capture_one_without_entry(rank, world):
    return exit_capture(rank, world, [call(4096, has_entry=rank == 0), call(64)])


def test_ranks_that_captured_different_calls_all_raise_and_stay_staged():
    results = run_ranks(exit_capture_differently, 2)
    for entries, reset, error in results:
        assert entries is None and "captured different all_reduce calls" in error


def exit_capture_differently(rank, world):
    return exit_capture(rank, world, [call(4096)] if rank == 0 else [call(4096, algo=1)])


def test_a_capture_that_failed_on_one_rank_makes_the_others_raise_instead_of_waiting():
    results = run_ranks(exit_capture_failed_on_rank_1, 2, timeout=60)
    assert results[0][0] is None and f"comm.capture() failed on rank 1: {CAPTURE_ABORTED}" in results[0][2]
    assert results[1] == (None, None, "the capture's own error"), "the failed rank's own error propagates"


def exit_capture_failed_on_rank_1(rank, world):
    return exit_capture(rank, world, [call(4096)], aborted=rank == 1)


def test_a_rank_failing_to_write_its_entries_makes_every_rank_raise_and_reset():
    results = run_ranks(exit_capture, 2, [call(4096)], (), 1)
    for rank, (entries, reset, error) in enumerate(results):
        assert "registering the captured buffers failed on rank 1: cudaMemcpy failed" in error
        assert reset == [10], f"rank {rank} must put its entry back to staged"


def test_a_graph_table_that_fails_to_open_on_one_rank_is_an_error_on_every_rank():
    results = run_ranks(exit_capture_begin_fails_on_rank_1, 2)
    for entries, reset, error in results:
        assert entries is None
        assert "opening the graph table for comm.capture() failed on rank 1: cudaMalloc failed" in error
    # exit_capture also asserts that rank 0 closed the table it had opened.


def exit_capture_begin_fails_on_rank_1(rank, world):
    return exit_capture(rank, world, [call(4096)], fail_begin_on=1)

