"""No silent corruption: ranks that disagree about a call all raise the same
error before any data moves (protocol.h, CallDesc), on the fast path and for
calls that go to torch.distributed; and the mid barrier stays sound across the
32-bit epoch wrap (protocol.h: every call stores its mid flags).

The C++ CPU backend here; tests/test_triton.py covers the Triton kernels and
tests/test_cuda_sim.py the CUDA kernels, with the same cases."""
import ctypes

import pytest
import torch
import torch.distributed as dist

from launch import run_ranks
from reference import MISMATCHED_CALLS, exact_input, exact_sum

SENTINEL = -7.0


def make_comm(**kw):
    import pyallreduce

    kw.setdefault("max_bytes", 1 << 20)
    kw.setdefault("timeout", 60)
    return pyallreduce.Communicator(**kw)


# tests/reference.py's mismatched calls, and one the host backend runs in
# several protocol rounds (> 256 KiB), whose first rounds' sizes agree while
# the calls' do not.
CASES = {
    **MISMATCHED_CALLS,
    "size_in_rounds": ((80000, torch.float32, "sum", "two_shot", False),
                       (131072, torch.float32, "sum", "two_shot", False)),
}


def mismatched(rank, world, case):
    agreed, odd = CASES[case]
    comm = make_comm()
    spec = odd if rank == world - 1 else agreed
    numel, dtype, op, algo, in_place = spec
    x = exact_input(numel, rank, dtype)
    out = torch.full((numel,), SENTINEL, dtype=dtype)
    with pytest.raises(RuntimeError) as raised:
        if in_place:
            comm.all_reduce_(x, op=op, algo=algo)
        else:
            comm.all_reduce(x, op=op, algo=algo, out=out)
    # Nothing was written: not the output, not an in-place input.
    assert torch.equal(x, exact_input(numel, rank, dtype)), "the input changed"
    if not in_place:
        assert bool((out == SENTINEL).all()), "the output was written"
    # The communicator is still usable: the next matching call is exact.
    for algo in ("one_shot", "two_shot"):
        assert torch.equal(comm.all_reduce(exact_input(3000, rank, torch.float32), algo=algo),
                           exact_sum(3000, world, torch.float32))
    comm.close()
    return str(raised.value)


@pytest.mark.quick
@pytest.mark.parametrize("case", sorted(CASES))
def test_ranks_that_disagree_all_raise_the_same_error_and_nothing_is_written(case):
    messages = run_ranks(mismatched, 2, case, timeout=120)
    assert messages[0] == messages[1], messages
    text = messages[0]
    assert "the ranks disagree about collective call 1" in text, text
    rank_lines = text.splitlines()[-2:]
    assert rank_lines[0].startswith("  rank 0: ") and rank_lines[1].startswith("  rank 1: "), text
    assert rank_lines[0][len("  rank 0: "):] != rank_lines[1][len("  rank 1: "):], text


def one_rank_differs_of_three(rank, world):
    comm = make_comm()
    numel = 999 if rank == 1 else 1000
    with pytest.raises(RuntimeError, match="the ranks disagree") as raised:
        comm.all_reduce(exact_input(numel, rank, torch.float32), algo="two_shot")
    assert torch.equal(comm.all_reduce(exact_input(500, rank, torch.float16)), exact_sum(500, world, torch.float16))
    comm.close()
    return str(raised.value)


def test_one_rank_of_three_differing_is_named_on_every_rank():
    messages = run_ranks(one_rank_differs_of_three, 3, timeout=120)
    assert len(set(messages)) == 1, messages
    assert "rank 0: 4000 bytes" in messages[0] and "rank 1: 3996 bytes" in messages[0], messages[0]


def debug_mode_fallback_mismatch(rank, world):
    # fp32 on one rank, fp64 (the torch.distributed fallback) on the other: the
    # fingerprint is compared before either rank branches, so both raise.
    comm = make_comm(debug=True)
    dtype = torch.float64 if rank == 1 else torch.float32
    with pytest.raises(RuntimeError, match=r"ranks disagree[\s\S]*torch.float32[\s\S]*torch.float64"):
        comm.all_reduce(torch.ones(10, dtype=dtype))
    assert torch.equal(comm.all_reduce(torch.ones(10)), torch.full((10,), float(world)))
    comm.close()


def test_debug_mode_never_deadlocks_on_a_fallback_mismatch():
    run_ranks(debug_mode_fallback_mismatch, 2, timeout=120)


# ---- the epoch wrap ------------------------------------------------------------


def set_counters(comm, epoch, mid):
    """Sets this rank's own block-0 counters to the state a long history leaves:
    epoch counter and every start flag `epoch`, every mid flag `mid` (the
    region layout is protocol.h's, through pyallreduce._C)."""
    from pyallreduce import _C

    base = comm._engine.transport.regions[comm.rank]
    ctypes.c_uint32.from_address(base + _C.EPOCH_OFFSET).value = epoch
    for q in range(comm.world_size):
        ctypes.c_uint32.from_address(base + _C.START_FLAGS_OFFSET + 4 * q).value = epoch
        ctypes.c_uint32.from_address(base + _C.MID_FLAGS_OFFSET + 4 * q).value = mid


def across_the_wrap(rank, world, start_epoch, mid):
    comm = make_comm()
    dist.barrier()  # nobody is inside a call while the counters change
    set_counters(comm, start_epoch, mid)
    dist.barrier()
    # One-shot calls first (the only kind that ran "before"), then two-shot
    # calls across the wrap: 256 KiB each, so a mid barrier passed early
    # would read a peer's slice before it was reduced.
    numel = 65536
    wrong = 0
    for i, algo in enumerate(["one_shot", "two_shot", "two_shot", "one_shot", "two_shot", "two_shot", "two_shot"]):
        got = comm.all_reduce(exact_input(numel, rank, torch.float32, salt=i), algo=algo)
        wrong += int((got != exact_sum(numel, world, torch.float32, salt=i)).sum())
    comm.close()
    return wrong


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("start_epoch, mid", [
    (0xFFFFFFFD, 0),           # ~2^32 one-shot calls, then the first two-shot calls (the zeroed mid flags)
    (0xFFFFFFFB, 0xFFFFFFFB),  # what the fixed protocol leaves: every call refreshed its mid flags
    (0xFFFFFFFE, 1),           # a two-shot call exactly 2^32 - 1 epochs ago
])
@pytest.mark.quick
def test_calls_across_the_32_bit_epoch_wrap_are_exact(world, start_epoch, mid):
    assert run_ranks(across_the_wrap, world, start_epoch, mid, timeout=120) == [0] * world
