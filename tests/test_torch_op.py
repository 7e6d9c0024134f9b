"""torch integration: the custom op schemas pass opcheck, and a function that
calls Communicator.all_reduce compiles with fullgraph=True."""
import pytest
import torch

from launch import run_ranks
from reference import exact_input, exact_sum


def make_comm():
    import pyallreduce

    return pyallreduce.Communicator(max_bytes=64 << 10, timeout=60)


def opcheck_ops(rank, world):
    comm = make_comm()
    h = comm._engine.handle
    for dtype in (torch.float32, torch.bfloat16):
        x = exact_input(300, rank, dtype)
        torch.library.opcheck(torch.ops.pyallreduce.all_reduce.default, (x, h, 0, False))
        torch.library.opcheck(torch.ops.pyallreduce.all_reduce_out.default, (x, torch.empty_like(x), h, 1, True))
        torch.library.opcheck(torch.ops.pyallreduce.all_reduce_.default, (x.clone(), h, 0, False))
        whole = exact_input(300 * world, rank, dtype)
        torch.library.opcheck(torch.ops.pyallreduce.reduce_scatter_out.default, (whole, torch.empty_like(x), h, True))
        torch.library.opcheck(torch.ops.pyallreduce.all_gather_out.default, (x, torch.empty_like(whole), h))
    comm.close()


@pytest.mark.quick
@pytest.mark.parametrize("world", [1, 2])
def test_opcheck(world):
    run_ranks(opcheck_ops, world, timeout=180)


def compiled(rank, world, backend):
    comm = make_comm()

    def step(x, y):
        s = comm.all_reduce(x * 2, op="sum")
        comm.all_reduce_(y, op="avg")
        return s + 1, y

    fn = torch.compile(step, fullgraph=True, backend=backend)
    for i in range(3):
        x = exact_input(1000 + i, rank, torch.float32, salt=i)
        y = exact_input(1000 + i, rank, torch.float32, salt=i + 1)
        s, y2 = fn(x, y.clone())
        assert torch.equal(s, exact_sum(1000 + i, world, torch.float32, salt=i) * 2 + 1)
        assert torch.equal(y2, exact_sum(1000 + i, world, torch.float32, salt=i + 1) / world)
    # Larger than max_bytes: the chunk loop is traced too.
    big = exact_input(40000, rank, torch.float32)
    s, _ = fn(big, big.clone())
    assert torch.equal(s, exact_sum(40000, world, torch.float32) * 2 + 1)
    comm.close()


@pytest.mark.quick
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend):
    run_ranks(compiled, 2, backend, timeout=400)


def compiled_fallback_dtypes(rank, world):
    """Dtypes the kernels do not take go to torch.distributed; that path traces too."""
    comm = make_comm()

    def step(x, y):
        s = comm.all_reduce(x, op="sum")
        comm.all_reduce_(y, op="avg")
        return s + 1, y

    fn = torch.compile(step, fullgraph=True, backend="aot_eager")
    for i in range(2):
        x = exact_input(100 + i, rank, torch.int64, salt=i)
        y = exact_input(100 + i, rank, torch.float64, salt=i)
        s, y2 = fn(x, y.clone())
        assert torch.equal(s, exact_sum(100 + i, world, torch.int64, salt=i) + 1)
        assert torch.equal(y2, exact_sum(100 + i, world, torch.float64, salt=i) / world)
    comm.close()


def test_torch_compile_fullgraph_with_fallback_dtypes():
    run_ranks(compiled_fallback_dtypes, 2, timeout=400)


def seen_by_dispatch_modes(rank, world):
    """Eager calls skip the dispatcher (pyallreduce/eager.py); a dispatch mode
    (here a recording one; FakeTensorMode and make_fx are others) must still
    see the op, and the result must be the same."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    comm = make_comm()
    x = exact_input(300, rank, torch.float32)
    with Recorder() as rec:
        y = comm.all_reduce(x)
        comm.all_reduce_(x)
    assert "pyallreduce.all_reduce_out.default" in rec.ops and "pyallreduce.all_reduce_.default" in rec.ops, rec.ops
    assert torch.equal(y, exact_sum(300, world, torch.float32)) and torch.equal(x, y)
    # The profiler is no dispatch mode: eager calls take the direct path and must
    # still show up under the op's names.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        comm.all_reduce(x)
        comm.all_reduce_(x)
    names = {e.name for e in prof.events()}
    assert {"pyallreduce::all_reduce_out", "pyallreduce::all_reduce_"} <= names, sorted(names)
    comm.close()


def test_dispatch_modes_and_the_profiler_see_the_op():
    run_ranks(seen_by_dispatch_modes, 2, timeout=120)


def compiled_dynamic_shapes(rank, world):
    """torch.compile(dynamic=True, fullgraph=True): sizes that change between
    calls, every dtype the ops accept (the kernels' and the fallback's), sum
    and avg, reduce-scatter and all-gather; every result exact."""
    comm = make_comm()

    def step(x):
        total = comm.all_reduce(x, op="sum")
        mean = comm.all_reduce(x, op="avg")
        segment = comm.reduce_scatter(x, op="sum")
        return total, mean, segment, comm.all_gather(segment)

    fn = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64):
        for k in (500, 777, 1234):
            n = world * k
            total, mean, segment, gathered = fn(exact_input(n, rank, dtype, salt=k))
            want = exact_sum(n, world, dtype, salt=k)
            assert torch.equal(total, want), (dtype, n)
            want_mean = ((want.double() / world).to(dtype) if dtype.is_floating_point
                         else torch.div(want, world, rounding_mode="trunc"))  # integers: NCCL's avg, truncated
            assert torch.equal(mean, want_mean), (dtype, n)
            assert torch.equal(segment, want[rank * k:(rank + 1) * k]), (dtype, n)
            assert torch.equal(gathered, want), (dtype, n)
    comm.close()


def test_torch_compile_with_dynamic_shapes_every_dtype_and_op():
    run_ranks(compiled_dynamic_shapes, 2, timeout=600)


def compiled_in_a_loop(rank, world):
    """A compiled step called more often than Dynamo's recompile limit (8), as
    a training loop does: compiled once, never again (the communicator's call
    counter once made every call recompile, and the ninth fail)."""
    import torch._dynamo

    comm = make_comm()

    def step(x):
        total = comm.all_reduce(x, op="sum")
        comm.all_reduce_(x, op="avg")
        return total, comm.all_gather(comm.reduce_scatter(total, op="sum"))

    fn = torch.compile(step, fullgraph=True, backend="aot_eager")
    n = world * 700
    fn(exact_input(n, rank, torch.float32))
    torch._dynamo.config.error_on_recompile = True
    config = torch._dynamo.config
    limit = getattr(config, "recompile_limit", None) or config.cache_size_limit  # its name in older torch
    for i in range(2 * limit):
        x = exact_input(n, rank, torch.float32, salt=i)
        total, gathered = fn(x)
        want = exact_sum(n, world, torch.float32, salt=i)
        assert torch.equal(total, want) and torch.equal(x, want / world) and torch.equal(gathered, want * world), i
    comm.close()


@pytest.mark.quick
def test_a_compiled_step_in_a_loop_compiles_once():
    run_ranks(compiled_in_a_loop, 2, timeout=400)


def eager_callable_declines_what_it_does_not_decide(rank, world):
    """The eager all-reduce callable (_C.eager_all_reduce) runs the calls it
    can decide whole and returns None, having done nothing, for every other;
    the Communicator's general path then gives the same exact result."""
    import torch.distributed as dist

    comm = make_comm()
    call = comm._eager.all_reduce
    want = exact_sum(300, world, torch.float32)
    x = exact_input(300, rank, torch.float32)
    out = torch.full_like(x, -1.0)
    assert call(x, out, "sum", "auto") is out and torch.equal(out, want)
    fresh = call(x, None, "sum", "one_shot")
    assert fresh is not None and fresh is not x and torch.equal(fresh, want)
    average = call(x, None, "avg", "two_shot")
    assert torch.equal(average, (want / world))
    run_time_str = "".join(["s", "u", "m"])  # not the interned literal: compared, not identified
    assert torch.equal(call(x, None, run_time_str, "auto"), want)

    class Sub(torch.Tensor):
        pass

    untouched = torch.full_like(x, -1.0)
    declined = [
        (x.as_subclass(Sub), None, "sum", "auto"),  # a subclass sees the op
        (x, untouched, dist.ReduceOp.SUM, "auto"),  # not a str: the general path parses it
        (x, untouched, "max", "auto"),
        (x, untouched, "sum", "three_shot"),
        (x.double(), None, "sum", "auto"),  # a dtype the kernels do not reduce
        (x, torch.empty(299), "sum", "auto"),  # out of another size
        (x[::2], None, "sum", "auto"),  # not contiguous
    ]
    for args in declined:
        assert call(*args) is None, args
    assert call(x, untouched, "sum") is None and call(x, untouched, "sum", algo="auto") is None  # not 4 positionals
    assert torch.equal(untouched, torch.full_like(x, -1.0)), "a declined call wrote its output"
    # What it declines, the Communicator still serves, with the same result on every rank.
    assert torch.equal(comm.all_reduce(x, op=dist.ReduceOp.SUM), want)
    assert torch.equal(comm.all_reduce(x[::2].contiguous()), want[::2])
    with pytest.raises(ValueError, match="op must be 'sum' or 'avg'"):
        comm.all_reduce(x, op="max")
    comm.close()
    assert comm._eager.all_reduce(x, None, "sum", "auto") is None  # closed: declines (the general path raises)


@pytest.mark.quick
def test_the_eager_callable_runs_what_it_decides_and_declines_the_rest():
    run_ranks(eager_callable_declines_what_it_does_not_decide, 2, timeout=120)
