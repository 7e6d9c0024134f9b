"""The Triton kernels under TRITON_INTERPRET=1: the real kernels, across
processes, over POSIX shared memory (HostShmTransport). Every result must be
bitwise equal to the fp32-in-rank-order definition, across ranks, and to the
C++ CPU backend on the same inputs; a rank that never arrives must make the
deadline fire with its rank named.

Also: the wrap fix (calls across the 32-bit epoch wrap from an old-protocol
history, and a deterministic mid-barrier check), and the per-call agreement
(mismatched calls raise the same error on every rank, nothing is written, the
next call works); and the two-shot ownership (every rank reduces its share of
the chunks, within one chunk of the others', read from its staging buffer).
Reduce-scatter and all-gather: bitwise against the reference and the
all-reduce, exact byte copies of any dtype, both in-place forms, mixed with
all-reduces on one set of regions; refused arguments; mismatched calls.

The interpreter runs each program as Python, so sizes are small and programs
few; the whole file takes 2 to 3 minutes on 2 cores.
"""
import ctypes
import hashlib
import random
import time

import pytest
import torch
import torch.distributed as dist

from launch import own_segments_mapped, raises_when_a_watchdog_aborts, run_ranks
from reference import DTYPES, MISMATCHED_CALLS, exact_input, exact_sum, fp32_reduction, random_input, \
    triton_kernels_unusable

if (_why := triton_kernels_unusable(interpret=True)) is not None:
    pytest.skip(_why, allow_module_level=True)

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


def region_words(transport, rank, offset, n, ctype=ctypes.c_uint32):
    """n words at byte `offset` of rank `rank`'s region, as mapped here."""
    return (ctype * n).from_address(transport.regions[rank] + offset)


def kernel_kind(x, algo, average=False, in_place=False):
    from pyallreduce import _C

    return _C.desc_kind(_C.dtype_code(x.dtype), algo, _C.MODE_STAGED, average, in_place)


def arrive_at_start(transport, nblocks, nbytes, kind):
    """Plays this rank's part of a call's start (protocol.h) by hand, for every
    program: publishes the descriptor (nbytes, e, kind) and the start flag e
    into every peer's region, where e is the next epoch; then stops, as a rank
    that never reaches the mid barrier would. Its own region is left alone."""
    from pyallreduce import _C

    me = transport.rank
    epochs = region_words(transport, me, _C.EPOCH_OFFSET, _C.MAX_BLOCKS)
    for pid in range(nblocks):
        e = (epochs[pid] + 1) & 0xFFFFFFFF
        slot = pid * _C.MAX_RANKS + me
        for q in range(transport.world_size):
            if q == me:
                continue
            desc = _C.DESC_OFFSET + ((e & 1) * _C.MAX_BLOCKS * _C.MAX_RANKS + slot) * _C.DESC_BYTES
            region_words(transport, q, desc, 2, ctypes.c_uint64)[:] = [nbytes, e | kind << 32]
            # After the descriptor: x86 keeps stores in order, as the kernel's release does.
            region_words(transport, q, _C.START_FLAGS_OFFSET + 4 * slot, 1)[0] = e


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
@pytest.mark.quick
@pytest.mark.parametrize("world,nblocks", [(2, 3), (3, 1), (4, 2)])
def test_bitwise_equal_to_reference_cpu_backend_and_peers(world, nblocks):
    results = run_ranks(reduce_back_to_back, world, nblocks, 7 + world, timeout=240, env=ENV)
    failures = [f"rank {r}: {f}" for r, (fails, _) in enumerate(results) for f in fails]
    assert not failures, "\n".join(failures[:20])
    digests = [d for _, d in results]
    for r in range(1, world):
        assert digests[r] == digests[0], f"rank {r}'s results differ from rank 0's"


# ---- two-shot ownership (protocol.h chunk_owner_rank, chunk_block) ---------------

SHARES_MAX_BYTES = 1 << 20  # 256 chunks: room for nblocks * W + 1 at nblocks 32, W 4


def share_sizes(world, nblocks):
    """numel of each call: around the boundaries of one group (W chunks) and of
    one round of groups over the programs (nblocks * W chunks); each count of
    chunks whole, and with a partial tail as its last chunk."""
    chunk = chunk_elems(torch.float32)
    counts = sorted({1, world - 1, world, world + 1, nblocks * world - 1, nblocks * world + 1} - {0})
    return [n * chunk - tail for n in counts for tail in (0, 3)]


def reduced_chunks(rank, world, nblocks):
    """Makes a two-shot call of each share_sizes size and returns, per call,
    the chunks this rank reduced, read from its own staging buffer of that
    call (data[e % 2]): an owned chunk holds the sum, any other still this
    rank's input copy. The inputs are positive, so the two always differ."""
    from pyallreduce import _C
    from pyallreduce import triton_kernels as tk
    from pyallreduce.transport import HostShmTransport

    chunk = chunk_elems(torch.float32)
    t = HostShmTransport(dist.group.WORLD, SHARES_MAX_BYTES)
    reduced = []
    try:
        for numel in share_sizes(world, nblocks):
            xs = [(torch.arange(numel) % 5 + q + 1).float() for q in range(world)]
            want = sum(xs)
            out = torch.empty(numel)
            tk.all_reduce(xs[rank], out, t.regions, rank, world, SHARES_MAX_BYTES, nblocks, _C.TWO_SHOT, False,
                          TIMEOUT_S)
            assert torch.equal(out, want), f"numel {numel}: wrong result"
            e = region_words(t, rank, _C.EPOCH_OFFSET, 1)[0]  # every program's epoch: all made the same calls
            staging = region_words(t, rank, _C.DATA_OFFSET + (e & 1) * SHARES_MAX_BYTES, numel, ctypes.c_float)
            staged = torch.frombuffer(staging, dtype=torch.float32).clone()
            mine = []
            for c in range(-(-numel // chunk)):
                part = slice(c * chunk, (c + 1) * chunk)
                if torch.equal(staged[part], want[part]):
                    mine.append(c)
                else:
                    assert torch.equal(staged[part], xs[rank][part]), \
                        f"numel {numel}: chunk {c} of the staging buffer is neither the sum nor the input"
            reduced.append(mine)
    finally:
        t.close()
    return reduced


# Several programs matter: owners by program rounds (rank (c / nblocks) % W,
# the mapping before issue 13 item 4) balance only at nblocks 1, and give rank
# 0 every chunk of a call below nblocks chunks. nblocks 8 has calls of W + 1
# chunks (more than a group, fewer than the programs) for W 3, as the default
# grid (32) has, at a quarter of its interpreter time (W 4 at nblocks 8 took
# 30 s of CI's 2 cores and adds no case the others lack).
@pytest.mark.quick
@pytest.mark.parametrize("world,nblocks", [(2, 3), (3, 1), (3, 8), (4, 3)])
def test_two_shot_spreads_the_reduction_evenly_over_the_ranks(world, nblocks):
    results = run_ranks(reduced_chunks, world, nblocks, timeout=300, env=ENV)
    chunk = chunk_elems(torch.float32)
    for i, numel in enumerate(share_sizes(world, nblocks)):
        nchunks = -(-numel // chunk)
        mine = [results[r][i] for r in range(world)]
        what = f"{nchunks} chunks (numel {numel}), W={world}, nblocks={nblocks}: reduced per rank {mine}"
        assert sorted(c for cs in mine for c in cs) == list(range(nchunks)), f"{what}: each chunk once"
        assert all(len(cs) in (nchunks // world, -(-nchunks // world)) for cs in mine), f"{what}: unbalanced"


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
        with pytest.raises(TypeError, match="is not reduced by pyallreduce"):
            ints = torch.zeros(4, dtype=torch.int32)
            tk.all_reduce(ints, ints, *args, _C.ONE_SHOT, False, short)
        with pytest.raises(ValueError, match="unknown algorithm"):
            tk.all_reduce(x, out, *args, 7, False, short)
        with pytest.raises(ValueError, match="out overlaps the input"):  # programs would read what others wrote
            buf = torch.ones(2000)
            tk.all_reduce(buf[:1000], buf[500:1500], *args, _C.ONE_SHOT, False, short)

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
        tk.release(t.regions, "cpu")  # as Communicator.close(): a deadline stays recorded until then
        t.close()

    # Mid barrier: the epochs above are out of step now, so a fresh transport.
    # Rank 1 arrives at the start barrier of a two-shot call, with its
    # descriptor, and never at the mid barrier (a kernel cannot be stopped
    # half way, so the test plays rank 1's part of the protocol).
    t = HostShmTransport(dist.group.WORLD, MAX_BYTES)
    try:
        args = (t.regions, rank, world, MAX_BYTES, nblocks)
        if rank == 1:
            arrive_at_start(t, nblocks, x.nbytes, kernel_kind(x, _C.TWO_SHOT))
        else:
            expect_deadline(lambda: tk.all_reduce(x, out, *args, _C.TWO_SHOT, False, short), "mid", "1", short)
        dist.barrier()
    finally:
        tk.release(t.regions, "cpu")  # as Communicator.close(): a deadline stays recorded until then
        t.close()


def test_deadline_names_the_missing_rank():
    run_ranks(deadline_and_checks, 3, timeout=120, env=ENV)


# ---- the epoch wrap (protocol.h: a call without a mid barrier refreshes the mid flags) ----

def make_comm(**kw):
    import pyallreduce

    kw.setdefault("max_bytes", 1 << 20)
    kw.setdefault("timeout", TIMEOUT_S)
    return pyallreduce.Communicator(backend="triton", device="cpu", **kw)


def set_counters(transport, nblocks, epoch, mid):
    """Sets this rank's own counters to the state a long history leaves: every
    program's epoch and every start flag `epoch`, every mid flag `mid`."""
    from pyallreduce import _C

    me, world = transport.rank, transport.world_size
    dist.barrier()  # nobody is inside a call while the counters change
    region_words(transport, me, _C.EPOCH_OFFSET, nblocks)[:] = [epoch] * nblocks
    for pid in range(nblocks):
        for offset, value in ((_C.START_FLAGS_OFFSET, epoch), (_C.MID_FLAGS_OFFSET, mid)):
            region_words(transport, me, offset + 4 * pid * _C.MAX_RANKS, world)[:] = [value] * world
    dist.barrier()


def across_the_wrap(rank, world, start_epoch, mid):
    """Calls crossing the 32-bit wrap from a given history: every result exact.
    Then, from a history with zeroed mid flags, the deterministic form of the
    wrap bug: after one one-shot call, the last rank arrives at a two-shot
    call's start barrier (at e = 0xFFFFFFFF or 0) and never at its mid
    barrier; the others must wait there until the deadline, not pass on a
    stale mid flag and return a result."""
    from pyallreduce import _C
    from pyallreduce import triton_kernels as tk

    comm = make_comm()
    set_counters(comm._engine.transport, comm.nblocks, start_epoch, mid)
    # One-shot first (the only kind that ran "before"), then two-shot calls
    # across the wrap: a mid barrier passed early would gather a peer's chunks
    # before it reduced them, if the scheduler lets it get there first (the
    # interpreter seldom does; the part below does not depend on it).
    numel = 16000
    wrong = 0
    for i, algo in enumerate(["one_shot", "two_shot", "two_shot", "one_shot", "two_shot", "two_shot"]):
        got = comm.all_reduce(exact_input(numel, rank, torch.float32, salt=i), algo=algo)
        wrong += int((got != exact_sum(numel, world, torch.float32, salt=i)).sum())
    if mid == 0:
        assert (start_epoch + 2) & 0xFFFFFFFF in (0xFFFFFFFF, 0), "the two-shot call below must meet a stale 0"
        set_counters(comm._engine.transport, comm.nblocks, start_epoch, mid)
        x = exact_input(3000, rank, torch.float32)
        comm.all_reduce(x, algo="one_shot")  # e = start_epoch + 1: stores its mid flags (the fix)
        dist.barrier()
        if rank == world - 1:
            arrive_at_start(comm._engine.transport, comm.nblocks, x.nbytes, kernel_kind(x, _C.TWO_SHOT))
        else:
            short = 2.0
            args = (comm._engine.transport.regions, rank, world, comm.max_bytes, comm.nblocks)
            expect_deadline(lambda: tk.all_reduce(x, torch.empty_like(x), *args, _C.TWO_SHOT, False, short),
                            "mid", str(world - 1), short)
        dist.barrier()
    comm.close()
    return wrong


@pytest.mark.parametrize("world,start_epoch,mid", [
    # ~2^32 one-shot calls of the old protocol (mid flags still zeroed), then
    # the first two-shot calls at e = 0xFFFFFFFF and e = 0, where 0 counts as reached.
    (2, 0xFFFFFFFD, 0),
    (3, 0xFFFFFFFE, 0),
    (2, 0xFFFFFFFA, 0xFFFFFFFA),  # what the fixed protocol leaves: every call refreshed its mid flags
])
def test_calls_across_the_32_bit_epoch_wrap_are_exact(world, start_epoch, mid):
    assert run_ranks(across_the_wrap, world, start_epoch, mid, timeout=240, env=ENV) == [0] * world


# ---- agreement (protocol.h CallDesc) ----------------------------------------------

SENTINEL = -7.0


def descriptor(spec, e):
    """(bytes, epoch, kind) that a rank making call `spec` publishes at epoch e."""
    from pyallreduce import _C

    numel, dtype, op, algo, in_place = spec
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if dtype not in DTYPES or numel == 0:
        mode, algo_id = (_C.MODE_FALLBACK if numel else _C.MODE_STAGED), _C.AGREE_ONLY
    else:
        mode, algo_id = _C.MODE_STAGED, {"one_shot": _C.ONE_SHOT, "two_shot": _C.TWO_SHOT}[algo]
    return nbytes, e, _C.desc_kind(_C.dtype_code(dtype), algo_id, mode, op == "avg", in_place)


def disagree(rank, world, cases):
    """Runs each mismatched call, then a matching call (exact), on one
    communicator whose epochs start near the wrap. Returns the messages."""
    from pyallreduce import _C

    comm = make_comm()
    start_near_wrap(comm._engine.transport, comm.nblocks, NEAR_WRAP)
    messages = []
    for i, case in enumerate(cases):
        agreed, odd = MISMATCHED_CALLS[case]
        spec = odd if rank == world - 1 else agreed
        numel, dtype, op, algo, in_place = spec
        x = exact_input(numel, rank, dtype, salt=i)
        out = x if in_place else torch.full((numel,), SENTINEL, dtype=dtype)
        with pytest.raises(RuntimeError) as raised:
            if in_place:
                comm.all_reduce_(x, op=op, algo=algo)
            else:
                comm.all_reduce(x, op=op, algo=algo, out=out)
        message = str(raised.value)
        # Nothing was written: not the output, not an in-place input.
        assert torch.equal(x, exact_input(numel, rank, dtype, salt=i)), f"{case}: the input changed"
        if not in_place:
            assert bool((out == SENTINEL).all()), f"{case}: the output was written"
        # Every call, a mismatched one included, uses one epoch; the first is NEAR_WRAP + 1.
        call = 2 * i + 1
        e = (NEAR_WRAP + call) & 0xFFFFFFFF
        want = _C.mismatch_message(call, e, [descriptor(odd if q == world - 1 else agreed, e) for q in range(world)])
        assert message == want, f"{case}:\n{message}\n--- expected:\n{want}"
        # The communicator is still usable: the next matching call is exact.
        algo = ("one_shot", "two_shot")[i % 2]
        assert torch.equal(comm.all_reduce(exact_input(3000, rank, torch.float32), algo=algo),
                           exact_sum(3000, world, torch.float32)), f"{case}: the next call is not exact"
        messages.append(message)
    # Agreement rounds that agree pass, and so does the call after them.
    comm.all_reduce(torch.ones(10, dtype=torch.float64))
    comm.all_reduce(torch.empty(0))
    assert torch.equal(comm.all_reduce(exact_input(500, rank, torch.float16)), exact_sum(500, world, torch.float16))
    comm.close()
    return messages


@pytest.mark.quick
@pytest.mark.parametrize("world,cases", [(2, sorted(MISMATCHED_CALLS)), (3, ["algo", "fallback_vs_two_shot"])])
def test_ranks_that_disagree_all_raise_the_same_error_and_nothing_is_written(world, cases):
    messages = run_ranks(disagree, world, cases, timeout=300, env=ENV)
    for r in range(1, world):
        assert messages[r] == messages[0], f"rank {r} raised differently"


def agree_direct(rank, world):
    """triton_kernels.agree and all_reduce without the communicator: a matching
    agreement round passes; one against a kernel call raises CallMismatch on both."""
    from pyallreduce import _C
    from pyallreduce import triton_kernels as tk
    from pyallreduce.transport import HostShmTransport

    t = HostShmTransport(dist.group.WORLD, MAX_BYTES)
    try:
        f32 = _C.dtype_code(torch.float32)
        tk.agree(f32, 400, _C.MODE_FALLBACK, False, False, t.regions, rank, world, 2, TIMEOUT_S, "cpu", call=1)
        x = exact_input(100, rank, torch.float32)
        out = torch.full_like(x, SENTINEL)
        with pytest.raises(tk.CallMismatch, match="collective call 2 ") as raised:
            if rank == 0:
                tk.agree(f32, 400, _C.MODE_FALLBACK, False, False, t.regions, rank, world, 2, TIMEOUT_S, "cpu", call=2)
            else:
                tk.all_reduce(x, out, t.regions, rank, world, MAX_BYTES, 2, _C.ONE_SHOT, False, TIMEOUT_S, call=2)
        assert bool((out == SENTINEL).all())
        tk.all_reduce(x, out, t.regions, rank, world, MAX_BYTES, 2, _C.TWO_SHOT, False, TIMEOUT_S, call=3)
        assert torch.equal(out, exact_sum(100, world, torch.float32))
    finally:
        t.close()
    return str(raised.value)


def test_agreement_round_against_a_kernel_call_raises_on_both():
    messages = run_ranks(agree_direct, 2, timeout=120, env=ENV)
    assert messages[0] == messages[1]
    assert "rank 0: 400 bytes, Float, sum, agreement only, torch.distributed fallback" in messages[0], messages[0]
    assert "rank 1: 400 bytes, Float, sum, one_shot, staged" in messages[0], messages[0]


# ---- reduce-scatter and all-gather (protocol.h kReduceScatter, kAllGather) ----------

GATHER_DTYPES = (torch.float32, torch.int64, torch.float16, torch.uint8, torch.bool)  # words of 4, 8, 2, 1 bytes


def segment_sizes(dtype):
    """numel of one segment: tiny, a chunk and a bit, three chunks and a bit.
    The last still fits W = 4 segments at their 16 KiB strides in MAX_BYTES."""
    chunk = chunk_elems(dtype)
    return (1, chunk + 3, 3 * chunk + 5)


def segment_plan(seed):
    """Every rank builds the same shuffled list of calls for one set of
    regions, each (kind, dtype, segment numel, average, in place, exact, key):
    a reduce-scatter ("rs") of each dtype and size, sums of exact inputs and
    averages of random ones, in place (out = segment `rank` of the input) and
    not; an all-reduce ("ar") of each reduce-scatter's inputs (same key), by
    one-shot and two-shot in turn; an all-gather ("ag") of each gather dtype
    and size, in place (input = segment `rank` of out) and not."""
    plan = []
    for d, dtype in enumerate(DTYPES):
        n1, n2, n3 = segment_sizes(dtype)
        for n, average, in_place in ((n1, False, d == 1), (n2, True, True), (n3, False, d != 1), (n3, True, False)):
            key = len(plan)
            plan.append(("rs", dtype, n, average, in_place, not average, key))
            plan.append(("ar", dtype, n, average, False, not average, key))
    for d, dtype in enumerate(GATHER_DTYPES):
        for j, n in enumerate(segment_sizes(dtype)):
            plan.append(("ag", dtype, n, False, (d + j) % 2 == 1, True, len(plan)))
    random.Random(seed).shuffle(plan)
    return plan


def segment_inputs(kind, dtype, n, exact, key, world):
    """Every rank's input of a plan entry (the same on every rank)."""
    if kind != "ag":
        if exact:
            return [exact_input(world * n, q, dtype, salt=key) for q in range(world)]
        return [random_input(world * n, q, dtype, seed=key) for q in range(world)]
    g = torch.Generator().manual_seed(key)
    if dtype.is_floating_point:
        return [torch.randn(n, generator=g).to(dtype) for _ in range(world)]
    if dtype == torch.bool:
        return [torch.randint(0, 2, (n,), generator=g).bool() for _ in range(world)]
    info = torch.iinfo(dtype)
    return [torch.randint(info.min, info.max, (n,), generator=g, dtype=dtype) for _ in range(world)]


def as_bytes(t):
    return t.contiguous().view(-1).view(torch.uint8)


def segments_back_to_back(rank, world, nblocks, seed):
    """Runs the plan back to back on one set of regions (counters near the
    wrap), with random per-rank delays, mutating inputs and outputs right after
    each call; then checks every result. Returns the failures, the
    reduce-scatter and all-reduce results by key and digests of the gathers."""
    from pyallreduce import triton_kernels as tk
    from pyallreduce.transport import HostShmTransport

    plan = segment_plan(seed)
    inputs = {key: segment_inputs(kind, dtype, n, exact, key, world)
              for kind, dtype, n, _, _, exact, key in plan if kind != "ar"}
    delays = random.Random(seed * 100 + rank)  # differs per rank
    results = []
    t = HostShmTransport(dist.group.WORLD, MAX_BYTES)
    try:
        start_near_wrap(t, nblocks, NEAR_WRAP)
        args = (t.regions, rank, world, MAX_BYTES, nblocks)
        for i, (kind, dtype, n, average, in_place, _, key) in enumerate(plan):
            x = inputs[key][rank].clone()
            mine = slice(rank * n, (rank + 1) * n)
            if delays.random() < 0.3:
                time.sleep(delays.random() * 0.02)
            if kind == "ar":
                out = torch.full_like(x, 77)
                tk.all_reduce(x, out, *args, i % 2, average, TIMEOUT_S)
            elif kind == "rs":
                out = x[mine] if in_place else torch.full((n,), 77, dtype=dtype)
                tk.reduce_scatter(x, out, *args, average, TIMEOUT_S)
            else:
                out = torch.full((world * n,), 77, dtype=dtype)
                if in_place:
                    out[mine] = x
                    x = out[mine]
                tk.all_gather(x, out, *args, TIMEOUT_S)
            results.append(out.clone())
            # The caller owns its buffers again at once: peers read the staging copy.
            x.fill_(100)
            out.fill_(-100 if dtype.is_signed else 0)
    finally:
        t.close()

    failures, reduced, gathered = [], {}, []
    all_reduced = {key: got for (kind, *_, key), got in zip(plan, results) if kind == "ar"}
    for i, ((kind, dtype, n, average, in_place, exact, key), got) in enumerate(zip(plan, results)):
        what = f"call {i}: {kind} segment numel={n} {dtype} average={average} in_place={in_place}"
        if kind == "ag":
            if not torch.equal(as_bytes(got), as_bytes(torch.cat(inputs[key]))):
                failures.append(f"{what}: not every rank's input in rank order")
            gathered.append(hashlib.sha1(as_bytes(got).numpy().tobytes()).hexdigest())
            continue
        xs = inputs[key]
        part = slice(rank * n, (rank + 1) * n) if kind == "rs" else slice(None)
        want = fp32_reduction([x[part] for x in xs], average)
        if not torch.equal(bits(got), bits(want)):
            bad = (bits(got) != bits(want)).nonzero().flatten()[:5].tolist()
            failures.append(f"{what}: differs from the fp32 rank-order sum at {bad}")
        if exact and not torch.equal(got.double(), exact_sum(world * n, world, torch.float64, salt=key)[part]):
            failures.append(f"{what}: not the exact sum")
        if kind == "rs":
            reduced[key] = got
            if not torch.equal(bits(got), bits(all_reduced[key][part])):
                failures.append(f"{what}: differs from this rank's segment of the all-reduce")
    return failures, reduced, all_reduced, gathered


# nblocks 1: a rank can run a whole call ahead of a peer that still reads (see
# above). W = 3 with 3 programs: segments (2 or 4 chunks) cut the groups of 3
# chunks, which go round-robin over the programs.
@pytest.mark.parametrize("world,nblocks", [(2, 1), (3, 3), (4, 1)])
def test_reduce_scatter_and_all_gather_between_all_reduces_are_bitwise_exact(world, nblocks):
    results = run_ranks(segments_back_to_back, world, nblocks, 5 + world, timeout=300, env=ENV)
    failures = [f"rank {r}: {f}" for r, (fails, *_) in enumerate(results) for f in fails]
    assert not failures, "\n".join(failures[:20])
    _, _, all_reduced, gathered = results[0]
    for r in range(1, world):
        assert results[r][3] == gathered, f"rank {r}'s all-gathers differ from rank 0's"
    # Across ranks: rank r's reduce-scatter is segment r of every rank's all-reduce.
    for key in all_reduced:
        segments = torch.cat([results[r][1][key] for r in range(world)])
        for r in range(world):
            assert torch.equal(bits(segments), bits(results[r][2][key])), \
                f"plan key {key}: the ranks' reduce-scatters differ from rank {r}'s all-reduce"


def expect_mismatch(fn, call, e, descs):
    """fn must raise CallMismatch with the message every rank builds from the
    ranks' descriptors (bytes, epoch, kind) of call `call` at epoch e."""
    from pyallreduce import _C
    from pyallreduce import triton_kernels as tk

    with pytest.raises(tk.CallMismatch) as raised:
        fn()
    want = _C.mismatch_message(call, e, descs)
    assert str(raised.value) == want, f"{raised.value}\n--- expected:\n{want}"
    return want


def segments_refused_and_mismatched(rank, world):
    """W = 3. Refusals first (checked before any signalling, so they cost no
    epoch); then calls where the ranks disagree, each followed by a matching
    call that must be exact: every rank raises the same CallMismatch and
    nothing is written. Returns the messages."""
    from pyallreduce import _C
    from pyallreduce import triton_kernels as tk
    from pyallreduce.transport import HostShmTransport

    assert world == 3
    nblocks, n, f32 = 2, 1000, torch.float32
    t = HostShmTransport(dist.group.WORLD, MAX_BYTES)
    messages = []
    try:
        args = (t.regions, rank, world, MAX_BYTES, nblocks)
        others = (rank + 1) % world
        # 3 segments of 16388 bytes: 49164 bytes of input, but at 24576-byte strides.
        with pytest.raises(ValueError, match=r"16388-byte segments stages 3 x 24576 bytes .* 73728 in all, .*"
                                             r"\(max_bytes=65536\); the caller chunks"):
            tk.reduce_scatter(torch.ones(3 * 4097), torch.empty(4097), *args, False, TIMEOUT_S)
        with pytest.raises(ValueError, match=r"all_gather of 65544 bytes per rank exceeds the staging buffer"):
            tk.all_gather(torch.ones(8193, dtype=torch.int64), torch.empty(3 * 8193, dtype=torch.int64), *args,
                          TIMEOUT_S)
        x = torch.ones(world * n)
        base = torch.ones(world * n + 1)
        for out, inp, fn in ((x[others * n:(others + 1) * n], x, tk.reduce_scatter),
                             (base[rank * n + 1:(rank + 1) * n + 1], base[:world * n], tk.reduce_scatter),
                             (x, x[others * n:(others + 1) * n], tk.all_gather),
                             (base[:world * n], base[rank * n + 1:(rank + 1) * n + 1], tk.all_gather)):
            what = "reduce_scatter" if fn is tk.reduce_scatter else "all_gather"
            extra = (False,) if fn is tk.reduce_scatter else ()
            with pytest.raises(ValueError, match=rf"input and out of {what} overlap; pass separate tensors, or as "
                                                 rf"(out|input) exactly this rank's segment"):
                fn(inp, out, *args, *extra, TIMEOUT_S)
        with pytest.raises(ValueError, match=r"input.numel\(\) == world size \(3\) x out.numel\(\), got 3001 and 1000"):
            tk.reduce_scatter(torch.ones(world * n + 1), torch.empty(n), *args, False, TIMEOUT_S)
        with pytest.raises(TypeError, match="is not reduced by pyallreduce"):
            tk.reduce_scatter(torch.ones(world * n, dtype=torch.int32), torch.empty(n, dtype=torch.int32), *args,
                              False, TIMEOUT_S)
        with pytest.raises(ValueError, match="one dtype and device"):
            tk.all_gather(torch.ones(n), torch.empty(world * n, dtype=torch.int32), *args, TIMEOUT_S)

        start_near_wrap(t, nblocks, NEAR_WRAP)
        calls = 0

        def kind(dtype, algo, average=False, in_place=False, mode=_C.MODE_STAGED):
            return _C.desc_kind(_C.dtype_code(dtype), algo, mode, average, in_place)

        def next_call():
            nonlocal calls
            calls += 1
            return calls, (NEAR_WRAP + calls) & 0xFFFFFFFF

        def matching_call_is_exact():
            call, _ = next_call()
            x = exact_input(world * n, rank, f32, salt=call)
            out = torch.empty(n)
            tk.reduce_scatter(x, out, *args, False, TIMEOUT_S, call=call)
            assert torch.equal(out, exact_sum(world * n, world, f32, salt=call)[rank * n:(rank + 1) * n])

        # The same bytes (W * n floats) as reduce-scatter, all-reduce and all-gather.
        call, e = next_call()
        x = exact_input(world * n, rank, f32)
        sentinel = torch.full((world * n,), SENTINEL)
        out = sentinel.clone()
        fns = [lambda: tk.reduce_scatter(x, out[:n], *args, False, TIMEOUT_S, call=call),
               lambda: tk.all_reduce(x, out, *args, _C.ONE_SHOT, False, TIMEOUT_S, call=call),
               lambda: tk.all_gather(x[:n], out, *args, TIMEOUT_S, call=call)]
        algos = [_C.REDUCE_SCATTER, _C.ONE_SHOT, _C.ALL_GATHER]
        messages.append(expect_mismatch(fns[rank], call, e, [(world * n * 4, e, kind(f32, a)) for a in algos]))
        assert torch.equal(out, sentinel) and torch.equal(x, exact_input(world * n, rank, f32)), "written"
        matching_call_is_exact()

        # In place on rank 0 only (out = its segment of the input).
        call, e = next_call()
        out = torch.full((n,), SENTINEL)
        fn = lambda: tk.reduce_scatter(x, x[:n] if rank == 0 else out, *args, True, TIMEOUT_S, call=call)  # noqa: E731
        descs = [(world * n * 4, e, kind(f32, _C.REDUCE_SCATTER, True, q == 0)) for q in range(world)]
        messages.append(expect_mismatch(fn, call, e, descs))
        assert torch.equal(x, exact_input(world * n, rank, f32)) and bool((out == SENTINEL).all()), "written"
        matching_call_is_exact()

        # All-gathers of the same bytes that differ in dtype only: a byte copy still pairs only equal calls.
        call, e = next_call()
        dtype = torch.int64 if rank == 0 else torch.float64
        out = torch.zeros(world * n, dtype=dtype)
        fn = lambda: tk.all_gather(torch.ones(n, dtype=dtype), out, *args, TIMEOUT_S, call=call)  # noqa: E731
        descs = [(world * n * 8, e, kind(torch.int64 if q == 0 else torch.float64, _C.ALL_GATHER))
                 for q in range(world)]
        messages.append(expect_mismatch(fn, call, e, descs))
        assert not bool(out.any()), "written"
        call, _ = next_call()
        out = torch.zeros(world * n, dtype=torch.int64)
        tk.all_gather(torch.full((n,), rank + 1, dtype=torch.int64), out, *args, TIMEOUT_S, call=call)
        assert torch.equal(out, torch.arange(1, world + 1).repeat_interleave(n))

        # Agreement rounds (torch.distributed fallbacks) of reduce-scatter and all-gather.
        f64, fallback = _C.dtype_code(torch.float64), _C.MODE_FALLBACK
        call, _ = next_call()
        tk.agree(f64, 800, fallback, False, False, *args[:3], nblocks, TIMEOUT_S, "cpu", call=call,
                 algo=_C.REDUCE_SCATTER)
        call, e = next_call()
        algo = _C.REDUCE_SCATTER if rank == 0 else _C.ALL_GATHER
        fn = lambda: tk.agree(f64, 800, fallback, False, False, *args[:3], nblocks, TIMEOUT_S, "cpu",  # noqa: E731
                              call=call, algo=algo)
        descs = [(800, e, kind(torch.float64, _C.REDUCE_SCATTER if q == 0 else _C.ALL_GATHER, mode=fallback))
                 for q in range(world)]
        messages.append(expect_mismatch(fn, call, e, descs))
        # A fallback reduce-scatter against a kernel one.
        call, e = next_call()
        out = torch.full((n,), SENTINEL)
        if rank == 0:
            fn = lambda: tk.agree(_C.dtype_code(f32), world * n * 4, fallback, False, False,  # noqa: E731
                                  *args[:3], nblocks, TIMEOUT_S, "cpu", call=call, algo=_C.REDUCE_SCATTER)
        else:
            fn = lambda: tk.reduce_scatter(x, out, *args, False, TIMEOUT_S, call=call)  # noqa: E731
        descs = [(world * n * 4, e, kind(f32, _C.REDUCE_SCATTER, mode=fallback if q == 0 else _C.MODE_STAGED))
                 for q in range(world)]
        messages.append(expect_mismatch(fn, call, e, descs))
        assert bool((out == SENTINEL).all()), "written"
        matching_call_is_exact()
    finally:
        t.close()
    return messages


def test_reduce_scatter_and_all_gather_refuse_bad_calls_and_raise_on_every_rank_when_calls_differ():
    messages = run_ranks(segments_refused_and_mismatched, 3, timeout=240, env=ENV)
    assert messages[1] == messages[0] and messages[2] == messages[0], "the ranks raised differently"
    assert "rank 0: 12000 bytes, Float, sum, reduce_scatter, staged" in messages[0][0], messages[0][0]
    assert "rank 2: 12000 bytes, Float, sum, all_gather, staged" in messages[0][0], messages[0][0]


def mismatches_counted_until_the_host_looks(rank, world):
    """On a GPU the host raises a recorded mismatch only after later launches
    (triton_kernels.status.raise_recorded after the next call's launch): the record
    must keep every mismatched call. The launches here go straight to the
    kernel with nothing read between them, as a GPU's asynchronous launches
    do: a mismatch, a matching call, a mismatch; then the host looks."""
    from pyallreduce import _C
    from pyallreduce import triton_kernels as tk
    from pyallreduce.transport import HostShmTransport
    from pyallreduce.triton_kernels import one_shot, signal

    f32, nblocks, n = torch.float32, 2, 1000
    t = HostShmTransport(dist.group.WORLD, MAX_BYTES)
    try:
        regions_t, status, record = tk.prepare(t.regions, "cpu")
        kind = _C.desc_kind(_C.dtype_code(f32), _C.ONE_SHOT, _C.MODE_STAGED, False, False)

        def launch(numel, call):
            x = exact_input(numel, rank, f32, salt=call)
            out = torch.full((numel,), SENTINEL)
            one_shot.launch(x, out, regions_t, status, rank, world, MAX_BYTES, nblocks, False, int(TIMEOUT_S * 1e9),
                            x.nbytes, kind, call)
            return out

        odd = n + (rank == world - 1)  # the last rank's call is one element longer
        assert bool((launch(odd, 1) == SENTINEL).all()), "a mismatched call wrote its output"
        assert torch.equal(launch(n, 2), exact_sum(n, world, f32, salt=2)), "the matching call between"
        assert bool((launch(odd, 3) == SENTINEL).all()), "a mismatched call wrote its output"
        with pytest.raises(tk.CallMismatch) as raised:
            tk.status.raise_recorded(status, record, rank, world, TIMEOUT_S, torch.device("cpu"))
        # Every call uses one epoch, from 1: the record keeps the first mismatch's descriptors.
        descs = [(4 * (n + (q == world - 1)), 1, kind) for q in range(world)]
        want = _C.mismatch_message(1, 1, descs, 2, 3)
        assert str(raised.value) == want, f"{raised.value}\n--- expected:\n{want}"
        assert int(status[tk.status.STATUS_CODE.value]) == 0 and int(status[tk.status.STATUS_MISMATCHES.value]) == 0 \
            and int(status[tk.status.STATUS_GENERATION.value]) == 2, "the record was not cleared once raised"
        x = exact_input(n, rank, f32, salt=4)  # the communicator is still usable
        tk.all_reduce(x, x, t.regions, rank, world, MAX_BYTES, nblocks, _C.TWO_SHOT, False, TIMEOUT_S, call=4)
        assert torch.equal(x, exact_sum(n, world, f32, salt=4)), "the call after the mismatches is not exact"
        return str(raised.value)
    finally:
        tk.release(t.regions, "cpu")
        t.close()


@pytest.mark.quick
def test_every_mismatched_call_is_counted_until_the_host_looks():
    messages = run_ranks(mismatches_counted_until_the_host_looks, 2, timeout=120, env=ENV)
    assert messages[1] == messages[0], "the ranks raised differently"
    assert "1 later call too, up to call 3" in messages[0], messages[0]


def deadline_at_every_round_of_a_wait(rank, world):
    """signal.wait_peers with the clocks replaced: the peer arrives after round
    `arrive` of the wait, and its program's lanes see the deadline pass in
    different rounds (half from round `late`, half one round later), for every
    combination. The program must leave the wait once, in one round, with one
    answer: arrived if any round saw the peer no later than the first late
    lane, else a deadline, recorded as such."""
    import triton.language as tl
    from triton_wait_kernel import wait_kernel

    from pyallreduce import triton_kernels as tk
    from pyallreduce.triton_kernels import signal

    start, timeout = 10**12, 1000
    deadline = start + timeout
    real = signal.clock_ns, signal.lane_clock_ns
    failures = []
    try:
        for arrive in (0, 1, 2, 3, None):
            for late in range(5):
                flags = torch.zeros(signal.MAX_RANKS.value, dtype=torch.int32)
                flags[0] = 1  # this rank (0) at epoch 1; the peer (1) not yet
                rounds = []

                def lane_clock(lanes, flags=flags, rounds=rounds, arrive=arrive, late=late):
                    r = len(rounds)
                    rounds.append(r)
                    if r == arrive:
                        flags[1] = 1  # after this round's load: seen from the next round on
                    late_from = tl.where(tl.arange(0, signal.VOTE_LANES) < signal.VOTE_LANES // 2, late, late + 1)
                    return tl.where(late_from <= r, deadline + 1, deadline - 1).to(tl.int64)

                signal.clock_ns = lambda: tl.full((), start, tl.int64)
                signal.lane_clock_ns = lane_clock
                status = torch.zeros(tk.status.STATUS_WORDS, dtype=torch.int32)
                tk.status.new_generation(status, 1)  # as prepare() makes it
                out = torch.full((1,), -1, dtype=torch.int32)
                regions = torch.tensor([flags.data_ptr(), 0, 0], dtype=torch.int64)  # own, (peer), claim word
                wait_kernel[(1,)](regions, status, out, timeout, WORLD_SIZE=2)
                seen = None if arrive is None else arrive + 1  # the first round whose load sees the peer
                arrived = seen is not None and seen <= late
                want_rounds = seen + 1 if arrived else late + 1
                what = f"peer after round {arrive}, first late lanes in round {late}"
                if int(out[0]) != int(arrived) or len(rounds) != want_rounds:
                    failures.append(f"{what}: returned {int(out[0])} after {len(rounds)} rounds, "
                                    f"want {int(arrived)} after {want_rounds}")
                code, missing = int(status[tk.status.STATUS_CODE.value]), int(status[tk.status.STATUS_MISSING.value])
                if (code, missing) != ((0, 0) if arrived else (tk.status.CODE_DEADLINE.value, 0b10)):
                    failures.append(f"{what}: record code {code}, missing {missing:#b}")
    finally:
        signal.clock_ns, signal.lane_clock_ns = real
    return failures


@pytest.mark.quick
def test_a_wait_decides_once_per_program_at_every_round_the_deadline_can_fall_in():
    [failures] = run_ranks(deadline_at_every_round_of_a_wait, 1, timeout=120, env=ENV)
    assert not failures, "\n".join(failures)


def setup_failing_on_one_rank(rank, world):
    """The Triton tables cannot be made on rank 1 (on a GPU: out of memory):
    every rank raises at construction and unmaps together, instead of rank 0
    waiting in its first call for a rank that never comes; the next
    communicator works."""
    import pyallreduce.triton_kernels as tk

    real = tk.prepare

    def out_of_memory(regions, device):
        raise torch.OutOfMemoryError("injected: no memory for the region table")

    tk.prepare = out_of_memory if rank == 1 else real
    try:
        with pytest.raises(RuntimeError, match="setting up the communicator failed on rank 1: injected: no memory"):
            make_comm()
    finally:
        tk.prepare = real
    assert not own_segments_mapped(), "the failed communicator's segments stay mapped"
    with make_comm() as comm:
        assert torch.equal(comm.all_reduce(torch.ones(5)), torch.full((5,), float(world)))


def test_a_setup_failing_on_one_rank_fails_on_every_rank():
    run_ranks(setup_failing_on_one_rank, 2, timeout=120, env=ENV)


def aborted_beside_a_waiting_kernel(rank, world):
    """abort() from a watchdog thread while this rank's interpreted kernel
    waits for a peer that never calls: the kernel gives up at its next round,
    not at its 300 s deadline, and the call raises that the communicator was
    aborted, naming the missing rank. The kernel runs on the calling thread
    and reads the regions, so abort waits for it before unmapping them
    (pulling them from under it killed the rank with a segfault); then
    nothing stays mapped and a new communicator works."""
    comm = make_comm(timeout=300)
    x = torch.ones(64)
    assert torch.equal(comm.all_reduce(x), torch.full((64,), float(world)))
    if rank == 0:
        raises_when_a_watchdog_aborts(comm, lambda: comm.all_reduce(x),
                                      r"collective call 2 on this communicator was aborted \(Communicator\.abort\(\).*\) "
                                      r"while rank 0's Triton program \d+ waited in the start barrier for rank\(s\) 1; "
                                      r"create a new Communicator")
    dist.barrier()  # rank 1 never made the call
    if rank == 1:
        comm.abort()
    assert not own_segments_mapped(), "a segment stays mapped after abort()"
    with make_comm() as fresh:
        assert torch.equal(fresh.all_reduce(x), torch.full((64,), float(world)))


def test_abort_ends_an_interpreted_kernel_waiting_for_a_peer():
    run_ranks(aborted_beside_a_waiting_kernel, 2, timeout=120, env=ENV)


def _capture_check_of_the_calls_device(rank, world_size):
    """prepare() asks whether the current stream of the call's device is being
    captured, not the current device's (a call on cuda:1 while cuda:0 is
    current): through engines.stream_capturing, the check the CUDA engine uses."""
    from pyallreduce import triton_kernels

    asked = []

    def capturing(device):
        asked.append(device)
        return True

    triton_kernels.stream_capturing = capturing
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        triton_kernels.prepare([4096, 8192], torch.device("cuda", 1))
    assert asked == [torch.device("cuda", 1)]


def test_capture_checks_ask_about_the_calls_device():
    run_ranks(_capture_check_of_the_calls_device, 1, env=ENV)
