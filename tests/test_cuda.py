"""The CUDA backend on a GPU: several processes share ONE GPU through CUDA IPC
(legacy IPC maps another process's memory on the same device), so the IPC
path, the flags across processes, zero-copy buffers and CUDA graphs are all
checked for correctness on a single-GPU machine. Kernels of different
processes time-slice there, so nothing here measures speed.

Skipped without a GPU or without the CUDA kernels in the build.
"""
import contextlib
import hashlib
import os
import sys
import threading
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import pyallreduce  # noqa: E402
from pyallreduce import _C  # noqa: E402
from pyallreduce.backend import SERVES_IN_CPP  # noqa: E402
from pyallreduce.group import backend_of  # noqa: E402

NO_CPP_SERVING = f"the backend's C++ fast path needs torch >= 2.9 (this is {torch.__version__})"

if not _C.WITH_CUDA:
    pytest.skip("pyallreduce was built without its CUDA kernels", allow_module_level=True)

from launch import raises_when_a_watchdog_aborts, run_ranks, wait_for_file  # noqa: E402
from other_capture import another_threads_capture  # noqa: E402
from reference import (DTYPES, MISMATCHED_CALLS, exact_input, exact_sum, fp32_reduction, random_input,  # noqa: E402
                       tolerance, triton_kernels_unusable)

ALGOS = ("one_shot", "two_shot")
MAX_BYTES = 256 << 10  # small, so the communicator's chunking runs too
CHUNK_BYTES = 512 * 16  # the CUDA kernels' chunk: 512 threads x one 16-byte vector
NBLOCKS = 4
TIMEOUT_S = 60  # kernels of 8 processes time-slice on one GPU: generous deadlines
RUN_TIMEOUT = 900


def sizes_for(dtype):
    """Element counts around every boundary the kernels have: sub-vector tails,
    one vector, one chunk, one round of chunks over the blocks (two-shot
    ownership), the staging buffer."""
    elem = torch.empty((), dtype=dtype).element_size()
    vec, chunk = 16 // elem, CHUNK_BYTES // elem
    per_call = MAX_BYTES // elem
    return sorted({1, 3, vec - 1, vec, vec + 1, chunk - 1, chunk + 3, NBLOCKS * chunk + 1,
                   3 * NBLOCKS * chunk - vec + 1, per_call - 1, per_call, 2 * per_call + 5})


# The Triton backend runs the checks that need no CUDA-backend-only feature
# (graphs and registration are the CUDA backend's): the ranks get the backend
# in their environment.
BACKEND_ENV = "PYALLREDUCE_TEST_GPU_BACKEND"


def make_comm(**kw):
    # The emulation must run the emulated extension (its kernels on the host
    # shim), never the repository's build, whose launches would all fail.
    assert not EMULATED or "emulated" in _C.__file__, _C.__file__
    kw.setdefault("device", torch.device("cuda", 0))
    kw.setdefault("backend", os.environ.get(BACKEND_ENV, "cuda"))
    kw.setdefault("max_bytes", MAX_BYTES)
    kw.setdefault("timeout", TIMEOUT_S)
    kw.setdefault("nblocks", NBLOCKS)
    comm = pyallreduce.Communicator(**kw)
    # These checks are of the kernels' path: a fallback to torch.distributed
    # (a failed topology probe, say) would pass them without it.
    assert comm.fallback_reason is None, f"rank {comm.rank}: {comm.fallback_reason}"
    return comm


def exact_avg(numel, world, dtype, salt):
    return fp32_reduction([exact_input(numel, q, dtype, salt) for q in range(world)], average=True)


def on_gpu(t):
    return t.to("cuda")


# Under the emulated CUDA runtime (tests/emulated: the glue, transport and
# Python stack on a machine without a GPU) only pyallreduce's kernels run, not
# torch's: the checks overwrite tensors and sleep through the helpers below.
EMULATED = torch.cuda.get_device_name(0).startswith("Emulated")
# Each check at 2, 4 and 8 ranks on a GPU; at 2 and 4 on the emulation, where 8
# ranks' kernels on the host shim took 3 of its 7 minutes on the CI VM's 2
# cores (the kernels at 8 ranks run in tests/test_cuda_sim.py, the glue does
# nothing at 8 that it does not at 4).
WORLD_SIZES = (2, 4) if EMULATED else (2, 4, 8)


def repeats(n):
    """How often a check that loops to meet races repeats: n on a GPU, a
    quarter of it on the emulation (its kernels run ~100x slower)."""
    return max(1, n // 4) if EMULATED else n


def overwrite(t, value):
    """t.fill_(value); under the emulation, a copy from the host (the same bytes,
    but the host waits for it where fill_ would let it run ahead)."""
    if EMULATED:
        t.copy_(torch.full(t.shape, value, dtype=t.dtype))
    else:
        t.fill_(value)


def gpu_sleep(cycles):
    if not EMULATED:  # its work is synchronous: a sleep would only delay the host
        torch.cuda._sleep(cycles)


def peer_mappings():
    """Under the emulation, how many peer allocations this process maps (IPC
    handles opened and not closed: tests/emulated/cudart.cpp); None on a GPU."""
    if not EMULATED:
        return None
    import ctypes

    return ctypes.CDLL(None).pyallreduce_emulated_peer_mappings()


def digest(t):
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def gather(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ---- eager ---------------------------------------------------------------------------


def trace(rank, *what):
    """With PYALLREDUCE_TEST_TRACE set (tests/gpu_debug.py sets it), each rank
    names the call it starts: the last line before a crash names it."""
    if os.environ.get("PYALLREDUCE_TEST_TRACE"):
        print(f"rank {rank}:", *what, file=sys.stderr, flush=True)


def check_eager(rank, world):
    torch.cuda.set_device(0)
    failures = []
    with make_comm() as comm:
        for dtype in DTYPES:
            for numel in sizes_for(dtype):
                for algo in ALGOS:
                    salt = numel % 97
                    want_sum = exact_sum(numel, world, dtype, salt)
                    x = on_gpu(exact_input(numel, rank, dtype, salt))
                    trace(rank, dtype, numel, algo, "sum")
                    got = comm.all_reduce(x, algo=algo)
                    overwrite(x, 1000)  # reuse the input at once: peers read the staging copy
                    if not torch.equal(got.cpu(), want_sum):
                        failures.append(("sum", dtype, numel, algo))

                    trace(rank, dtype, numel, algo, "avg")
                    got = comm.all_reduce(on_gpu(exact_input(numel, rank, dtype, salt)), op="avg", algo=algo)
                    if not torch.equal(got.cpu(), exact_avg(numel, world, dtype, salt)):
                        failures.append(("avg", dtype, numel, algo))

                    y = on_gpu(exact_input(numel, rank, dtype, salt))
                    trace(rank, dtype, numel, algo, "in place")
                    comm.all_reduce_(y, algo=algo)
                    if not torch.equal(y.cpu(), want_sum):
                        failures.append(("in-place", dtype, numel, algo))

                    # Views one element off 16-byte alignment take the aligned-copy path.
                    base = on_gpu(torch.full((numel + 1,), 55, dtype=dtype))
                    view = base[1:]
                    view.copy_(on_gpu(exact_input(numel, rank, dtype, salt)))
                    out = on_gpu(torch.full((numel + 1,), 66, dtype=dtype))[1:]
                    trace(rank, dtype, numel, algo, "misaligned")
                    comm.all_reduce(view, algo=algo, out=out)
                    if not torch.equal(out.cpu(), want_sum) or base[0].item() != 55:
                        failures.append(("misaligned", dtype, numel, algo))
    assert not failures, f"rank {rank}: wrong results for {failures[:10]} ({len(failures)} in all)"


def check_random_floats(rank, world):
    """Random values against fp64 within one rounding, and the same bits on every rank."""
    torch.cuda.set_device(0)
    failures, digests = [], []
    with make_comm() as comm:
        for dtype in DTYPES:
            for algo in ALGOS:
                for op in ("sum", "avg"):
                    numel = 3 * NBLOCKS * CHUNK_BYTES // 2 + 7
                    got = comm.all_reduce(on_gpu(random_input(numel, rank, dtype, seed=numel)), op=op, algo=algo)
                    inputs = [random_input(numel, q, dtype, seed=numel) for q in range(world)]
                    ref = sum(t.double() for t in inputs) / (world if op == "avg" else 1)
                    if not torch.allclose(got.cpu().double(), ref, **tolerance(dtype, world)):
                        failures.append((dtype, algo, op))
                    if not torch.equal(got.cpu(), fp32_reduction(inputs, op == "avg")):
                        failures.append(("bits", dtype, algo, op))
                    digests.append(digest(got))
    assert not failures, f"rank {rank}: {failures}"
    assert len(set(map(tuple, gather(digests)))) == 1, "ranks disagree on the bits of a result"


# ---- CUDA graphs ---------------------------------------------------------------------


def check_graph(rank, world):
    """Captured once, replayed many times with new inputs: the kernels' epoch
    lives in device memory, so every replay is a new call. The captured
    inputs are registered when comm.capture() exits, so the replays read them
    in place; each input is overwritten right after each replay."""
    torch.cuda.set_device(0)
    failures = []
    replays = 30
    with make_comm() as comm:
        for dtype in DTYPES:
            numel = 2 * NBLOCKS * CHUNK_BYTES // torch.empty((), dtype=dtype).element_size() + 3
            static = on_gpu(exact_input(numel, rank, dtype))
            in_place_two = static.clone()
            in_place_one = static.clone()
            comm.all_reduce(static)  # warm-up outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            entries_before = len(_C.cuda_graph_entry_modes(comm._engine.handle))
            with comm.capture():
                with torch.cuda.graph(graph):
                    # Several calls in one graph, both algorithms, sum and avg, in place.
                    out_one = comm.all_reduce(static, algo="one_shot")
                    out_two = comm.all_reduce(static, algo="two_shot")
                    out_avg = comm.all_reduce(static, op="avg", algo="two_shot")
                    comm.all_reduce_(in_place_two, algo="two_shot")
                    comm.all_reduce_(in_place_one, algo="one_shot")  # keeps the staging copy
            # Out-of-place calls read the inputs in place (1), the in-place
            # two-shot call reduces in place (2); in-place one-shot has no entry.
            modes = _C.cuda_graph_entry_modes(comm._engine.handle)[entries_before:]
            if modes != [1, 1, 1, 2]:
                failures.append(("graph entries", dtype, modes))
            for it in range(replays):
                salt = it + 1
                for t in (static, in_place_two, in_place_one):
                    t.copy_(on_gpu(exact_input(numel, rank, dtype, salt)))
                graph.replay()
                results = [out_one.clone(), out_two.clone(), out_avg.clone(), in_place_two.clone(),
                           in_place_one.clone()]
                overwrite(static, -9)  # at once: peers must be done reading it
                want = exact_sum(numel, world, dtype, salt)
                if not all(torch.equal(r.cpu(), want) for i, r in enumerate(results) if i != 2):
                    failures.append(("sum", dtype, it))
                if not torch.equal(results[2].cpu(), exact_avg(numel, world, dtype, salt)):
                    failures.append(("avg", dtype, it))
            # Eager calls still line up with the epochs the replays advanced.
            got = comm.all_reduce(on_gpu(exact_input(numel, rank, dtype, 99)))
            if not torch.equal(got.cpu(), exact_sum(numel, world, dtype, 99)):
                failures.append(("eager after replays", dtype))
            del graph
        # Entered inside the capture, comm.capture() could not register at exit: refused.
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                with comm.capture():
                    pass
            failures.append("capture() inside torch.cuda.graph was accepted")
        except RuntimeError as e:
            if "before torch.cuda.graph" not in str(e):
                failures.append(("wrong error", str(e)))
    assert not failures, f"rank {rank}: {failures[:10]}"


def check_graph_reads_inputs_in_place(rank, world):
    """After comm.capture() exits, replays of a captured out-of-place one-shot
    call and of an in-place two-shot call read every rank's input in place:
    this rank's staging buffers, filled with a marker, stay untouched while
    the sums stay right."""
    import torch.distributed as dist

    torch.cuda.set_device(0)
    failures = []
    with make_comm() as comm:
        dtype = torch.float32
        numel = 3 * CHUNK_BYTES // 4 + 1
        x = on_gpu(exact_input(numel, rank, dtype))
        y = x.clone()
        graph = torch.cuda.CUDAGraph()
        with comm.capture():
            with torch.cuda.graph(graph):
                out = comm.all_reduce(x, algo="one_shot")
                comm.all_reduce_(y, algo="two_shot")
        staging = comm._engine.transport.regions[rank] + _C.DATA_OFFSET
        marker = torch.full((2 * comm.max_bytes,), 0xA5, dtype=torch.uint8)
        _C.cuda_memcpy(0, staging, marker.data_ptr(), marker.numel())
        for it in range(10):
            x.copy_(on_gpu(exact_input(numel, rank, dtype, it)))
            y.copy_(x)
            graph.replay()
            want = exact_sum(numel, world, dtype, it)
            if not (torch.equal(out.cpu(), want) and torch.equal(y.cpu(), want)):
                failures.append(("sum", it))
        torch.cuda.synchronize()
        dist.barrier()
        staged = torch.empty_like(marker)
        _C.cuda_memcpy(0, staged.data_ptr(), staging, marker.numel())
        if not torch.equal(staged, marker):
            failures.append("the replays wrote the staging buffer: not zero copy")
        del graph
    assert not failures, f"rank {rank}: {failures}"


def check_graph_table_blocks(rank, world):
    """Graph tables of 4 entries: a second capture starts a new block (leaving
    a hole), a capture with more calls than free entries keeps the rest
    staged; every replay is still right."""
    from pyallreduce.engines import cuda

    torch.cuda.set_device(0)
    cuda.GRAPH_TABLE_BLOCK = 4
    failures = []
    with make_comm() as comm:
        dtype = torch.float32
        numel = CHUNK_BYTES // 4 + 3
        graphs = []
        for ncalls in (3, 5):  # slots 0-2; then a new block: slots 4-7 and one call without
            xs = [on_gpu(exact_input(numel, rank, dtype, k)) for k in range(ncalls)]
            graph = torch.cuda.CUDAGraph()
            with comm.capture():
                with torch.cuda.graph(graph):
                    outs = [comm.all_reduce(x, algo=ALGOS[k % 2]) for k, x in enumerate(xs)]
            graphs.append((graph, xs, outs))
        modes = _C.cuda_graph_entry_modes(comm._engine.handle)
        if modes != [1] * 7:
            failures.append(("graph entries", modes))
        for it in range(5):
            for graph, xs, outs in graphs:
                for k, x in enumerate(xs):
                    x.copy_(on_gpu(exact_input(numel, rank, dtype, 10 * it + k)))
                graph.replay()
                for k, out in enumerate(outs):
                    if not torch.equal(out.cpu(), exact_sum(numel, world, dtype, 10 * it + k)):
                        failures.append((len(xs), k, it))
        del graphs
    assert not failures, f"rank {rank}: {failures[:10]}"


# ---- zero-copy (registered) buffers -----------------------------------------------------


def check_registered(rank, world):
    """Peers read registered buffers in place; the input is overwritten right
    after every call, which goes wrong if a kernel returns while peers still
    read it (the end barrier)."""
    torch.cuda.set_device(0)
    failures = []
    with make_comm() as comm:
        handle = comm._engine.handle  # white-box: confirm the zero-copy path is taken
        for dtype in DTYPES:
            numel = 3 * NBLOCKS * CHUNK_BYTES // torch.empty((), dtype=dtype).element_size() + 5
            buf = torch.empty(numel + 64, dtype=dtype, device="cuda")
            comm.register(buf)
            elem = buf.element_size()
            views = {"whole": buf[:numel], "offset": buf[32 // elem: 32 // elem + numel // 2]}
            for name, view in views.items():
                if not _C.cuda_is_registered(handle, view.data_ptr(), view.numel() * elem):
                    failures.append(("not registered", dtype, name))
            for it in range(repeats(40)):
                for name, view in views.items():
                    n = view.numel()
                    want = exact_sum(n, world, dtype, it)
                    for algo in ALGOS:
                        view.copy_(on_gpu(exact_input(n, rank, dtype, it)))
                        got = comm.all_reduce(view, algo=algo)
                        overwrite(view, -3)  # at once, on the same stream
                        if not torch.equal(got.cpu(), want):
                            failures.append(("out-of-place", dtype, name, algo, it))

                        view.copy_(on_gpu(exact_input(n, rank, dtype, it)))
                        comm.all_reduce_(view, algo=algo)
                        snapshot = view.clone()
                        overwrite(view, -5)
                        if not torch.equal(snapshot.cpu(), want):
                            failures.append(("in-place", dtype, name, algo, it))

            # Captured with a registered input: replays read it in place.
            static = buf[:numel]
            graph = torch.cuda.CUDAGraph()
            with comm.capture():
                with torch.cuda.graph(graph):
                    out = comm.all_reduce(static, algo="one_shot")
            for it in range(repeats(20)):
                static.copy_(on_gpu(exact_input(numel, rank, dtype, it)))
                graph.replay()
                overwrite(static, -7)
                if not torch.equal(out.cpu(), exact_sum(numel, world, dtype, it)):
                    failures.append(("graph", dtype, it))
            del graph
    assert peer_mappings() in (None, 0), f"{peer_mappings()} peer mappings left after close()"
    assert not failures, f"rank {rank}: {failures[:10]} ({len(failures)} in all)"


def check_uncapturable_fallback_says_why(rank, world):
    """float64 all-reduces and reduce-scatters go to torch.distributed, here over
    gloo, which a CUDA graph cannot capture: each call must say so (not
    invalidate the capture with CUDA's bare error), and the communicator must
    work on afterwards."""
    torch.cuda.set_device(0)
    with make_comm() as comm:
        x = on_gpu(exact_input(1000, rank, torch.float64, 3))
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="cannot run inside a CUDA graph capture"):
            with torch.cuda.graph(graph):
                comm.all_reduce(x)
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="cannot run inside a CUDA graph capture"):
            with torch.cuda.graph(graph):
                comm.reduce_scatter(x)
        del graph
        assert torch.equal(comm.all_reduce(x).cpu(), exact_sum(1000, world, torch.float64, 3))
        y = on_gpu(exact_input(1000, rank, torch.float32, 3))
        assert torch.equal(comm.all_reduce(y).cpu(), exact_sum(1000, world, torch.float32, 3))


def readme_snippet(heading):
    """The first Python block of the README's section `heading`, as written."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    return text[text.index(heading):].split("```python", 1)[1].split("```", 1)[0]


def check_readme_capture_snippet(rank, world):
    """The snippet runs as written (with its names defined first) and its
    replay reduces the input the graph captured."""
    torch.cuda.set_device(0)
    numel = 4099
    names = {"pyallreduce": pyallreduce, "torch": torch, "graph": torch.cuda.CUDAGraph(),
             "buf": on_gpu(exact_input(numel, rank, torch.float32, 1)),
             "x": on_gpu(exact_input(numel, rank, torch.float32, 2))}
    exec(compile(readme_snippet("### On GPUs: registered buffers and CUDA graphs"), "README.md", "exec"), names)
    try:
        torch.cuda.synchronize()
        assert torch.equal(names["y"].cpu(), exact_sum(numel, world, torch.float32, 2))
        names["x"].copy_(on_gpu(exact_input(numel, rank, torch.float32, 5)))
        names["graph"].replay()
        torch.cuda.synchronize()
        assert torch.equal(names["y"].cpu(), exact_sum(numel, world, torch.float32, 5))
    finally:
        names["comm"].close()


class ViewModel(torch.nn.Module):
    """One CUDA parameter whose forward and backward are views: DDP's reducer,
    bucket copies and the hook run, and no torch kernel (the emulation runs
    none; on a GPU it is the same code path)."""

    def __init__(self, numel):
        super().__init__()
        self.weight = torch.nn.Parameter(on_gpu(exact_input(numel, 0, torch.float32, 11)))

    def forward(self):
        return self.weight.view(-1)


def check_readme_ddp_snippet(rank, world):
    """The README's DDP snippet as written, on a real DistributedDataParallel
    (run_ranks' gloo group): each step's gradient is the average of the ranks'
    exactly (DDP's default all-reduce's result), through the hook's GPU branch
    on the communicator it made, each bucket registered for zero copy and the
    one DDP replaced at its rebuild unregistered."""
    torch.cuda.set_device(0)
    numel = 3000
    names = {"pyallreduce": pyallreduce, "torch": torch, "model": ViewModel(numel)}
    exec(compile(readme_snippet("## DDP communication hook"), "README.md", "exec"), names)
    model, state = names["model"], names["state"]
    try:
        for step in range(3):
            out = model()
            out.backward(on_gpu(exact_input(numel, rank, torch.float32, step)))
            assert torch.equal(model.module.weight.grad.cpu(), exact_avg(numel, world, torch.float32, step)), step
            model.module.weight.grad = None  # as zero_grad(set_to_none=True) does, with no kernel
        assert state.calls >= 3 and state.reference_calls == 0, state
        # DDP rebuilt its bucket after the first step: the old one was unregistered, one stays.
        assert (state.registrations, state.unregistrations) == (2, 1), state
    finally:
        state.comm.close()


# ---- reduce-scatter, all-gather, mismatches, streams, deadlines --------------------------


def check_scatter_gather(rank, world):
    """Reduce-scatter and all-gather against the all-reduce's bits, out of place
    and with this rank's segment as the alias protocol.h allows, mixed with
    all-reduces on the same communicator; on a GPU also segments larger than
    one staged run takes (the communicator cuts them in pieces with strided
    copies, torch kernels the emulation does not run)."""
    torch.cuda.set_device(0)
    failures = []
    with make_comm() as comm:
        for dtype in DTYPES:
            elem = torch.empty((), dtype=dtype).element_size()
            for segment in (1, 5, 4099) + (() if EMULATED else (MAX_BYTES // (world * elem) + 37,)):
                numel = segment * world
                full = exact_sum(numel, world, dtype, segment)
                x = on_gpu(exact_input(numel, rank, dtype, segment))
                mine = full[rank * segment:(rank + 1) * segment]
                if not torch.equal(comm.reduce_scatter(x).reshape(-1).cpu(), mine):
                    failures.append(("reduce_scatter", dtype, segment))
                y = x.clone()
                comm.reduce_scatter(y, out=y[rank * segment:(rank + 1) * segment])
                if not torch.equal(y[rank * segment:(rank + 1) * segment].cpu(), mine):
                    failures.append(("reduce_scatter in place", dtype, segment))
                if not torch.equal(comm.all_reduce(x).cpu(), full):
                    failures.append(("all_reduce between", dtype, segment))
                part = on_gpu(exact_input(segment, rank, dtype, 7))
                want = torch.cat([exact_input(segment, q, dtype, 7) for q in range(world)])
                if not torch.equal(comm.all_gather(part).reshape(-1).cpu(), want):
                    failures.append(("all_gather", dtype, segment))
                out = on_gpu(torch.zeros(numel, dtype=dtype))
                out[rank * segment:(rank + 1) * segment].copy_(part)
                comm.all_gather(out[rank * segment:(rank + 1) * segment], out=out)
                if not torch.equal(out.cpu(), want):
                    failures.append(("all_gather in place", dtype, segment))
    assert not failures, f"rank {rank}: {failures}"


def check_mismatches_raise_on_every_rank(rank, world):
    """Ranks that disagree (size, dtype, op, algorithm, in place, fallback vs
    kernel) get the same error on every rank, by comm.check() at the latest;
    nothing is written; the communicator works on."""
    torch.cuda.set_device(0)
    problems = []
    with make_comm() as comm:
        for name, (first, second) in MISMATCHED_CALLS.items():
            numel, dtype, op, algo, in_place = first if rank == 0 else second
            x = on_gpu(exact_input(numel, rank, dtype, 3))
            out = on_gpu(torch.full((numel,), -1, dtype=dtype))
            raised = None
            try:
                if in_place:
                    comm.all_reduce_(x, op=op, algo=algo)
                else:
                    comm.all_reduce(x, op=op, algo=algo, out=out)
                comm.check()
            except RuntimeError as e:
                raised = str(e)
            if raised is None or "disagree" not in raised:
                problems.append((name, "no mismatch error", raised))
            elif not in_place and not torch.equal(out.cpu(), torch.full((numel,), -1, dtype=dtype)):
                problems.append((name, "out written"))
            y = on_gpu(exact_input(100, rank, torch.float32, 1))
            if not torch.equal(comm.all_reduce(y).cpu(), exact_sum(100, world, torch.float32, 1)):
                problems.append((name, "wrong sum after the mismatch"))
    assert not problems, f"rank {rank}: {problems}"


def check_two_streams(rank, world):
    """Calls alternating between two streams without synchronising: each launch
    waits for the communicator's previous one (launch_in_order)."""
    torch.cuda.set_device(0)
    streams = [torch.cuda.current_stream(), torch.cuda.Stream()]
    wrong = []
    with make_comm() as comm:
        results = []
        for i in range(40):
            stream = streams[i % 2]
            x = on_gpu(exact_input(777 + i, rank, torch.float32, i))
            stream.wait_stream(torch.cuda.current_stream())  # x's copy is on the current stream
            with torch.cuda.stream(stream):
                results.append((i, comm.all_reduce(x, algo=ALGOS[i % 2])))
                x.record_stream(stream)
        torch.cuda.synchronize()
        wrong = [i for i, out in results if not torch.equal(out.cpu(), exact_sum(777 + i, world, torch.float32, i))]
    assert not wrong, f"rank {rank}: calls {wrong} wrong"


def check_deadline_names_the_missing_rank(rank, world):
    """The last rank makes no call: the others' kernels give up after the
    deadline, and the error names it; the communicator is unusable then."""
    torch.cuda.set_device(0)
    comm = make_comm(timeout=2.0)
    try:
        if rank != world - 1:
            x = on_gpu(exact_input(1000, rank, torch.float32, 1))
            with pytest.raises(RuntimeError, match=rf"collective call \d+ .*rank\(s\) {world - 1} never arrived"):
                comm.all_reduce(x)
                comm.check()
            with pytest.raises(RuntimeError, match="unusable"):
                comm.all_reduce(x)
        gather(None)  # every rank is done with its kernels
    finally:
        comm.close()


def check_beside_another_threads_capture(rank, world):
    """Another thread of the process captures a CUDA graph in global mode
    (torch.cuda.graph's default) while this one makes a communicator, makes
    collective calls, checks, raises a mismatch, opens a comm.capture() and
    closes the communicator: none of our CUDA calls
    may be one that global mode prohibits then (an allocation, a wait, a
    device-wide sync), or the other thread's capture is invalidated and our
    call fails. Tensors are made before: torch's own allocations would be."""
    torch.cuda.set_device(0)
    x = on_gpu(exact_input(1000, rank, torch.float32, 3))
    with another_threads_capture(RUN_TIMEOUT) as errors:
        comm = make_comm()
        comm.all_reduce_(x)
        comm.check()  # waits for our kernels
        with pytest.raises(RuntimeError, match="disagree"):  # raised once our kernels are done
            comm.all_reduce_(x[:500] if rank == 0 else x)
            comm.check()
        with comm.capture():  # the graph table: an allocation, a zeroing, a wait
            pass
        comm.close()  # frees, unmaps
    assert not errors, f"the other thread's capture failed: {errors[0]}"
    assert torch.equal(x.cpu(), exact_sum(1000, world, torch.float32, 3))


def captured_and_replayed(rank):
    """A communicator on GPU 0 whose out-of-place two-shot all-reduce (of
    exact_input(1000, rank, float32, 4)) was captured into a graph, replayed
    once: (comm, graph, out)."""
    torch.cuda.set_device(0)
    comm = make_comm()
    x = on_gpu(exact_input(1000, rank, torch.float32, 4))
    graph = torch.cuda.CUDAGraph()
    with comm.capture():
        with torch.cuda.graph(graph):
            out = comm.all_reduce(x, algo="two_shot")  # out of place: reads x in place through its graph entry
    graph.replay()
    torch.cuda.synchronize()
    return comm, graph, out


def check_close_after_captures_beside_another_threads_capture(rank, world):
    """Once a graph holds this communicator's kernels, close() must wait for the
    whole device (a replay may run on any stream), which CUDA refuses while
    another thread captures (a real H100 returned
    cudaErrorStreamCaptureUnsupported in relaxed mode): close raises on every
    rank, saying why and what to do, and keeps everything a replay uses (its
    region, the peers' mappings, the status record and graph table) rather
    than freeing it under one: the graph still replays right after. Whether the
    other thread's capture survives the refused wait is not documented; the
    emulation invalidates it."""
    from pyallreduce.transport import cuda_ipc

    comm, graph, out = captured_and_replayed(rank)
    parked_before, mapped = len(cuda_ipc._parked), peer_mappings()
    with another_threads_capture(RUN_TIMEOUT):  # whatever it raised: undocumented (see above)
        with pytest.raises(RuntimeError, match=r"closing the communicator failed on rank 0: .*CUDA cannot wait "
                                               r"for the whole device while one of its streams is being captured.*"
                                               r"after that capture ends"):
            comm.close()
    assert len(cuda_ipc._parked) == parked_before + 1, "the region stays allocated"
    assert peer_mappings() == mapped, "the peers stay mapped"
    assert torch.equal(out.cpu(), exact_sum(1000, world, torch.float32, 4))
    out.copy_(torch.zeros(1000))  # a host copy: the emulation runs no torch kernel
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), exact_sum(1000, world, torch.float32, 4))


def check_abort_after_captures_waits_for_nothing_on_the_device(rank, world):
    """abort() once this communicator's kernels were captured: a graph may
    replay them at any time, after the abort too, so no wait makes freeing
    safe, and a device-wide wait could hang behind another library's kernel
    that waits for a dead peer (an NCCL kernel; ncclCommAbort does not wait for
    it). So the abort waits for nothing on the device: beside another thread's
    global-mode capture (where a device-wide wait is refused and invalidates
    that capture: what the abort did before) it returns and the other capture
    survives; everything a replay uses stays (the region, the peers' mappings,
    the status record and graph table), so a replay after the abort touches no
    freed memory (on the emulation that would fault)."""
    from pyallreduce.transport import cuda_ipc

    comm, graph, out = captured_and_replayed(rank)
    assert torch.equal(out.cpu(), exact_sum(1000, world, torch.float32, 4))
    parked_before, mapped = len(cuda_ipc._parked), peer_mappings()
    with another_threads_capture(RUN_TIMEOUT) as errors:
        comm.abort()
    assert not errors, f"the other thread's capture failed: {errors[0]}"
    assert len(cuda_ipc._parked) == parked_before + 1, "the region stays allocated"
    assert peer_mappings() == mapped, "the peers stay mapped"
    graph.replay()  # its kernels see the abort and give up, touching only what stayed
    torch.cuda.synchronize()


def logged():
    """The messages pyallreduce logs in this process from now on (a list that grows)."""
    import logging

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("pyallreduce").addHandler(handler)
    return said


def check_capture_exit_beside_another_threads_capture(rank, world):
    """comm.capture() left while another thread captures, once this
    communicator's kernels are in a graph: registering the captured inputs
    must first wait for the whole device (no kernel of ours may read a graph
    entry while it changes), which CUDA refuses then. Every rank keeps the
    staging copy for those calls, saying why, instead of raising or changing
    entries a replay may be reading; the graph replays right, and the
    communicator closes once the other capture has ended."""
    torch.cuda.set_device(0)
    said = logged()
    comm = make_comm()
    x = on_gpu(exact_input(1000, rank, torch.float32, 5))
    graph = torch.cuda.CUDAGraph()
    entries_before = len(_C.cuda_graph_entry_modes(comm._engine.handle))
    capture = comm.capture()
    capture.__enter__()
    with torch.cuda.graph(graph):
        out = comm.all_reduce(x, algo="two_shot")  # out of place: would read x in place
    mapped = peer_mappings()
    with another_threads_capture(RUN_TIMEOUT):  # whatever it raised: undocumented (check_close_after_...)
        capture.__exit__(None, None, None)
    assert _C.cuda_graph_entry_modes(comm._engine.handle)[entries_before:] == [0], "the entry changed: not staged"
    assert peer_mappings() == mapped, "a peer's input was mapped for an entry nobody may write"
    assert any("1 of 1 captured calls keep the staging copy: rank 0: waiting for the communicator's kernels "
               "failed" in message for message in said), said
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), exact_sum(1000, world, torch.float32, 5))
    comm.close()


def check_capture_left_inside_the_graph_capture(rank, world):
    """comm.capture() left before the torch.cuda.graph(...) capture it wraps
    has ended: registering there is not possible (it talks to the other ranks
    and waits for the device). Every rank raises saying what to do, nothing
    of ours breaks the capture (it ends cleanly), and the communicator works
    after it."""
    torch.cuda.set_device(0)
    comm = make_comm()
    x = on_gpu(exact_input(1000, rank, torch.float32, 6))
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    capture = comm.capture()
    capture.__enter__()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        comm.all_reduce(x)
        with pytest.raises(RuntimeError, match=r"comm.capture\(\) failed on rank 0: leave comm.capture\(\) after "
                                               r"the torch.cuda.graph\(...\) capture ended, not inside it; rank 1"):
            capture.__exit__(None, None, None)
        graph.capture_end()
    assert torch.equal(comm.all_reduce(x).cpu(), exact_sum(1000, world, torch.float32, 6))
    comm.close()


def check_capture_exit_when_mapping_a_captured_input_fails(rank, world):
    """At comm.capture()'s exit the last rank cannot map a peer's captured
    input (emulation: cudaIpcOpenMemHandle injected to fail): every rank keeps
    the staging copy for the captured calls, saying why, nothing stays mapped
    for them, and the graph replays right."""
    torch.cuda.set_device(0)
    said = logged()
    with make_comm() as comm:
        x = on_gpu(exact_input(1000, rank, torch.float32, 7))
        graph = torch.cuda.CUDAGraph()
        entries_before = len(_C.cuda_graph_entry_modes(comm._engine.handle))
        mapped = peer_mappings()
        with comm.capture():
            with torch.cuda.graph(graph):
                out = comm.all_reduce(x, algo="two_shot")  # out of place: would read x in place
            inject_failure("cudaIpcOpenMemHandle" if rank == world - 1 else None)  # the exit's first open
        inject_failure(None)
        assert _C.cuda_graph_entry_modes(comm._engine.handle)[entries_before:] == [0], "an entry was written"
        assert peer_mappings() == mapped, "a peer's input stays mapped for an entry nobody uses"
        assert any(f"the captured calls keep the staging copy: pyallreduce: mapping the peers' buffers failed on "
                   f"rank {world - 1}: pyallreduce: cudaIpcOpenMemHandle" in message for message in said), said
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), exact_sum(1000, world, torch.float32, 7))


def check_backend_with_cuda_tensors(rank, world, store_file):
    """README's torch.distributed snippet with CUDA tensors, as written:
    dist.init_process_group("pyallreduce"), then all_reduce (sum, avg, and
    async with wait(), synchronize() or block_current_stream() on another
    stream: NCCL's stream semantics),
    reduce-scatter and all-gather into tensors; destroy_process_group() closes
    the CUDA communicator collectively (the review's bug 1: it raised once the
    backend had served a CUDA call), and a new group starts after it."""
    import torch.distributed as dist

    import pyallreduce  # noqa: F401  (registers the backend)
    from pyallreduce.reference import _dist_all_gather, _dist_reduce_scatter

    torch.cuda.set_device(0)
    dist.destroy_process_group()  # run_ranks' gloo group
    dist.init_process_group("pyallreduce", init_method=f"file://{store_file}", rank=rank, world_size=world)
    x = on_gpu(exact_input(1000, rank, torch.float32, 5))
    dist.all_reduce(x)
    assert torch.equal(x.cpu(), exact_sum(1000, world, torch.float32, 5))
    y = on_gpu(exact_input(1000, rank, torch.float32, 5))
    dist.all_reduce(y, op=dist.ReduceOp.AVG)
    assert torch.equal(y.cpu(), exact_avg(1000, world, torch.float32, 5))

    z = on_gpu(exact_input(4096, rank, torch.float32, 6))
    if rank == 1:
        time.sleep(0.2)  # rank 0's kernel waits for it on the device while rank 0's host goes on
    work = dist.all_reduce(z, async_op=True)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        work.wait()  # the side stream waits for the collective's stream
        got = z.cpu()  # copied on the side stream
    assert torch.equal(got, exact_sum(4096, world, torch.float32, 6))
    for salt, order in ((10, "synchronize"), (11, "block_current_stream")):  # the same, by the Work's other names
        z = on_gpu(exact_input(4096, rank, torch.float32, salt))
        if rank == 1:
            time.sleep(0.2)
        work = dist.all_reduce(z, async_op=True)
        with torch.cuda.stream(side):
            getattr(work, order)()
            got = z.cpu()
        assert torch.equal(got, exact_sum(4096, world, torch.float32, salt)), order
    # A call served in Python (the list form): its Work is backend.py's, which torch's
    # Python Work trampoline reaches for wait() only; synchronize() must order the stream too.
    parts = [on_gpu(torch.zeros(4096)) for _ in range(world)]
    if rank == 1:
        time.sleep(0.2)
    work = dist.all_gather(parts, on_gpu(exact_input(4096, rank, torch.float32, 12)), async_op=True)
    with torch.cuda.stream(side):
        work.synchronize()
        got = [p.cpu() for p in parts]
    for q in range(world):
        assert torch.equal(got[q], exact_input(4096, q, torch.float32, 12)), "synchronize (Python)"

    seg = 1024
    out = on_gpu(torch.zeros(seg))
    _dist_reduce_scatter(out, on_gpu(exact_input(seg * world, rank, torch.float32, 7)))
    assert torch.equal(out.cpu(), exact_sum(seg * world, world, torch.float32, 7)[rank * seg:(rank + 1) * seg])
    gathered = on_gpu(torch.zeros(seg * world))
    _dist_all_gather(gathered, on_gpu(exact_input(seg, rank, torch.float32, 8)))
    assert torch.equal(gathered.cpu(), torch.cat([exact_input(seg, q, torch.float32, 8) for q in range(world)]))
    # After the first call made the Communicator, the contiguous calls took the C++ fast path.
    assert backend_of(dist.group.WORLD, torch.device("cuda")).fast_calls == 6

    dist.destroy_process_group()  # closes the CUDA communicator with its peers
    assert_a_new_gpu_group_sums(rank, world, store_file)


def check_backend_beside_another_threads_capture(rank, world, store_file):
    """dist.* calls on a "pyallreduce" group with CUDA tensors while another
    thread captures a CUDA graph in global mode (torch.cuda.graph's default):
    each served call's Work creates and records a CUDA event after the kernel,
    which CUDA permits beside a capture (an event query or a synchronisation
    would invalidate it), and wait() without a timeout orders streams without
    asking the host. So the calls are exact and the other capture survives.
    (is_completed() and wait(timeout) query that event, as NCCL's Works do:
    not for such moments.)"""
    import torch.distributed as dist

    import pyallreduce  # noqa: F401  (registers the backend)

    torch.cuda.set_device(0)
    dist.destroy_process_group()  # run_ranks' gloo group
    dist.init_process_group("pyallreduce", init_method=f"file://{store_file}", rank=rank, world_size=world)
    dist.all_reduce(on_gpu(torch.ones(8)))  # the communicator, made before: its construction allocates
    x, y = on_gpu(exact_input(1000, rank, torch.float32, 12)), on_gpu(exact_input(3000, rank, torch.float32, 13))
    with another_threads_capture(RUN_TIMEOUT) as errors:
        dist.all_reduce(x)  # the C++ fast path
        work = dist.all_reduce(y, async_op=True)
        work.wait()
    assert not errors, f"the other thread's capture failed: {errors[0]}"
    assert torch.equal(x.cpu(), exact_sum(1000, world, torch.float32, 12))
    assert torch.equal(y.cpu(), exact_sum(3000, world, torch.float32, 13))
    assert work.is_completed()
    dist.destroy_process_group()


def check_work_contract(rank, world, store_file):
    """The Work contract (tests/work_contract.py) for CUDA Works of the
    backend: the fast path's and the Python path's, succeeding, and failing on
    an argument check (a kernel's recorded failure raises at the next call or
    comm.check(), not from the Work of the call that recorded it).
    is_completed() follows the kernel, as NCCL's does: the polling loop ends
    once it ran. (The inner backend's Works are NCCL's own.)"""
    import torch.distributed as dist

    import pyallreduce  # noqa: F401  (registers the backend)
    from work_contract import assert_failed, assert_succeeded, observe

    torch.cuda.set_device(0)
    dist.destroy_process_group()  # run_ranks' gloo group
    dist.init_process_group("pyallreduce", init_method=f"file://{store_file}", rank=rank, world_size=world)
    impl = backend_of(dist.group.WORLD, torch.device("cuda"))
    for salt, path in ((20, "python"), (21, "fast")):  # the first call makes the Communicator
        x = on_gpu(exact_input(4096, rank, torch.float32, salt))
        if rank == 1:
            time.sleep(0.2)  # rank 0's kernel waits for it meanwhile
        before = impl.fast_calls
        work = dist.all_reduce(x, async_op=True)
        assert (impl.fast_calls > before) == (path == "fast"), path
        assert_succeeded(observe(work, path), [exact_sum(4096, world, torch.float32, salt)], f"all_reduce, {path}")
    parts = [on_gpu(torch.zeros(512)) for _ in range(world)]
    work = dist.all_gather(parts, on_gpu(exact_input(512, rank, torch.float32, 22)), async_op=True)
    assert_succeeded(observe(work, "all_gather (list)"), [exact_input(512, q, torch.float32, 22) for q in range(world)],
                     "all_gather (list)")
    work = dist.all_gather_into_tensor(on_gpu(torch.zeros(7)), on_gpu(torch.ones(4)), async_op=True)
    assert_failed(observe(work, "wrong output size"), "ValueError", "all_gather_into_tensor, wrong output size")
    dist.destroy_process_group()


@pytest.mark.skipif(not SERVES_IN_CPP, reason=NO_CPP_SERVING)
def test_work_contract(tmp_path):
    run_ranks(check_work_contract, 2, str(tmp_path / "store"), timeout=240)


@pytest.mark.skipif(not SERVES_IN_CPP, reason=NO_CPP_SERVING)
def test_backend_beside_another_threads_capture(tmp_path):
    run_ranks(check_backend_beside_another_threads_capture, 2, str(tmp_path / "store"), timeout=240)


def check_two_communicators_on_two_gpus_in_two_threads(rank, world):
    """Two communicators, on GPU 0 and GPU 1, each driven by a thread of its
    own on every rank, their calls interleaving differently on each rank: the
    kernels of one GPU never wait for the other's. (The emulated runtime had
    one legacy default stream for all devices, not one per device as CUDA has,
    and this deadlocked there: each rank's first kernel waited for a peer's
    kernel queued behind that peer's other communicator's.)"""
    comms = [make_comm(device=torch.device("cuda", d)) for d in (0, 1)]
    errors = []

    def calls(d):
        try:
            for k in range(3):
                x = exact_input(1000, rank, torch.float32, 30 + k).to(comms[d].device)
                if (rank + d + k) % 2:
                    time.sleep(0.05)  # the ranks' orders across the two communicators differ
                assert torch.equal(comms[d].all_reduce(x).cpu(), exact_sum(1000, world, torch.float32, 30 + k))
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(f"GPU {d}: {e!r}")

    threads = [threading.Thread(target=calls, args=(d,)) for d in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads), errors or "a thread did not end"
    for comm in comms:
        comm.close()


def test_two_communicators_on_two_gpus_in_two_threads():
    if torch.cuda.device_count() < 2 or not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("needs two GPUs with peer access (the emulation has two: tests/emulated/build_emulated.py)")
    run_ranks(check_two_communicators_on_two_gpus_in_two_threads, 2, timeout=RUN_TIMEOUT)


def assert_a_new_gpu_group_sums(rank, world, store_file):
    """After the group ended: a new "pyallreduce" group starts and sums CUDA tensors exactly."""
    import torch.distributed as dist

    dist.init_process_group("pyallreduce", init_method=f"file://{store_file}.2", rank=rank, world_size=world)
    again = on_gpu(exact_input(300, rank, torch.float32, 9))
    dist.all_reduce(again)
    assert torch.equal(again.cpu(), exact_sum(300, world, torch.float32, 9))


def check_abort_ends_waiting_kernels(rank, world):
    """comm.abort() from a watchdog thread while this rank's kernels wait on
    the device for a peer that never calls: an eager all-reduce's, and behind
    it the agreement round of a float64 call (bound for torch.distributed),
    which the calling thread waits for. Both give up within about
    ABORT_LOOK_NS instead of at their 600 s deadline; the waiting call raises
    that the communicator was aborted, naming the missing rank. The peer
    aborts later with nothing in flight; nothing stays mapped; a new
    communicator sums exactly."""
    import torch.distributed as dist

    torch.cuda.set_device(0)
    comm = make_comm(timeout=600)
    x = on_gpu(exact_input(1000, rank, torch.float32, 5))
    assert torch.equal(comm.all_reduce(x).cpu(), exact_sum(1000, world, torch.float32, 5))
    if rank == 0:
        wide = on_gpu(torch.ones(8, dtype=torch.float64))  # before: a copy on the stream would wait for the kernel
        comm.all_reduce_(x)  # launched: its kernel waits for rank 1, which never calls
        raises_when_a_watchdog_aborts(comm, lambda: comm.all_reduce(wide),
                                      r"collective call 2 on this communicator was aborted \(Communicator\.abort\(\).*\) "
                                      r"while rank 0's kernel waited in the start barrier \(block \d+, epoch \d+\) "
                                      r"for rank\(s\) 1; create a new Communicator")
        torch.cuda.synchronize()
    dist.barrier()  # rank 1 never made the calls
    if rank == 1:
        comm.abort()
    assert peer_mappings() in (None, 0), f"{peer_mappings()} peer mappings left after the abort"
    y = on_gpu(exact_input(1000, rank, torch.float32, 6))
    with make_comm() as fresh:
        assert torch.equal(fresh.all_reduce(y).cpu(), exact_sum(1000, world, torch.float32, 6))


def check_abort_beside_a_close_waiting_for_kernels(rank, world):
    """close() on another thread waits for this device's kernels, one of which
    waits for a peer that never makes the call (600 s deadline): abort() from
    a watchdog ends that kernel's wait, and the close goes on (collective: it
    returns once the peer has closed too). Nothing stays mapped."""
    import threading

    torch.cuda.set_device(0)
    comm = make_comm(timeout=600)
    x = on_gpu(exact_input(1000, rank, torch.float32, 5))
    assert torch.equal(comm.all_reduce(x).cpu(), exact_sum(1000, world, torch.float32, 5))
    if rank == 0:
        comm.all_reduce_(x)  # launched: its kernel waits for rank 1, which closes instead
        closer = threading.Thread(target=comm.close)
        closer.start()
        time.sleep(2.0)
        assert closer.is_alive() and comm._closing is not None, "the close did not wait for the kernel"
        start = time.monotonic()
        comm.abort()
        closer.join(60)
        assert not closer.is_alive(), "the close did not go on after the abort ended the kernel's wait"
        assert time.monotonic() - start < 60
    else:
        comm.close()  # collective: returns once rank 0's close reaches the unmapping
    assert peer_mappings() in (None, 0), f"{peer_mappings()} peer mappings left after the close"


def check_backend_abort_beside_a_waiting_kernel(rank, world, store_file):
    """torch's _abort_process_group on one rank while its kernel waits on the
    device for a peer that never calls, and that peer does not abort with it:
    the abort needs nothing from the peer (a collective close would wait for
    it through the group), ends its own kernel's wait (long before the
    group's 600 s deadline), unmaps the peers, and a new group works
    afterwards."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _abort_process_group

    import pyallreduce  # noqa: F401  (registers the backend)

    torch.cuda.set_device(0)
    dist.destroy_process_group()  # run_ranks' gloo group
    dist.init_process_group("pyallreduce", init_method=f"file://{store_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    x = on_gpu(exact_input(1000, rank, torch.float32, 5))
    dist.all_reduce(x)  # the communicator exists on both ranks
    assert torch.equal(x.cpu(), exact_sum(1000, world, torch.float32, 5))
    if rank == 0:
        dist.all_reduce(x)  # enqueued; its kernel waits for rank 1, which never calls
        start = time.monotonic()
        _abort_process_group()
        aborted_in = time.monotonic() - start
        assert aborted_in < 60, aborted_in
        open(f"{store_file}.done", "w").close()
    else:  # waits outside torch.distributed, then leaves the group the same way
        wait_for_file(f"{store_file}.done")
        _abort_process_group()
    assert not dist.is_initialized()
    assert peer_mappings() in (None, 0), f"{peer_mappings()} peer mappings left after the abort"
    assert_a_new_gpu_group_sums(rank, world, store_file)


# ---- many calls back to back ---------------------------------------------------------


def check_unregister_right_after_calls(rank, world):
    """A buffer unregistered right after calls that read it in place: unregister
    waits for them before the peers' mappings go (a kernel after the unmapping
    would fault), and no mapping outlives unregister() or close()."""
    torch.cuda.set_device(0)
    wrong = []
    with make_comm() as comm:
        regions = peer_mappings()  # the peers' staging regions
        assert regions in (None, world - 1), regions
        for it in range(24):
            n = 3000 + 257 * it
            buf = on_gpu(exact_input(n, rank, torch.float32, it))
            assert comm.register(buf)
            out = comm.all_reduce(buf, algo=ALGOS[it % 2])  # reads the peers' buffers in place
            assert comm.unregister(buf)  # at once, the kernel possibly still queued
            if not torch.equal(out.cpu(), exact_sum(n, world, torch.float32, it)):
                wrong.append(it)
            assert peer_mappings() == regions, f"call {it}: {peer_mappings()} peer mappings, not {regions}"
    assert peer_mappings() in (None, 0), f"{peer_mappings()} peer mappings left after close()"
    assert not wrong, f"rank {rank}: calls {wrong} wrong"


def check_a_device_other_than_the_current_one(rank, world):
    """Each rank's communicator on its own GPU (cuda:rank) while the calling
    thread's current device stays 0: the glue's allocations, mappings, streams
    and launches must all be on the communicator's device (on the emulation a
    kernel that touches another device's memory faults), and the caller's
    current device must stay as it was."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(0)
    wrong = []
    with make_comm(device=device) as comm:
        for it in range(8):
            n = 3000 + 97 * it
            x = exact_input(n, rank, torch.float32, it).to(device)
            if not torch.equal(comm.all_reduce(x, algo=ALGOS[it % 2]).cpu(), exact_sum(n, world, torch.float32, it)):
                wrong.append(("all_reduce", it))
            buf = exact_input(n, rank, torch.float32, it).to(device)
            assert comm.register(buf)
            comm.all_reduce_(buf, algo=ALGOS[it % 2])
            assert comm.unregister(buf)
            if not torch.equal(buf.cpu(), exact_sum(n, world, torch.float32, it)):
                wrong.append(("registered", it))
            seg = exact_input(n * world, rank, torch.float32, it).to(device)
            mine = exact_sum(n * world, world, torch.float32, it)[rank * n:(rank + 1) * n]
            if not torch.equal(comm.reduce_scatter(seg).cpu(), mine):
                wrong.append(("reduce_scatter", it))
            assert torch.cuda.current_device() == 0, "a call changed the caller's current device"
        comm.check()
    assert torch.cuda.current_device() == 0
    assert not wrong, f"rank {rank}: {wrong}"


def check_only_the_communicators_gpu_gets_a_context(rank, world):
    """Each rank works on its own GPU (cuda:rank) from a thread that never
    chose a device (torch's current device is 0, with no CUDA context), as code
    that moves its model to f"cuda:{rank}" without torch.cuda.set_device does.
    A context takes hundreds of MiB of its GPU's memory (since CUDA 12,
    cudaSetDevice creates one): the communicator must create none on a GPU it
    does not use, and leave torch's current device as it was."""
    device = torch.device("cuda", rank)
    other = (rank + 1) % world
    with make_comm(device=device) as comm:
        for it, algo in enumerate(ALGOS):
            x = exact_input(5000, rank, torch.float32, it).to(device)
            assert torch.equal(comm.all_reduce(x, algo=algo).cpu(), exact_sum(5000, world, torch.float32, it))
        buf = exact_input(3000, rank, torch.float32, 7).to(device)
        assert comm.register(buf)
        comm.all_reduce_(buf)
        assert comm.unregister(buf)
        assert torch.equal(buf.cpu(), exact_sum(3000, world, torch.float32, 7))
        comm.check()
    assert torch.cuda.current_device() == 0, "the communicator changed torch's current device"
    assert not torch._C._cuda_hasPrimaryContext(other), \
        f"rank {rank} created a CUDA context on GPU {other}, which it never used"


def check_each_process_sees_only_its_own_gpu(rank, world):
    """As SLURM, Kubernetes and Ray often launch: CUDA_VISIBLE_DEVICES names
    one GPU per process, so every rank's GPU is its cuda:0 and no rank can see
    a peer's GPU. Legacy IPC opens the peers' handles all the same: the
    communicator takes the kernels' path, not the fallback, and sums exactly,
    eager and registered."""
    assert torch.cuda.device_count() == 1
    with make_comm() as comm:
        for it, algo in enumerate(ALGOS):
            x = on_gpu(exact_input(5000, rank, torch.float32, it))
            assert torch.equal(comm.all_reduce(x, algo=algo).cpu(), exact_sum(5000, world, torch.float32, it))
        buf = on_gpu(exact_input(3000, rank, torch.float32, 7))
        assert comm.register(buf)
        comm.all_reduce_(buf)
        assert comm.unregister(buf)
        assert torch.equal(buf.cpu(), exact_sum(3000, world, torch.float32, 7))


def inject_failure(function=None, nth=1):
    """Under the emulation, makes the nth next call of a CUDA runtime function in
    this process fail as a real failure does (tests/emulated/cudart.cpp); no
    function disarms it."""
    import ctypes

    ctypes.CDLL(None).pyallreduce_emulated_fail((function or "").encode(), nth if function else 0)


def outcome(fn):
    """'ok: <value>' or '<exception type>: <message>'."""
    try:
        return f"ok: {fn()}"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def check_runtime_failures_on_one_rank(rank, world):
    """CUDA runtime calls failing on the last rank only (emulation: injected):
    every rank ends alike (the same error, or the same fallback), nothing stays
    mapped that should not, and the communicator or the next one works."""
    torch.cuda.set_device(0)
    last = rank == world - 1
    seen = {}

    def construct():
        comm = pyallreduce.Communicator(device=torch.device("cuda", 0), max_bytes=MAX_BYTES, timeout=TIMEOUT_S,
                                        nblocks=NBLOCKS)
        reason = comm.fallback_reason
        comm.close()
        return f"fallback ({reason})" if reason else "constructed"

    from pyallreduce.transport import cuda_ipc, topology

    # Mapping a peer's memory fails during construction: the topology probe's
    # (the first open), then the staging region's (the second; a 2-rank group
    # opens one of each).
    for step, nth in (("construct: probe", 1), ("construct: region", 2)):
        topology._topology_cache.clear()  # a failed probe is remembered for the group (alike on every rank)
        inject_failure("cudaIpcOpenMemHandle" if last else None, nth)
        seen[step] = outcome(construct)
        inject_failure(None)
        assert peer_mappings() in (None, 0), f"{step}: {peer_mappings()} peer mappings left"
    topology._topology_cache.clear()
    # The status record cannot be allocated (pinned memory exhausted) after the
    # regions are mapped: every rank raises, and unmaps together.
    parked = len(cuda_ipc._parked)
    inject_failure("cudaHostAlloc" if last else None)
    seen["construct: status record"] = outcome(construct)
    inject_failure(None)
    assert peer_mappings() in (None, 0), f"status record: {peer_mappings()} peer mappings left"
    assert len(cuda_ipc._parked) == parked, "the failed communicator's memory was parked, not freed together"

    with make_comm() as comm:
        regions = peer_mappings()
        buf = on_gpu(exact_input(5000, rank, torch.float32, 1))
        # Mapping a peer's buffer fails: the staging copy on every rank.
        inject_failure("cudaIpcOpenMemHandle" if last else None)
        seen["register"] = outcome(lambda: comm.register(buf))
        inject_failure(None)
        seen["register a strided view"] = outcome(lambda: comm.register(buf[::2]))
        assert peer_mappings() == regions, (peer_mappings(), regions)
        if not torch.equal(comm.all_reduce(buf).cpu(), exact_sum(5000, world, torch.float32, 1)):
            seen["after"] = "wrong"
        # The wait for our kernels before unmapping fails: every rank raises, the buffer stays allocated.
        assert comm.register(buf)
        inject_failure("cudaEventSynchronize" if last else None)
        seen["unregister"] = outcome(lambda: comm.unregister(buf))
        inject_failure(None)
        # Unmapping a peer's region fails at close: every rank raises.
        inject_failure("cudaIpcCloseMemHandle" if last else None)
        seen["close"] = outcome(comm.close)
        inject_failure(None)
    with make_comm() as comm:  # and the next communicator works
        x = on_gpu(exact_input(3000, rank, torch.float32, 2))
        seen["next"] = outcome(lambda: torch.equal(comm.all_reduce(x).cpu(), exact_sum(3000, world, torch.float32, 2)))
    return seen


def check_a_kernel_fault_on_one_rank(rank, world):
    """Rank 1's kernel faults (emulation: injected), which leaves its CUDA
    unusable (a sticky error): rank 1 raises the CUDA error, rank 0 raises at
    its deadline naming rank 1, and leaving the `with` after it hangs nowhere
    and does not hide the error."""
    torch.cuda.set_device(0)
    x = on_gpu(exact_input(1000, rank, torch.float32, 1))
    try:
        with make_comm(timeout=5) as comm:
            comm.all_reduce(x)
            comm.check()
            inject_failure("kernel" if rank == 1 else None)
            comm.all_reduce(x)
            comm.check()
        return "no error"
    except RuntimeError as e:
        return str(e)


class Bucket:
    """What DDP hands a communication hook (dist.GradBucket's buffer() and index())."""

    def __init__(self, buffer, index):
        self._buffer, self._index = buffer, index

    def buffer(self):
        return self._buffer

    def index(self):
        return self._index


def ddp_model_stand_in(device):
    """A DistributedDataParallel as the hook sees it (process_group, device, the
    rebuild flag), without DDP's construction and reducer, which run torch's own
    CUDA kernels: the emulation runs only pyallreduce's."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = object.__new__(DistributedDataParallel)
    model.__dict__.update(process_group=dist.group.WORLD, device=device, is_multi_device_module=False,
                          _has_rebuilt_buckets=False)
    return model


def check_ddp_hook(rank, world):
    """The DDP hook's GPU branch (pyallreduce/ddp.py): buckets reduced on the
    hook's side stream after the gradients' stream, read in place once
    registered, the Future ordered after the kernel on the stream that waits
    for it; DDP's rebuild unregisters every buffer registered before it;
    compression reduces a registered wire buffer; a bucket whose storage moved
    without a rebuild raises on every rank."""
    from pyallreduce.ddp import HookState, allreduce_hook

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    wrong = []
    with make_comm() as comm:
        model = ddp_model_stand_in(device)
        state = HookState(model, comm)
        plans = {"before the rebuild": (3000, 70_001), "after it": (65_537, 5)}
        for when, sizes in plans.items():
            model._has_rebuilt_buckets = when == "after it"
            buckets = [torch.empty(n, device=device) for n in sizes]
            for step in range(3):
                salt = 10 * step + len(when)
                for i, b in enumerate(buckets):  # the gradients, written on the current stream
                    b.copy_(on_gpu(exact_input(b.numel(), rank, torch.float32, salt + i)))
                futures = [allreduce_hook(state, Bucket(b, i)) for i, b in enumerate(buckets)]
                for i, (b, fut) in enumerate(zip(buckets, futures)):
                    want = exact_avg(b.numel(), world, torch.float32, salt + i)
                    if fut.wait() is not b or not torch.equal(b.cpu(), want):
                        wrong.append((when, step, i))
            registered = [_C.cuda_is_registered(comm._engine.handle, b.data_ptr(), b.nbytes) for b in buckets]
            assert registered == [True, True], (when, registered)
        assert (state.registrations, state.unregistrations) == (4, 2), state

        # Compression: a bf16 wire buffer per bucket, registered; here the buckets are bf16 too, so
        # that the wire copies are plain copies (the emulation runs no cast kernel).
        bf16 = HookState(model, comm, compression="bf16")
        bucket = torch.empty(4099, dtype=torch.bfloat16, device=device)
        for step in range(6):  # a missing stream wait shows only when the copy starts late: several tries
            bucket.copy_(on_gpu(exact_input(bucket.numel(), rank, torch.bfloat16, step)))
            allreduce_hook(bf16, Bucket(bucket, 0)).wait()
            if not torch.equal(bucket.cpu(), exact_avg(bucket.numel(), world, torch.bfloat16, step)):
                wrong.append(("bf16", step))
        wire = bf16._wire[0]
        assert wire.data_ptr() != bucket.data_ptr() and _C.cuda_is_registered(comm._engine.handle, wire.data_ptr(),
                                                                                  wire.nbytes)
        assert bf16.registrations == 1

        # Without a rebuild, a bucket's storage must not move: registration could not follow it.
        allreduce_hook(state, Bucket(on_gpu(torch.zeros(4099)), 7)).wait()
        try:
            allreduce_hook(state, Bucket(on_gpu(torch.zeros(4099)), 7))
            raise AssertionError("a moved bucket was reduced")
        except RuntimeError as e:
            assert "bucket 7's storage moved" in str(e), e
        torch.cuda.synchronize()
    assert not wrong, f"rank {rank}: {wrong}"


def check_back_to_back(rank, world):
    """1,000 calls (250 on the emulation) without synchronising, mixing dtypes, sizes and algorithms
    (the staging buffer parity and the block epochs must stay in step), with
    ranks skewed by random GPU sleeps, the input overwritten after each call."""
    torch.cuda.set_device(0)
    gen = torch.Generator().manual_seed(1234 + rank)
    calls = repeats(1000)
    with make_comm() as comm:
        x = {d: torch.empty(4096, dtype=d, device="cuda") for d in DTYPES}
        results = []
        for i in range(calls):
            dtype = DTYPES[i % len(DTYPES)]
            numel = (1 + 37 * i) % 3000 + 1
            algo = ALGOS[(i // 3) % 2]
            view = x[dtype][:numel]
            view.copy_(on_gpu(exact_input(numel, rank, dtype, i)))
            if torch.randint(0, 8, (1,), generator=gen).item() == 0:
                gpu_sleep(int(torch.randint(1, 200_000, (1,), generator=gen).item()))
            out = comm.all_reduce(view, algo=algo)
            overwrite(view, 7)
            results.append((i, dtype, numel, out))
        torch.cuda.synchronize()
        wrong = [(i, dtype, numel) for i, dtype, numel, out in results
                 if not torch.equal(out.cpu(), exact_sum(numel, world, dtype, i))]
    assert not wrong, f"rank {rank}: {len(wrong)} of {calls} calls wrong, first {wrong[:5]}"


CHECKS = (check_eager, check_random_floats, check_graph, check_graph_reads_inputs_in_place, check_graph_table_blocks,
          check_registered, check_back_to_back, check_scatter_gather, check_mismatches_raise_on_every_rank,
          check_two_streams)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_on_one_gpu(check, world):
    run_ranks(check, world, timeout=RUN_TIMEOUT)


def test_deadline_names_the_missing_rank():
    run_ranks(check_deadline_names_the_missing_rank, 2, timeout=RUN_TIMEOUT)


def test_readme_capture_snippet_runs_as_written():
    run_ranks(check_readme_capture_snippet, 2, timeout=RUN_TIMEOUT)


def test_readme_ddp_snippet_runs_as_written():
    run_ranks(check_readme_ddp_snippet, 2, timeout=RUN_TIMEOUT)


def test_beside_another_threads_capture():
    run_ranks(check_beside_another_threads_capture, 2, timeout=RUN_TIMEOUT)


def test_close_after_captures_beside_another_threads_capture():
    run_ranks(check_close_after_captures_beside_another_threads_capture, 2, timeout=RUN_TIMEOUT)


def test_abort_after_captures_waits_for_nothing_on_the_device():
    run_ranks(check_abort_after_captures_waits_for_nothing_on_the_device, 2, timeout=RUN_TIMEOUT)


def test_capture_exit_beside_another_threads_capture():
    run_ranks(check_capture_exit_beside_another_threads_capture, 2, timeout=RUN_TIMEOUT)


def test_capture_exit_when_mapping_a_captured_input_fails():
    if not EMULATED:
        pytest.skip("the failure is injected through the emulated runtime")
    run_ranks(check_capture_exit_when_mapping_a_captured_input_fails, 2, timeout=RUN_TIMEOUT)


def test_capture_left_inside_the_graph_capture():
    run_ranks(check_capture_left_inside_the_graph_capture, 2, timeout=RUN_TIMEOUT)


@pytest.mark.skipif(not SERVES_IN_CPP, reason=NO_CPP_SERVING)
def test_backend_with_cuda_tensors(tmp_path):
    # A close that waits for itself (the backend's lock) hangs: a bound, not the deadline's 900 s.
    run_ranks(check_backend_with_cuda_tensors, 2, str(tmp_path / "store"), timeout=180)


def test_abort_ends_waiting_kernels():
    run_ranks(check_abort_ends_waiting_kernels, 2, timeout=240)


def test_abort_beside_a_close_waiting_for_kernels():
    run_ranks(check_abort_beside_a_close_waiting_for_kernels, 2, timeout=240)


@pytest.mark.skipif(not SERVES_IN_CPP, reason=NO_CPP_SERVING)
def test_backend_abort_beside_a_waiting_kernel(tmp_path):
    run_ranks(check_backend_abort_beside_a_waiting_kernel, 2, str(tmp_path / "store"), timeout=240)


def test_unregister_right_after_calls():
    run_ranks(check_unregister_right_after_calls, 2, timeout=RUN_TIMEOUT)


def test_a_device_other_than_the_current_one():
    if torch.cuda.device_count() < 2 or not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("needs two GPUs with peer access (the emulation has two: tests/emulated/build_emulated.py)")
    run_ranks(check_a_device_other_than_the_current_one, 2, timeout=RUN_TIMEOUT)


def test_only_the_communicators_gpu_gets_a_context():
    if torch.cuda.device_count() < 2 or not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("needs two GPUs with peer access (the emulation has two: tests/emulated/build_emulated.py)")
    run_ranks(check_only_the_communicators_gpu_gets_a_context, 2, timeout=RUN_TIMEOUT)


def test_each_process_sees_only_its_own_gpu():
    gpus = torch.cuda.device_count()
    if gpus < 2 or not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("needs two GPUs with peer access (the emulation has two: tests/emulated/build_emulated.py)")
    # The GPUs this process sees, by the names CUDA_VISIBLE_DEVICES gives them (if set).
    names = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(gpus)))).split(",")[:gpus]
    run_ranks(check_each_process_sees_only_its_own_gpu, 2, timeout=RUN_TIMEOUT,
              rank_env=[{"CUDA_VISIBLE_DEVICES": names[rank % gpus]} for rank in range(2)])


def test_runtime_failures_on_one_rank():
    if not EMULATED:
        pytest.skip("failures are injected through the emulated runtime")
    seen = run_ranks(check_runtime_failures_on_one_rank, 2, timeout=RUN_TIMEOUT)
    for step in seen[0]:
        assert seen[0][step] == seen[1][step], f"{step}: the ranks ended differently: {seen[0][step]!r} vs " \
                                               f"{seen[1][step]!r}"
    got = seen[0]
    assert got["construct: probe"].startswith("ok: fallback (rank 0: bytes written by rank 1 through CUDA IPC did "
                                              "not arrive; rank 1: pyallreduce: cudaIpcOpenMemHandle"), got
    assert got["construct: region"].startswith("RuntimeError: pyallreduce: mapping the peers' regions failed on "
                                               "rank 1: pyallreduce: cudaIpcOpenMemHandle"), got
    assert got["construct: status record"].startswith("RuntimeError: pyallreduce: setting up the communicator "
                                                      "failed on rank 1: pyallreduce: cudaHostAlloc of the status "
                                                      "record"), got
    assert got["register"] == got["register a strided view"] == "ok: False", got
    assert "after" not in got and got["next"] == "ok: True", got
    assert got["unregister"].startswith("RuntimeError: pyallreduce: unregistering a buffer failed on rank 1"), got
    assert got["close"].startswith("RuntimeError: pyallreduce: unmapping the peers' memory failed on rank 1"), got


def test_a_kernel_fault_on_one_rank():
    if not EMULATED:
        pytest.skip("the fault is injected through the emulated runtime")
    errors = run_ranks(check_a_kernel_fault_on_one_rank, 2, timeout=RUN_TIMEOUT)
    assert "illegal memory access" in errors[1] and "closing" not in errors[1], errors
    assert "deadline" in errors[0] and "rank(s) 1 never arrived" in errors[0], errors


def test_ddp_hook_gpu_branch():
    run_ranks(check_ddp_hook, 2, timeout=RUN_TIMEOUT)


def test_uncapturable_fallback_says_why():
    run_ranks(check_uncapturable_fallback_says_why, 2, timeout=RUN_TIMEOUT)


class LaunchRecorder:
    """Stands for a Triton kernel (launcher(*args) or kernel[grid](*args)): records the launch."""

    def __init__(self, name, launched):
        self.name, self.launched = name, launched

    def __getitem__(self, grid):
        return self

    def __call__(self, *args, **kwargs):
        self.launched.append(self.name)


@contextlib.contextmanager
def triton_launches_recorded():
    """The Triton backend's kernel launches (all-reduce and agreement) recorded,
    not run, for the block: yields the list of their names, in order. Triton
    launches through the CUDA driver, which the emulation does not run."""
    from unittest import mock

    from pyallreduce import triton_kernels

    launched = []
    launchers = {algo: LaunchRecorder("all_reduce", launched) for algo in triton_kernels._LAUNCHERS}
    with mock.patch.dict(triton_kernels._LAUNCHERS, launchers), \
            mock.patch.object(triton_kernels.signal, "_agree_kernel", LaunchRecorder("agree", launched)):
        yield launched


def check_triton_capture_makes_no_prohibited_call(rank, world):
    """The review's bug 3, the host side of the Triton backend under a
    torch.cuda.graph capture (global mode): its first call and an empty call
    (whose agreement round is skipped inside a capture, as the C++ backends
    skip it) make no call CUDA prohibits there (allocation, pinned allocation,
    synchronous copy, stream synchronisation: the emulated runtime fails them
    and invalidates the capture). The launches themselves are recorded, not
    run: Triton launches through the CUDA driver, which the emulation does not
    run."""
    torch.cuda.set_device(0)
    with triton_launches_recorded() as launched, make_comm(backend="triton") as comm:
        x, empty = on_gpu(exact_input(1000, rank, torch.float32, 1)), on_gpu(torch.empty(0))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            comm.all_reduce_(x)  # the communicator's first call
            comm.all_reduce_(empty)
        assert launched == ["all_reduce"], launched


def check_triton_beside_another_threads_capture(rank, world):
    """The Triton backend's host side while another thread captures in global
    mode: its construction (pinned and device allocations, a wait), an eager
    call (the first records the launch chain's event), an empty call (its
    agreement round, then a wait for it), a recorded mismatch (raised after a
    wait for the kernels) and close() make no call that global mode prohibits
    (the emulation fails them and invalidates the other thread's capture).
    The launches are recorded, not run: Triton launches through the CUDA
    driver, which the emulation does not run."""
    from pyallreduce import triton_kernels

    status = triton_kernels.status
    torch.cuda.set_device(0)
    x, empty = on_gpu(exact_input(1000, rank, torch.float32, 1)), on_gpu(torch.empty(0))
    with triton_launches_recorded() as launched, another_threads_capture(RUN_TIMEOUT) as errors:
        comm = make_comm(backend="triton")
        comm.all_reduce_(x)
        comm.all_reduce_(empty)
        (_, _, record), = triton_kernels._device_args.values()
        record[status.STATUS_CODE.value] = status.CODE_MISMATCH.value  # as a kernel records ranks that disagree
        with pytest.raises(RuntimeError, match="disagree|differ"):
            comm.all_reduce_(empty)
        comm.close()
    assert not errors, f"the other thread's capture failed: {errors[0]}"
    assert launched == ["all_reduce", "agree", "agree"], launched


TRITON_CHECKS = (check_eager, check_random_floats, check_back_to_back)


def test_triton_capture_makes_no_prohibited_call():
    if (why := triton_kernels_unusable(interpret=False)) is not None:
        pytest.skip(why)
    run_ranks(check_triton_capture_makes_no_prohibited_call, 2, timeout=RUN_TIMEOUT)


def test_triton_beside_another_threads_capture():
    if (why := triton_kernels_unusable(interpret=False)) is not None:
        pytest.skip(why)
    run_ranks(check_triton_beside_another_threads_capture, 2, timeout=RUN_TIMEOUT)


@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("check", TRITON_CHECKS, ids=lambda check: check.__name__)
def test_triton_backend_on_one_gpu(check, world):
    if EMULATED:
        pytest.skip("Triton launches through the CUDA driver, which is not emulated")
    if (why := triton_kernels_unusable(interpret=False)) is not None:
        pytest.skip(why)
    run_ranks(check, world, timeout=RUN_TIMEOUT, env={BACKEND_ENV: "triton"})
