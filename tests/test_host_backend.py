"""The CPU backend over shared memory: exact sums, bitwise agreement, every
size class (tails, both sides of the crossover and of max_bytes), in-place and
out-of-place, back-to-back calls with random per-rank delays."""
import ctypes
import random
import time

import pytest
import torch
import torch.distributed as dist

from launch import run_ranks
from reference import DTYPES, exact_input, exact_sum, fp32_reduction, random_input, tolerance

MAX_BYTES = 64 << 10  # small, so chunking runs at small sizes
ALGOS = ("one_shot", "two_shot", "auto")


def sizes_for(dtype):
    """Element counts around every boundary the kernels have."""
    elem = torch.empty((), dtype=dtype).element_size()
    chunk = 4096 // elem  # two-shot ownership unit
    per_call = MAX_BYTES // elem
    return sorted({1, 2, 3, 7, 31, 257, chunk - 1, chunk, chunk + 1, 3 * chunk + 5,
                   per_call - 1, per_call, per_call + 1, 2 * per_call + 3})


def make_comm(**kw):
    import pyallreduce

    kw.setdefault("max_bytes", MAX_BYTES)
    kw.setdefault("timeout", 30)
    return pyallreduce.Communicator(**kw)


def check_exact_sums(rank, world):
    failures = []
    with make_comm() as comm:
        for dtype in DTYPES:
            for numel in sizes_for(dtype):
                for algo in ALGOS:
                    want = exact_sum(numel, world, dtype, salt=numel)
                    x = exact_input(numel, rank, dtype, salt=numel)
                    got = comm.all_reduce(x, algo=algo)
                    if not torch.equal(got, want):
                        failures.append(("out-of-place", dtype, numel, algo))
                    # The caller may reuse its input at once: peers read the staging copy.
                    x.fill_(1000)
                    y = exact_input(numel, rank, dtype, salt=numel)
                    if comm.all_reduce_(y, algo=algo) is not y or not torch.equal(y, want):
                        failures.append(("in-place", dtype, numel, algo))
                    out = torch.full_like(y, 77)
                    comm.all_reduce(exact_input(numel, rank, dtype, salt=numel), algo=algo, out=out)
                    if not torch.equal(out, want):
                        failures.append(("out=", dtype, numel, algo))
    assert not failures, f"rank {rank}: wrong results for {failures[:10]}"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_exact_sums_every_size_dtype_algo(world):
    run_ranks(check_exact_sums, world, timeout=240)


def check_exact_sums_small(rank, world):
    with make_comm() as comm:
        for dtype in DTYPES:
            for numel in (1, 1023, 4099, 3 * (MAX_BYTES // 4) + 1):
                for algo in ("one_shot", "two_shot"):
                    got = comm.all_reduce(exact_input(numel, rank, dtype), algo=algo)
                    assert torch.equal(got, exact_sum(numel, world, dtype)), (dtype, numel, algo)


def test_exact_sums_eight_ranks():
    run_ranks(check_exact_sums_small, 8, timeout=240)


# What policy.host_round_bytes answers on rank 0 and on the other ranks (a
# hybrid CPU's cores differ): every rank must run rank 0's rounds, or the
# others wait for rounds rank 0 never runs.
ROUND_ANSWERS = (512 << 10, 256 << 10)


def check_several_rounds(rank, world):
    """Messages of several protocol rounds, with partial last rounds, in one call."""
    from pyallreduce import _C, policy

    answer = ROUND_ANSWERS[min(rank, 1)]
    policy.host_round_bytes = lambda: answer  # this process only
    round_bytes = ROUND_ANSWERS[0]
    with make_comm(max_bytes=4 * round_bytes) as comm:
        # Rank 0's rounds, by the epochs a call of 3 rounds and a bit takes (one: merged after contention).
        epoch = ctypes.c_uint32.from_address(comm._engine.transport.regions[rank] + _C.EPOCH_OFFSET)
        before = epoch.value
        comm.all_reduce(torch.ones(3 * round_bytes // 4 + 1))
        assert epoch.value - before in (1, 4), f"{epoch.value - before} rounds, not rank 0's 4"
        for dtype in (torch.float32, torch.bfloat16):
            elem = torch.empty((), dtype=dtype).element_size()
            per_round = round_bytes // elem
            for numel in (per_round - 1, per_round + 1, 3 * per_round + 7):
                for algo in ("one_shot", "two_shot"):
                    want = exact_sum(numel, world, dtype, salt=numel)
                    got = comm.all_reduce(exact_input(numel, rank, dtype, salt=numel), algo=algo)
                    assert torch.equal(got, want), (dtype, numel, algo)
                    y = exact_input(numel, rank, dtype, salt=numel)
                    assert torch.equal(comm.all_reduce_(y, algo=algo, op="avg"),
                                       (want.float() / world).to(dtype)), (dtype, numel, algo)


@pytest.mark.parametrize("world", [2, 3])
def test_messages_of_several_rounds(world):
    run_ranks(check_several_rounds, world, timeout=240)


def check_rounds_of_any_size(rank, world):
    """Rounds far smaller than staging, as _C.set_round_bytes allows: every
    collective exact across their boundaries; a size that is no multiple of
    the alignment refused."""
    from pyallreduce import _C

    with make_comm() as comm:
        _C.set_round_bytes(comm._engine.handle, _C.ALIGNMENT)
        per_round = _C.ALIGNMENT // 4
        for numel in (per_round + 1, 5 * per_round + 3):
            for algo in ("one_shot", "two_shot"):
                got = comm.all_reduce(exact_input(numel, rank, torch.float32, salt=numel), algo=algo)
                assert torch.equal(got, exact_sum(numel, world, torch.float32, salt=numel)), (numel, algo)
        segments = exact_input(world * 3 * per_round, rank, torch.float32)
        total = exact_sum(world * 3 * per_round, world, torch.float32)
        assert torch.equal(comm.reduce_scatter(segments), total.chunk(world)[rank])
        assert torch.equal(comm.all_gather(total.chunk(world)[rank]), total)
        with pytest.raises(RuntimeError, match=f"round_bytes must be a positive multiple of {_C.ALIGNMENT}, got 1000"):
            _C.set_round_bytes(comm._engine.handle, 1000)
        with pytest.raises(RuntimeError, match="set_round_bytes after the communicator's first call"):
            _C.set_round_bytes(comm._engine.handle, _C.ALIGNMENT)


def test_rounds_of_any_size():
    run_ranks(check_rounds_of_any_size, 2, timeout=240)


def average_and_random(rank, world):
    results = []
    with make_comm() as comm:
        for dtype in DTYPES:
            for numel in (5, 1000, 40000):
                inputs = [random_input(numel, q, dtype, seed=numel) for q in range(world)]
                for algo in ("one_shot", "two_shot"):
                    s = comm.all_reduce(inputs[rank], algo=algo)
                    a = comm.all_reduce(inputs[rank], op="avg", algo=algo)
                    # The definition, bit for bit: fp32 sum in rank order, / W, one cast.
                    assert torch.equal(s, fp32_reduction(inputs, False)), (dtype, numel, algo)
                    assert torch.equal(a, fp32_reduction(inputs, True)), (dtype, numel, algo)
                    ref = sum(x.double() for x in inputs)
                    torch.testing.assert_close(s.double(), ref, **tolerance(dtype, world))
                    results.append(s)
        # ReduceOp values work as drop-in replacements for the strings.
        x = random_input(100, rank, torch.float32, seed=1)
        assert torch.equal(comm.all_reduce(x, op=dist.ReduceOp.AVG), comm.all_reduce(x, op="avg"))
    return torch.cat([r.float() for r in results])


BEST_ISA_ENV = "PYALLREDUCE_TEST_BEST_CPU_ISA"


def cpu_isas():
    """The ISA levels of the reduction kernels this CPU can run (PYALLREDUCE_CPU_ISA).
    The best is asked of a fresh process (this one's _C may have been loaded
    with PYALLREDUCE_CPU_ISA set), once: the answer stays in the environment,
    which the ranks inherit. (Every rank imports this module again; asking in
    each cost 2 s of CPU per rank.)"""
    import os
    import subprocess
    import sys

    best = os.environ.get(BEST_ISA_ENV)
    if best is None:
        best = subprocess.run([sys.executable, "-c", "import pyallreduce._C as C; print(C.cpu_isa())"],
                              capture_output=True, text=True, check=True, env=clean_isa_env()).stdout.strip()
        os.environ[BEST_ISA_ENV] = best
    levels = ["generic", "avx2", "avx512"]
    return levels[:levels.index(best) + 1]


def clean_isa_env():
    import os

    return {k: v for k, v in os.environ.items() if k != "PYALLREDUCE_CPU_ISA"}


def isa_and_exact_sums(rank, world, isa):
    import pyallreduce._C as C

    assert C.cpu_isa() == isa
    check_exact_sums(rank, world)
    # Averages and random floats: the same bits as the fp32 rank-order definition.
    average_and_random(rank, world)


@pytest.mark.parametrize("isa", cpu_isas())
def test_every_isa_kernel_gives_the_same_exact_bits(isa):
    run_ranks(isa_and_exact_sums, 3, isa, env={"PYALLREDUCE_CPU_ISA": isa}, timeout=240)


def refuse_isa(rank, world):
    import os

    if rank == 1:  # one rank alone: the others must not wait for it in the construction
        os.environ["PYALLREDUCE_CPU_ISA"] = "sse9"
    with pytest.raises(RuntimeError, match="rank 1: pyallreduce: PYALLREDUCE_CPU_ISA=sse9: this CPU supports up to"):
        make_comm()


def test_an_unknown_isa_on_one_rank_is_refused_on_every_rank_with_the_choices():
    run_ranks(refuse_isa, 2, timeout=60)


@pytest.mark.quick
@pytest.mark.parametrize("world", [2, 3])
def test_random_inputs_bitwise_identical_on_all_ranks(world):
    outs = run_ranks(average_and_random, world, timeout=180)
    for q in range(1, world):
        assert torch.equal(outs[0], outs[q]), f"rank {q} differs from rank 0"


def back_to_back(rank, world, calls):
    plan = random.Random(1234)  # every rank draws the same sequence of calls
    delays = random.Random(rank)  # but sleeps differently
    with make_comm() as comm:
        for i in range(calls):
            dtype = plan.choice(DTYPES)
            numel = plan.choice([1, 13, 600, 2048, 5000, 20000, 70000])
            algo = plan.choice(ALGOS)
            inplace = plan.random() < 0.5
            if delays.random() < 0.2:
                time.sleep(delays.random() * 0.002)
            x = exact_input(numel, rank, dtype, salt=i)
            if inplace:
                got = comm.all_reduce_(x, algo=algo)
            else:
                got = comm.all_reduce(x, algo=algo)
                x.fill_(-3)  # the caller reuses its input at once
            want = exact_sum(numel, world, dtype, salt=i)
            assert torch.equal(got, want), f"call {i}: {dtype} {numel} {algo} inplace={inplace}"


@pytest.mark.parametrize("world", [2, 4])
def test_back_to_back_calls_with_random_delays(world):
    run_ranks(back_to_back, world, 250, timeout=240)


def odd_layouts(rank, world):
    with make_comm() as comm:
        base = exact_input(6 * 10, rank, torch.float32).view(6, 10)
        want = exact_sum(6 * 10, world, torch.float32).view(6, 10)
        # Non-contiguous input, out and in-place target.
        t = base.t()
        assert torch.equal(comm.all_reduce(t), want.t())
        out = torch.empty(6, 10).t()
        comm.all_reduce(base.t(), out=out)
        assert torch.equal(out, want.t())
        tt = base.clone().t()
        comm.all_reduce_(tt)
        assert torch.equal(tt, want.t())
        # A view with a storage offset: only the view changes.
        storage = exact_input(100, rank, torch.float32)
        view = storage[10:30]
        comm.all_reduce_(view)
        assert torch.equal(view, exact_sum(100, world, torch.float32)[10:30])
        assert torch.equal(storage[:10], exact_input(100, rank, torch.float32)[:10])
        # 0-dim and empty tensors.
        scalar = torch.tensor(float(rank + 1))
        assert comm.all_reduce(scalar).shape == () and comm.all_reduce(scalar).item() == sum(range(1, world + 1))
        empty = torch.empty(0, 3)
        assert comm.all_reduce(empty).shape == (0, 3)
        # Tensors that require grad: the collective runs outside autograd.
        w = torch.ones(4, requires_grad=True)
        r = comm.all_reduce(w)
        assert not r.requires_grad and torch.equal(r, torch.full((4,), float(world)))
        comm.all_reduce_(w)
        assert w.requires_grad and torch.equal(w.detach(), torch.full((4,), float(world)))


@pytest.mark.quick
def test_non_contiguous_views_scalars_empty_and_grad():
    run_ranks(odd_layouts, 2, timeout=120)


def special_values(rank, world):
    with make_comm() as comm:
        x = torch.tensor([1.0, float("nan"), float("inf"), float("inf") if rank == 0 else -float("inf"), 60000.0])
        for dtype in DTYPES:
            got = comm.all_reduce(x.to(dtype))
            assert torch.isnan(got[1]), dtype  # NaN in, NaN out
            assert got[2] == float("inf"), dtype
            assert torch.isnan(got[3]), dtype  # inf + -inf
            if dtype == torch.float16:
                assert got[4] == float("inf")  # 120000 overflows fp16, like NCCL's
        # The same values as the reference collective (gloo), NaNs in the same places.
        ref = x.clone()
        dist.all_reduce(ref)
        torch.testing.assert_close(comm.all_reduce(x), ref, rtol=0, atol=0, equal_nan=True)


def special_values_in_every_lane(rank, world):
    """NaN, Inf, Inf - Inf and fp16 overflow in the vector lanes and the scalar
    tail of the fp16/bf16/fp32 kernels (8-lane blocks, then a tail): values equal
    to the definition (fp32 sum in rank order, / W, one cast), and a NaN input
    gives the same NaN bits in a vector lane as in the tail."""
    n = 8 * 5 + 3  # element 41 is in the tail of a one-shot call and of rank 1's two-shot slice

    def make(q):
        x = exact_input(n, q, torch.float32)
        specials = {1: float("nan"), 9: float("inf"), 10: float("inf") if q == 0 else -float("inf"),
                    17: 60000.0, 41: float("nan"), 42: 60000.0}
        for i, v in specials.items():
            x[i] = v
        return x

    with make_comm() as comm:
        for dtype in DTYPES:
            inputs = [make(q).to(dtype) for q in range(world)]
            for op in ("sum", "avg"):
                for algo in ("one_shot", "two_shot"):
                    got = comm.all_reduce(inputs[rank], op=op, algo=algo)
                    want = fp32_reduction(inputs, op == "avg")
                    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True,
                                               msg=lambda m: f"{dtype} {op} {algo}: {m}")
                    bits = got.view(torch.int16 if dtype != torch.float32 else torch.int32)
                    assert bits[1] == bits[41], (dtype, op, algo, bits[[1, 41]])  # a lane and the tail


def test_special_values_in_vector_lanes_and_tails():
    run_ranks(special_values_in_every_lane, 2, timeout=120)


def test_nan_inf_and_fp16_overflow_match_nccl_semantics():
    run_ranks(special_values, 2, timeout=120)


def fallbacks(rank, world):
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("pyallreduce").addHandler(handler)
    with make_comm() as comm:
        for dtype in (torch.int64, torch.float64, torch.int32):
            x = torch.arange(10, dtype=dtype) + rank
            want = torch.arange(10, dtype=dtype) * world + sum(range(world))
            assert torch.equal(comm.all_reduce(x), want), dtype
        assert torch.equal(comm.all_reduce(torch.full((3,), 2.0, dtype=torch.float64), op="avg"),
                           torch.full((3,), 2.0, dtype=torch.float64))
        # Integer avg as NCCL's ncclAvg: the sum divided, truncated toward zero.
        for dtype in (torch.int64, torch.int32):
            x = torch.tensor([3, -3, 4], dtype=dtype) + rank
            want = (torch.tensor([3, -3, 4], dtype=dtype) * world + sum(range(world))) \
                .div(world, rounding_mode="trunc")
            assert torch.equal(comm.all_reduce(x, op="avg"), want), dtype
        try:
            comm.all_reduce(torch.ones(3, dtype=torch.bool), op="avg")
            raise AssertionError("avg of bool must be refused")
        except ValueError as e:
            assert "op='sum'" in str(e)
    messages = [r.getMessage() for r in records]
    assert any("torch.int64 is not reduced by pyallreduce" in m for m in messages), messages
    assert sum("torch.int64" in m for m in messages) == 1, "the reason is logged once"


def test_unsupported_dtypes_fall_back_to_torch_distributed_with_one_log_line():
    run_ranks(fallbacks, 2, timeout=120)


def simulated_hosts(rank, world):
    import os

    os.environ["PYALLREDUCE_HOSTNAME"] = f"host{rank // 2}"
    with make_comm() as comm:
        assert comm.fallback_reason == "the group spans 2 hosts"
        x = exact_input(1000, rank, torch.float32)
        assert torch.equal(comm.all_reduce(x, op="sum"), exact_sum(1000, world, torch.float32))


def test_group_spanning_hosts_falls_back():
    run_ranks(simulated_hosts, 4, timeout=120)


def two_communicators(rank, world):
    import pyallreduce

    sub = dist.new_group([0, 1])  # collective: every rank creates it
    with make_comm() as a, make_comm() as b:
        c = make_comm(group=sub) if rank < 2 else None
        for i in range(50):
            for comm, w in ((a, world), (c, 2), (b, world)):
                if comm is None:
                    continue
                x = exact_input(3000 + i, rank, torch.bfloat16, salt=i)
                assert torch.equal(comm.all_reduce(x, algo="two_shot" if i % 2 else "one_shot"),
                                   exact_sum(3000 + i, w, torch.bfloat16, salt=i))
        if c is not None:
            c.close()
    assert isinstance(a, pyallreduce.Communicator)


def test_communicators_used_alternately_stay_correct():
    run_ranks(two_communicators, 3, timeout=120)
