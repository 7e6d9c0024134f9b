"""The seeded lifecycle explorer (tests/explorer.py) on the CPU engine, in CI:
fixed seeds at 2, 3 and 4 ranks, under a minute in all on the 2-core
VM. PYALLREDUCE_EXPLORER_SEEDS="first:count" runs more seeds (each at 2
ranks) by hand. A failure names the seed and the steps that led to it."""
import os

import pytest

from explorer import explore
from launch import run_ranks
from pyallreduce.transport.host_shm import leaked_segments

# (world size, seed, steps): fixed, so CI explores the same orders every run.
RUNS = [(2, seed, 60) for seed in range(6)] + [(3, 100, 40), (3, 101, 40), (4, 200, 30)]
EXTRA_ENV = "PYALLREDUCE_EXPLORER_SEEDS"


def extra_runs():
    first, count = (int(v) for v in os.environ.get(EXTRA_ENV, "0:0").split(":"))
    return [(2, seed, 40) for seed in range(first, first + count)]


@pytest.mark.parametrize("world,seed,steps", RUNS + extra_runs())
def test_explorer(world, seed, steps):
    taken = run_ranks(explore, world, seed, steps, timeout=300)
    assert all(t == taken[0] for t in taken), "the ranks took different steps"
    assert taken[0][-1] == "end" and len(taken[0]) == steps + 1
    assert leaked_segments() == [], "shared-memory segments left in /dev/shm"
