"""The seeded lifecycle explorer (tests/explorer.py) on the CPU engine, in CI:
fixed seeds at 2, 3 and 4 ranks, under a minute in all on the 2-core
VM, and three more that end by killing a rank. PYALLREDUCE_EXPLORER_SEEDS=
"first:count" runs more seeds (each at 2 ranks) by hand. A failure names the
seed and the steps that led to it.

On CUDA communicators (CudaExplorer): on a GPU, and in CI on the emulated
runtime's two devices (tests/test_cuda_emulated.py runs this file there)."""
import os
import signal

import pytest
import torch

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


# (world size, seed, steps, the rank killed at the end): a rank's death in
# whatever state the steps left (slots on either group, after aborts, regroups).
KILLED_RUNS = [(2, 300, 20, 1), (3, 301, 20, 0), (4, 302, 12, 2)]


@pytest.mark.parametrize("world,seed,steps,victim", KILLED_RUNS)
def test_explorer_ending_in_a_killed_rank(world, seed, steps, victim):
    taken = run_ranks(explore, world, seed, steps, "cpu", victim, timeout=300,
                      expect_exit={victim: -signal.SIGKILL})
    survivors = [t for r, t in enumerate(taken) if r != victim]
    assert all(t == survivors[0] for t in survivors), "the survivors took different steps"
    assert survivors[0][-1].startswith(f"rank {victim} killed") and len(survivors[0]) == steps + 1
    assert leaked_segments() == [], "shared-memory segments left in /dev/shm"


# (world size, seed, steps), 10 to 50 s each on the emulated runtime.
CUDA_RUNS = [(2, 0, 30), (2, 2, 30), (2, 3, 30), (2, 5, 30), (3, 7, 20), (4, 11, 20)]


@pytest.mark.parametrize("world,seed,steps", CUDA_RUNS)
def test_cuda_explorer(world, seed, steps):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (tests/test_cuda_emulated.py runs this on the emulated runtime)")
    taken = run_ranks(explore, world, seed, steps, "cuda", timeout=600)
    assert all(t == taken[0] for t in taken), "the ranks took different steps"
    assert taken[0][-1] == "end" and len(taken[0]) == steps + 1


# (world size, seed, steps, the rank killed at the end), on CUDA communicators.
CUDA_KILLED_RUNS = [(2, 303, 12, 1), (3, 304, 10, 0)]


@pytest.mark.parametrize("world,seed,steps,victim", CUDA_KILLED_RUNS)
def test_cuda_explorer_ending_in_a_killed_rank(world, seed, steps, victim):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (tests/test_cuda_emulated.py runs this on the emulated runtime)")
    taken = run_ranks(explore, world, seed, steps, "cuda", victim, timeout=600,
                      expect_exit={victim: -signal.SIGKILL})
    survivors = [t for r, t in enumerate(taken) if r != victim]
    assert all(t == survivors[0] for t in survivors), "the survivors took different steps"
    assert survivors[0][-1].startswith(f"rank {victim} killed") and len(survivors[0]) == steps + 1
