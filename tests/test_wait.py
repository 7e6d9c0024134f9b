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


def ranks_started_on_one_cpu(rank, world, cores):
    """Ranks allowed two CPUs, both put on the first: the higher rank moves
    off (csrc/cpu/all_reduce.cpp, move_off_shared_cpu) and gives its thread
    back the affinity it had; every result exact meanwhile."""
    import os

    import pyallreduce

    os.sched_setaffinity(0, cores)
    comm = pyallreduce.Communicator(max_bytes=64 << 10, timeout=TIMEOUT_S)
    assert not pyallreduce.policy.ranks_outnumber_cores(comm._engine.transport.pids)  # the hand-over applies
    os.sched_setaffinity(0, {min(cores)})  # both on one CPU now,
    os.sched_setaffinity(0, cores)  # allowed the other, as the scheduler would leave them
    for call in range(CALLS * 2):
        got = comm.all_reduce(exact_input(64, rank, torch.float32, salt=call))
        assert torch.equal(got, exact_sum(64, 2, torch.float32, salt=call)), f"call {call}: wrong result"
        assert os.sched_getaffinity(0) == cores, f"call {call}: affinity {os.sched_getaffinity(0)}, not {cores}"
    comm.close()


@pytest.mark.quick
def test_ranks_on_one_cpu_part_and_keep_their_affinity():
    import os

    cores = set(sorted(os.sched_getaffinity(0))[:2])
    if len(cores) < 2:
        pytest.skip("needs two CPUs")
    run_ranks(ranks_started_on_one_cpu, 2, cores, timeout=240)
