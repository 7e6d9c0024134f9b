"""The CPU backend's wait (csrc/cpu/all_reduce.cpp, wait_reached): spin, then
sleep on a futex that the peer's flag store wakes. No wake-up may be lost.

PYALLREDUCE_TEST_WAIT_DELAY_US makes every long wait sleep a random time at
each point where a lost wake-up could hide (after the clock read of the
deadline check, between the sleep-word store and the futex call, after the
futex returns, spurious wake-ups included) and sleep on the futex until the
deadline instead of waking every 100 ms: a wake-up lost anywhere then fails
the call with the deadline's error instead of only slowing it down. Caught
deliberately: signal_peers reading the sleep word of its own region instead of
the peer's (no sleeper is ever woken).
"""
import random
import time

import pytest
import torch

from launch import run_ranks
from reference import exact_input, exact_sum

CALLS = 150
DELAY_US = 300
TIMEOUT_S = 20  # a lost wake-up shows as this deadline passing


def stall(seconds):
    """Busy for `seconds`: this rank arrives late, as after uneven compute."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def delayed_waits(rank, world, seed):
    import pyallreduce

    comm = pyallreduce.Communicator(max_bytes=64 << 10, timeout=TIMEOUT_S)
    plan = random.Random(seed)  # the same calls on every rank
    late = random.Random(seed * 100 + rank)  # who arrives late differs per rank and call
    for call in range(CALLS):
        n = plan.choice([1, 7, 64, 1000, 4096, 40000])  # one round, and several (two-shot rounds)
        kind = plan.choice(["one_shot", "two_shot", "reduce_scatter", "all_gather"])
        if late.random() < 0.3:
            stall(late.random() * 2e-4)
        x = exact_input(n * world, rank, torch.float32, salt=call)
        total = exact_sum(n * world, world, torch.float32, salt=call)
        if kind in ("one_shot", "two_shot"):
            got, want = comm.all_reduce(x, algo=kind), total
        elif kind == "reduce_scatter":
            got, want = comm.reduce_scatter(x), total.view(world, n)[rank]
        else:
            got = comm.all_gather(x[:n])
            want = torch.cat([exact_input(n * world, q, torch.float32, salt=call)[:n] for q in range(world)])
        assert torch.equal(got, want), f"call {call} ({kind}, {n} elements per rank): wrong result"
    comm.close()


@pytest.mark.quick
@pytest.mark.parametrize("world", [2, 3])
def test_no_lost_wake_up_when_ranks_stall_at_every_point_of_the_wait(world):
    run_ranks(delayed_waits, world, 11 + world, timeout=240,
              env={"PYALLREDUCE_TEST_WAIT_DELAY_US": str(DELAY_US)})
