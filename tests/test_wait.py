"""The CPU backend's wait (csrc/cpu/all_reduce.cpp, wait_reached): spin (or
yield, where the ranks outnumber their cores), then sleep on a futex that the
peer's flag store wakes. No wake-up may be lost.

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


def delayed_waits(rank, world, seed, one_core):
    import os

    import pyallreduce

    spinner = None
    if one_core:  # the ranks outnumber their cores: waits yield before they sleep
        core = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {core})
        if one_core == "beside a busy process" and rank == 0:  # yields lose slices to it: the spin stage
            import subprocess
            import sys

            # Bounded, so that a rank killed before it stops the spinner leaves nothing running long.
            spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 120\n"
                                        "while time.time() < end: pass"],
                                       preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    try:
        comm = pyallreduce.Communicator(max_bytes=64 << 10, timeout=TIMEOUT_S)
        if one_core:
            assert pyallreduce.policy.ranks_outnumber_cores(comm._engine.transport.pids)
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
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()


@pytest.mark.quick
@pytest.mark.parametrize("world,one_core", [(2, False), (3, False), (3, True), (3, "beside a busy process")])
def test_no_lost_wake_up_when_ranks_stall_at_every_point_of_the_wait(world, one_core):
    run_ranks(delayed_waits, world, 11 + world, one_core, timeout=240,
              env={"PYALLREDUCE_TEST_WAIT_DELAY_US": str(DELAY_US)})
