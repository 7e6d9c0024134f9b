"""The Triton kernels under TRITON_INTERPRET=1: the real kernels, across
processes, over POSIX shared memory (HostShmTransport). Every result must be
bitwise equal to the fp32-in-rank-order definition, across ranks, and to the
C++ CPU backend on the same inputs; a rank that never arrives must make the
deadline fire with its rank named.

The interpreter runs each program as Python, so sizes are small and programs
few; the whole file takes 30 to 60 s on 2 cores.
"""
import ctypes
import hashlib
import random
import time

import pytest
import torch
import torch.distributed as dist

from launch import run_ranks
from reference import DTYPES, exact_input, exact_sum, fp32_reduction, random_input

MAX_BYTES = 64 << 10
# Triton needs TRITON_INTERPRET before the kernels are decorated: the children
# get it in their environment before they import pyallreduce.triton_kernels.
ENV = {"TRITON_INTERPRET": "1"}
# Generous: up to 4 interpreters share 2 cores. The deadline tests use short ones.
TIMEOUT_S = 60.0
# Epochs start this close to 2**32 so every run crosses the 32-bit wrap.
NEAR_WRAP = 2**32 - 5


def bits(t):
    """The tensor's raw bits, so -0.0 != 0.0 and NaN == NaN compare as the hardware stores them."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def chunk_elems(dtype):
    from pyallreduce.triton_kernels.one_shot import CHUNK_BYTES

    return CHUNK_BYTES // torch.empty((), dtype=dtype).element_size()


def call_plan(world, seed):
    """Every rank builds the same list: (numel, dtype, algo, average, in_place, exact)."""
    rng = random.Random(seed)
    plan = []
    for dtype in DTYPES:
        chunk = chunk_elems(dtype)
        per_call = MAX_BYTES // torch.empty((), dtype=dtype).element_size()
        for numel in (1, 13, chunk + 1, 3 * chunk + 5, per_call):
            for algo in (0, 1):
                plan.append((numel, dtype, algo, False, rng.random() < 0.3, True))
    # Random floats, averages, odd sizes, in and out of place, shuffled so that
    # sizes, dtypes and algorithms change from call to call.
    for _ in range(12):
        dtype = rng.choice(DTYPES)
        numel = rng.choice([2, 7, 1021, 4099, 2 * chunk_elems(dtype) - 1, 9 * chunk_elems(dtype) + 3])
        plan.append((numel, dtype, rng.randrange(2), rng.random() < 0.5, rng.random() < 0.3, False))
    rng.shuffle(plan)
    return plan


def start_near_wrap(transport, nblocks, value):
    """Puts this rank's region in the state it would have after `value` calls
    (every program's epoch and every flag it receives equal to value), so the
    next calls cross the 32-bit wrap of epochs and flags."""
    from pyallreduce import _C

    base = transport.regions[transport.rank]
    words = lambda offset, n: (ctypes.c_uint32 * n).from_address(base + offset)  # noqa: E731
    epochs = words(_C.EPOCH_OFFSET, _C.MAX_BLOCKS)
    flags = [words(off, _C.MAX_BLOCKS * _C.MAX_RANKS) for off in (_C.START_FLAGS_OFFSET, _C.MID_FLAGS_OFFSET)]
    for b in range(nblocks):
        epochs[b] = value
        for f in flags:
            for q in range(transport.world_size):
                f[b * _C.MAX_RANKS + q] = value
    dist.barrier()  # no rank signals before every region is set


def reduce_back_to_back(rank, world, nblocks, seed):
    """Runs the plan on the Triton kernels, back to back with random per-rank
    delays, then on the C++ CPU backend (on its own transport), and checks
    every result. Returns the failures and per-call digests."""
    from pyallreduce import _C
    from pyallreduce import triton_kernels as tk
    from pyallreduce.transport import HostShmTransport

    plan = call_plan(world, seed)
    inputs = []
    for i, (numel, dtype, _, _, _, exact) in enumerate(plan):
        if exact:
            inputs.append([exact_input(numel, q, dtype, salt=i) for q in range(world)])
        else:
            inputs.append([random_input(numel, q, dtype, seed=seed * 1000 + i) for q in range(world)])

    # Nothing but the calls in this loop: a rank that runs ahead starts the
    # next call while slower peers still read this one's staging buffers.
    delays = random.Random(seed * 100 + rank)  # differs per rank
    results = []
    triton_t = HostShmTransport(dist.group.WORLD, MAX_BYTES)
    try:
        start_near_wrap(triton_t, nblocks, NEAR_WRAP)
        for (numel, dtype, algo, average, in_place, _), xs in zip(plan, inputs):
            x = xs[rank].clone()
            out = x if in_place else torch.full_like(x, 77)
            if delays.random() < 0.3:
                time.sleep(delays.random() * 0.02)
            tk.all_reduce(x, out, triton_t.regions, rank, world, MAX_BYTES, nblocks, algo, average, TIMEOUT_S)
            results.append(out.clone())
            # The caller owns its buffers again at once: peers read the staging copy.
            x.fill_(1000)
            out.fill_(-1000)
    finally:
        triton_t.close()

    failures = []
    cpu_t = HostShmTransport(dist.group.WORLD, MAX_BYTES)
    handle = _C.create_context(cpu_t.regions, rank, MAX_BYTES, 1, TIMEOUT_S, -1, cpu_t.pids)
    try:
        for i, ((numel, dtype, algo, average, in_place, exact), xs, got) in enumerate(zip(plan, inputs, results)):
            what = f"call {i}: numel={numel} {dtype} algo={algo} average={average} in_place={in_place}"
            want = fp32_reduction(xs, average)
            if not torch.equal(bits(got), bits(want)):
                bad = (bits(got) != bits(want)).nonzero().flatten()[:5].tolist()
                failures.append(f"{what}: differs from the fp32 rank-order sum at {bad}")
            if exact and not average and not torch.equal(got.double(), exact_sum(numel, world, torch.float64, salt=i)):
                failures.append(f"{what}: not the exact sum")
            cpu = torch.ops.pyallreduce.all_reduce(xs[rank], handle, algo, average)
            if not torch.equal(bits(cpu), bits(got)):
                failures.append(f"{what}: differs from the C++ CPU backend")
    finally:
        _C.destroy_context(handle)
        cpu_t.close()
    return failures, [hashlib.sha1(bits(got).numpy().tobytes()).hexdigest() for got in results]


# nblocks 1 matters: the interpreter runs a rank's programs one after another,
# so only with a single program can a rank run a whole call ahead of a peer
# that still reads (what the alternating staging buffers are for).
@pytest.mark.parametrize("world,nblocks", [(2, 3), (3, 1), (4, 2)])
def test_bitwise_equal_to_reference_cpu_backend_and_peers(world, nblocks):
    results = run_ranks(reduce_back_to_back, world, nblocks, 7 + world, timeout=240, env=ENV)
    failures = [f"rank {r}: {f}" for r, (fails, _) in enumerate(results) for f in fails]
    assert not failures, "\n".join(failures[:20])
    digests = [d for _, d in results]
    for r in range(1, world):
        assert digests[r] == digests[0], f"rank {r}'s results differ from rank 0's"


def expect_deadline(call, barrier, missing, timeout_s):
    started = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        call()
    waited = time.monotonic() - started
    message = str(info.value)
    assert f"in the {barrier} barrier" in message and f"rank(s) {missing} never arrived" in message, message
    # It waited for the deadline, once (not once per program), and no longer.
    assert timeout_s <= waited < timeout_s + 10, f"raised after {waited:.2f} s: {message}"


def deadline_and_checks(rank, world):
    """Rank 1 skips a call (start barrier), then runs one-shot while the others
    run two-shot (it leaves before their mid barrier): both times ranks 0 and 2
    must raise naming rank 1, after the deadline, without hanging."""
    from pyallreduce import _C
    from pyallreduce import triton_kernels as tk
    from pyallreduce.transport import HostShmTransport

    short = 2.0  # long enough that a loaded machine does not make rank 2 look missing too
    nblocks = 2
    x = exact_input(3000, rank, torch.float32)
    out = torch.empty_like(x)

    # Arguments are checked before any signalling.
    t = HostShmTransport(dist.group.WORLD, MAX_BYTES)
    try:
        args = (t.regions, rank, world, MAX_BYTES, nblocks)
        with pytest.raises(ValueError, match="exceed the staging buffer"):
            big = torch.zeros(MAX_BYTES // 4 + 1)
            tk.all_reduce(big, big, *args, _C.ONE_SHOT, False, short)
        with pytest.raises(TypeError, match="not supported"):
            ints = torch.zeros(4, dtype=torch.int32)
            tk.all_reduce(ints, ints, *args, _C.ONE_SHOT, False, short)
        with pytest.raises(ValueError, match="unknown algorithm"):
            tk.all_reduce(x, out, *args, 7, False, short)

        # Warm-up, so that no rank arrives late at the calls below because it
        # is still preparing a kernel; and these must succeed.
        for algo in (_C.ONE_SHOT, _C.TWO_SHOT):
            tk.all_reduce(x, out, *args, algo, False, TIMEOUT_S)
            assert torch.equal(out, exact_sum(3000, world, torch.float32))
        dist.barrier()

        # Start barrier: rank 1 never calls.
        if rank != 1:
            expect_deadline(lambda: tk.all_reduce(x, out, *args, _C.ONE_SHOT, False, short), "start", "1", short)
        dist.barrier()
    finally:
        t.close()

    # Mid barrier: the epochs above are out of step now, so a fresh transport.
    t = HostShmTransport(dist.group.WORLD, MAX_BYTES)
    try:
        args = (t.regions, rank, world, MAX_BYTES, nblocks)
        if rank == 1:
            # Its result is garbage (the others reduce into their staging
            # buffers while it reads them); only its leaving early matters.
            tk.all_reduce(x, out, *args, _C.ONE_SHOT, False, TIMEOUT_S)
        else:
            expect_deadline(lambda: tk.all_reduce(x, out, *args, _C.TWO_SHOT, False, short), "mid", "1", short)
        dist.barrier()
    finally:
        t.close()


def test_deadline_names_the_missing_rank():
    run_ranks(deadline_and_checks, 3, timeout=120, env=ENV)
