"""Reduce-scatter and all-gather on the CPU backend (Communicator.reduce_scatter,
Communicator.all_gather): exact bits against the fixed rank-order reference
and against all_reduce, every dtype, sizes around the round and staging
boundaries, the one overlap allowed (this rank's segment of the larger
tensor), views, mixed sequences, and ranks that disagree."""
import pytest
import torch

from launch import run_ranks
from reference import DTYPES, fp32_reduction, random_input, triton_kernels_unusable

MAX_BYTES = 64 << 10  # small: rounds (max_bytes / W per segment here), merged or not, are then several
TIMEOUT = 240


def make_comm(**kw):
    import pyallreduce

    kw.setdefault("max_bytes", MAX_BYTES)
    kw.setdefault("timeout", 30)
    return pyallreduce.Communicator(**kw)


def segment_sizes(dtype, world):
    """Elements per segment: tiny, off every 64-byte boundary, and across the
    default round (a piece of 256 KiB / W per segment) and max_bytes."""
    elem = torch.empty((), dtype=dtype).element_size()
    piece = (256 << 10) // world // elem
    return sorted({1, 3, 17, 1000, piece - 1, piece + 5, 3 * piece + 7, MAX_BYTES // elem + 9})


def every_input(numel, world, dtype, salt):
    return [random_input(numel, q, dtype, seed=salt) for q in range(world)]


def check_reduce_scatter_bits(rank, world):
    failures = []
    with make_comm() as comm:
        for dtype in DTYPES:
            for seg in segment_sizes(dtype, world):
                inputs = every_input(world * seg, world, dtype, salt=seg)
                for op in ("sum", "avg"):
                    want = fp32_reduction(inputs, op == "avg")[rank * seg:(rank + 1) * seg]
                    got = comm.reduce_scatter(inputs[rank], op=op)
                    if not torch.equal(got, want) or got.shape != (seg,):
                        failures.append((dtype, seg, op, "out of place"))
                    # The same bits as all_reduce's segment, on every algorithm.
                    for algo in ("one_shot", "two_shot"):
                        reduced = comm.all_reduce(inputs[rank], op=op, algo=algo)[rank * seg:(rank + 1) * seg]
                        if not torch.equal(reduced, got):
                            failures.append((dtype, seg, op, f"differs from all_reduce {algo}"))
                    # out = this rank's own segment of the input (the overlap protocol.h allows)
                    x = inputs[rank].clone()
                    mine = x[rank * seg:(rank + 1) * seg]
                    if comm.reduce_scatter(x, op=op, out=mine) is not mine or not torch.equal(mine, want):
                        failures.append((dtype, seg, op, "out is own segment"))
    assert not failures, f"rank {rank}: {failures[:8]}"


@pytest.mark.quick
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_reduce_scatter_exact_bits_every_dtype_and_size(world):
    run_ranks(check_reduce_scatter_bits, world, timeout=TIMEOUT)


def check_all_gather(rank, world):
    failures = []
    with make_comm() as comm:
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool):
            for seg in segment_sizes(torch.float32 if dtype == torch.bool else dtype, world):
                every = [random_input(seg, q, torch.float32, seed=seg).to(dtype) for q in range(world)]
                want = torch.cat(every)
                got = comm.all_gather(every[rank])
                if not torch.equal(got, want):
                    failures.append((dtype, seg, "out of place"))
                out = torch.full((world * seg,), 3, dtype=torch.float32).to(dtype)
                mine = out[rank * seg:(rank + 1) * seg]
                mine.copy_(every[rank])  # the input is this rank's segment of out (FSDP2's layout)
                if comm.all_gather(mine, out=out) is not out or not torch.equal(out, want):
                    failures.append((dtype, seg, "input is own segment"))
        # 2-d: concatenated along dim 0, as all_gather_into_tensor does
        x = torch.arange(6, dtype=torch.float32).view(2, 3) + 100 * rank
        got = comm.all_gather(x)
        if got.shape != (2 * world, 3) or not torch.equal(got, torch.cat([x - 100 * rank + 100 * q
                                                                           for q in range(world)])):
            failures.append(("2-d", tuple(got.shape)))
    assert not failures, f"rank {rank}: {failures[:8]}"


@pytest.mark.quick
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_all_gather_exact_every_dtype_and_size(world):
    run_ranks(check_all_gather, world, timeout=TIMEOUT)


def check_views_and_mixed_sequences(rank, world):
    with make_comm() as comm:
        seg = 5000
        inputs = every_input(world * seg, world, torch.float32, salt=7)
        want = fp32_reduction(inputs, False)
        for step in range(20):  # every kind back to back: staging buffers reused across kinds
            kind = step % 3
            if kind == 0:
                assert torch.equal(comm.all_reduce(inputs[rank], algo="two_shot"), want)
            elif kind == 1:
                assert torch.equal(comm.reduce_scatter(inputs[rank]), want[rank * seg:(rank + 1) * seg])
            else:
                assert torch.equal(comm.all_gather(want[rank * seg:(rank + 1) * seg]), want)
        # Non-contiguous input and out: reduced through contiguous copies.
        grid = inputs[rank].view(world * 50, seg // 50).t()  # columns: not contiguous
        got = torch.empty(seg // 50, world * 50).t()[: world * 50 // world]
        comm.reduce_scatter(grid.t().contiguous().t(), out=got)
        ref = fp32_reduction([i.view(world * 50, seg // 50).t().contiguous() for i in inputs], False)
        assert torch.equal(got, ref.view(-1)[rank * seg:(rank + 1) * seg].view(got.shape))
        # Shapes: (d0 // W, ...) when d0 divides, else flat.
        assert comm.reduce_scatter(torch.ones(world * 2, 3)).shape == (2, 3)
        assert comm.reduce_scatter(torch.ones(world + 1, world * 2)).shape == ((world + 1) * 2,)
        # Empty tensors: an agreement round, nothing else.
        assert comm.reduce_scatter(torch.ones(0)).numel() == 0
        assert comm.all_gather(torch.ones(0)).numel() == 0
        # A dtype the kernels do not reduce goes to torch.distributed (gloo); all-gather copies any dtype itself.
        x = torch.arange(world * 4, dtype=torch.float64) * (rank + 1)
        assert torch.equal(comm.reduce_scatter(x), (torch.arange(world * 4, dtype=torch.float64)
                                                    * sum(range(1, world + 1)))[rank * 4:(rank + 1) * 4])
        # Refused with what to do.
        with pytest.raises(ValueError, match="multiple of the world size"):
            comm.reduce_scatter(torch.ones(world * 3 + 1))
        with pytest.raises(ValueError, match="expected"):
            comm.all_gather(torch.ones(4), out=torch.ones(4 * world + 1))


@pytest.mark.quick
@pytest.mark.parametrize("world", [2, 3])
def test_views_mixed_sequences_fallbacks_and_errors(world):
    run_ranks(check_views_and_mixed_sequences, world, timeout=TIMEOUT)


def gather_into_own_segment(comm):
    out = torch.ones(400 * comm.world_size)
    return comm.all_gather(out[400 * comm.rank:400 * (comm.rank + 1)], out=out)


def check_disagreeing_ranks(rank, world):
    """Each case: what every rank calls, and what the last rank calls instead.
    Every rank must raise the mismatch, and the next matching call succeed."""
    f32 = torch.float32
    cases = {
        "reduce_scatter vs all_reduce": (lambda c: c.reduce_scatter(torch.ones(800)),
                                         lambda c: c.all_reduce(torch.ones(800), algo="one_shot")),
        "reduce_scatter vs all_gather": (lambda c: c.reduce_scatter(torch.ones(800)),
                                         lambda c: c.all_gather(torch.ones(800 // world))),
        "all_gather size": (lambda c: c.all_gather(torch.ones(100)), lambda c: c.all_gather(torch.ones(101))),
        "reduce_scatter op": (lambda c: c.reduce_scatter(torch.ones(800), op="avg"),
                              lambda c: c.reduce_scatter(torch.ones(800))),
        "reduce_scatter fallback dtype vs kernel": (lambda c: c.reduce_scatter(torch.ones(800, dtype=torch.float64)),
                                                    lambda c: c.reduce_scatter(torch.ones(1600, dtype=f32))),
        "all_gather own segment vs separate": (lambda c: c.all_gather(torch.ones(400)), gather_into_own_segment),
    }
    failures = []
    with make_comm() as comm:
        for name, (common, odd) in cases.items():
            call = odd if rank == world - 1 else common
            try:
                call(comm)
                failures.append((name, "did not raise"))
            except RuntimeError as e:
                if "disagree" not in str(e):
                    failures.append((name, str(e)[:200]))
            seg = comm.reduce_scatter(torch.full((world * 10,), float(rank)))
            if not torch.equal(seg, torch.full((10,), float(sum(range(world))))):
                failures.append((name, "next call wrong"))
    assert not failures, f"rank {rank}: {failures}"


def test_ranks_that_disagree_all_raise_and_continue():
    run_ranks(check_disagreeing_ranks, 2, timeout=TIMEOUT)


def test_no_shared_memory_left():
    from pyallreduce.transport.host_shm import leaked_segments

    run_ranks(check_views_and_mixed_sequences, 2, timeout=TIMEOUT)
    assert not leaked_segments()


def check_gpu_chunking_on_triton(rank, world):
    """The GPU backends stage whole calls: the communicator splits larger ones
    into pieces of every segment. The Triton backend under the interpreter is
    the one that runs this path without a GPU."""
    import pyallreduce

    max_bytes = 4 * 8192  # a reduce-scatter piece: 2 segment units at 2 ranks
    with pyallreduce.Communicator(device="cpu", backend="triton", nblocks=2, max_bytes=max_bytes,
                                  timeout=60) as comm:
        for dtype, seg in ((torch.float32, 5000), (torch.bfloat16, 9000)):  # 16 KiB pieces: 1.2 and 1.1 of them
            inputs = every_input(world * seg, world, dtype, salt=seg)
            want = fp32_reduction(inputs, True)[rank * seg:(rank + 1) * seg]
            assert torch.equal(comm.reduce_scatter(inputs[rank], op="avg"), want), dtype
            x = inputs[rank].clone()
            mine = x[rank * seg:(rank + 1) * seg]
            comm.reduce_scatter(x, op="avg", out=mine)
            assert torch.equal(mine, want), f"{dtype}: out is own segment"
        seg = 20000  # all-gather pieces: max_bytes of the segment, 2.4 of them
        every = [torch.arange(seg, dtype=torch.float32) * (q + 1) for q in range(world)]
        assert torch.equal(comm.all_gather(every[rank]), torch.cat(every))
        out = torch.zeros(world * seg)
        out[rank * seg:(rank + 1) * seg] = every[rank]
        comm.all_gather(out[rank * seg:(rank + 1) * seg], out=out)
        assert torch.equal(out, torch.cat(every))


def test_gpu_backends_split_calls_larger_than_staging():
    if (why := triton_kernels_unusable(interpret=True)) is not None:
        pytest.skip(why)
    run_ranks(check_gpu_chunking_on_triton, 2, env={"TRITON_INTERPRET": "1"}, timeout=TIMEOUT)
