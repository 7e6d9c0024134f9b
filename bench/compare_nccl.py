"""nccl-tests-style check and timing of pyallreduce against torch.distributed
(NCCL on CUDA, gloo on CPU), optionally against DeepSpeed's shared-memory
all-reduce and an MPI's MPI_Allreduce on CPU.

    torchrun --nproc-per-node=8 bench/compare_nccl.py --sizes 1K:64M --json out.json
    python bench/compare_nccl.py --device cpu --nproc 4 --plot out.png   # spawns the ranks itself
    python bench/compare_nccl.py --device cpu --mpi openmpi   # the ranks under mpiexec.openmpi, MPI timed too

Every size first runs a correctness round with exact-sum inputs and zero
tolerance (any wrong element makes the run exit non-zero), then the timed loops.

On the emulated CUDA runtime (tests/emulated: python tests/emulated/build_emulated.py
prints its environment) the same script runs the whole GPU code path -- CUDA
communicator, IPC, graphs of comm.capture() -- for correctness; its reference
is gloo through host copies (no NCCL there) and its times are host threads',
meaningless as GPU numbers, and labelled so.
"""
import argparse
import contextlib
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import pyallreduce
from pyallreduce import policy
from pyallreduce.communicator import DEFAULT_MAX_BYTES

from local_ranks import (MPIS, MpiAllreduce, add_launch_arguments, adopt_mpi_rank, emulated_cuda, init_group,
                         spawn_ranks, under_torchrun)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
OPS = ("sum", "avg")
ALGOS = ("auto", "one_shot", "two_shot")
NATIVE_BACKEND = {"cpu": "cpu", "cuda": "cuda"}
SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
# Inputs are (i % INPUT_PERIOD + rank): small integers, so every partial sum is
# exact in bfloat16 (8-bit significand) for up to MAX_RANKS ranks.
INPUT_PERIOD = 7
# Sizes up to this many bytes are timed on CUDA as a replayed graph of
# GRAPH_BATCH calls: one launch per call would otherwise dominate the latency.
GRAPH_MAX_BYTES = 1 << 20
GRAPH_BATCH = 20
# On CPU, our in-place call and the other all-reduces of a row (DeepSpeed, MPI)
# are timed in this many turns each (time_cpu).
ALTERNATIONS = 10
# DeepSpeed's shm kernels need these x86 ISA levels (vector_kernel_level():
# 1 = avx2, 2 = avx512bw); deepspeed/comm/torch.py falls back to the process
# group below them, because the kernel would fault and its peers hang.
DEEPSPEED_LEVEL = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 2}


# ---- arguments ---------------------------------------------------------------

def parse_bytes(text):
    text = text.strip().upper().removesuffix("B")
    scale = SUFFIXES.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in SUFFIXES else text) * scale)


def size_range(spec, factor):
    lo, _, hi = spec.partition(":")
    lo = parse_bytes(lo)
    hi = parse_bytes(hi) if hi else lo
    if lo <= 0 or hi < lo or factor <= 1:
        raise argparse.ArgumentTypeError(f"bad size range {spec!r} with factor {factor}")
    sizes = []
    while lo <= hi:
        sizes.append(lo)
        lo *= factor
    return sizes


def choice_list(allowed):
    def parse(text):
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{bad or text!r}: choose from {', '.join(allowed)}")
        return items
    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Times are medians over --iters iterations of the slowest rank (per-iteration MAX over "
               "the group); JSON also has p10/p90. algbw = size/time, busbw = algbw*2(W-1)/W. The "
               "reference (torch.distributed.all_reduce) is in place, so speedup and the crossovers "
               "compare it with our in-place time. On CPU, %bound is the time of a copy with the least "
               "memory traffic an all-reduce of that size needs (bound_copy_bytes: 2x the size at 2 ranks), "
               "timed the same way in the same run, over the in-place time. Without torchrun (no RANK in the environment) "
               "the script starts --nproc ranks itself, with OMP_NUM_THREADS = cores/nproc unless set "
               "and, on CPU, each rank bound to its own share of the cores.")
    add_launch_arguments(p, nproc=2)
    p.add_argument("--sizes", default="256:64M",
                   help="byte range MIN:MAX (or one size), K/M/G suffixes are powers of 1024 (default 256:64M)")
    p.add_argument("--factor", type=int, default=2, help="multiplier between sizes (default 2)")
    p.add_argument("--dtypes", type=choice_list(tuple(DTYPES)), default=["float32"],
                   help="comma list of float32,float16,bfloat16 (default float32)")
    p.add_argument("--ops", type=choice_list(OPS), default=["sum"], help="comma list of sum,avg (default sum)")
    p.add_argument("--algos", type=choice_list(ALGOS), default=list(ALGOS),
                   help="comma list of auto,one_shot,two_shot (default all)")
    p.add_argument("--backends", type=choice_list(("cpu", "cuda", "triton")), default=None,
                   help="comma list of pyallreduce backends (default: the device's native one)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per measurement (default 20)")
    p.add_argument("--repeat", type=int, default=1,
                   help="consecutive runs of the whole table (rows say which); --write-crossovers then "
                        "takes, per size, the median over the runs of the time ratio, so one noisy run "
                        "does not decide (default 1)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations before each loop (default 5)")
    p.add_argument("--max-bytes", type=parse_bytes, default=DEFAULT_MAX_BYTES,
                   help=f"Communicator staging buffer size (default {DEFAULT_MAX_BYTES >> 20}M)")
    p.add_argument("--graph-max-bytes", type=parse_bytes, default=GRAPH_MAX_BYTES,
                   help=f"CUDA: sizes up to this are timed as CUDA-graph replays of {GRAPH_BATCH} calls "
                        f"(default {GRAPH_MAX_BYTES >> 20}M; 0 disables)")
    p.add_argument("--json", type=Path, help="write machine description and all rows here")
    p.add_argument("--plot", type=Path, help="write latency and busbw against size here (needs matplotlib)")
    p.add_argument("--write-crossovers", action="store_true",
                   help="derive two_shot_min_bytes and reference_min_bytes for this device kind and world "
                        "size from the rows and merge them into --crossovers-file")
    p.add_argument("--crossovers-file", type=Path, default=policy.CROSSOVERS_FILE,
                   help="crossover table that 'auto' reads and --write-crossovers updates "
                        "(default: the installed pyallreduce/crossovers.json)")
    p.add_argument("--compare-deepspeed", action="store_true",
                   help="CPU only: also time DeepSpeed's shm all-reduce (torch.ops.deepspeed.inference_all_reduce_, "
                        "sum only, in place, timed in turns with our in-place call row by row); deepspeed must be "
                        "importable (e.g. PYTHONPATH)")
    p.add_argument("--mpi", choices=MPIS,
                   help="CPU only: start the ranks with this MPI's launcher and also time its MPI_Allreduce "
                        "(in place, through mpi4py built against it: bash bench/mpi_setup.sh), timed in "
                        "turns with our in-place call row by row; the 16-bit types go to MPI as fp32 (MPI has no bfloat16), "
                        "avg as a sum and a division (MPI has no average)")
    p.add_argument("--isa", choices=("native", "avx512", "avx2", "generic"), default="native",
                   help="CPU: the vector ISA of our reduction kernels (PYALLREDUCE_CPU_ISA), and with "
                        "--compare-deepspeed DeepSpeed's build too (avx2: -march=haswell), to measure an "
                        "AVX2 machine's code on an AVX-512 one (default: the best this CPU has)")
    args = p.parse_args(argv)
    try:
        args.sizes = size_range(args.sizes, args.factor)
    except (ValueError, argparse.ArgumentTypeError) as e:
        p.error(f"--sizes/--factor: {e}")
    args.backends = args.backends or [NATIVE_BACKEND[args.device]]
    if args.write_crossovers and (NATIVE_BACKEND[args.device] not in args.backends
                                  or not {"one_shot", "two_shot"} <= set(args.algos)):
        p.error(f"--write-crossovers needs the {NATIVE_BACKEND[args.device]} backend and the one_shot and "
                f"two_shot algos among those measured")
    if args.iters < 1 or args.warmup < 0 or args.nproc < 1 or args.repeat < 1:
        p.error("--iters, --repeat must be >= 1, --warmup >= 0, --nproc >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible")
    if args.compare_deepspeed and args.device != "cpu":
        p.error("--compare-deepspeed compares DeepSpeed's CPU shared-memory all-reduce; use --device cpu")
    if args.mpi and args.device != "cpu":
        p.error("--mpi compares an MPI's CPU all-reduce; use --device cpu")
    if not args.crossovers_file.is_file():
        p.error(f"--crossovers-file {args.crossovers_file}: no such file (start from a copy of "
                f"{policy.CROSSOVERS_FILE}, whose default rows the policy falls back to)")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot needs matplotlib (pip install matplotlib, or pyallreduce[plot])")
    return args


# ---- inputs and checks -----------------------------------------------------------

# Inputs are made and results checked on the host (the emulated CUDA runtime
# runs no torch kernel; on a GPU it costs only setup time).

def make_input(count, dtype, rank, device):
    return (torch.arange(count, dtype=torch.int32) % INPUT_PERIOD + rank).to(dtype).to(device)


def expected_output(count, dtype, op, world):
    """Exact (on the host): integer sum; avg divides in fp32 before the cast, as the kernels do."""
    total = (torch.arange(count, dtype=torch.int32) % INPUT_PERIOD) * world + world * (world - 1) // 2
    total = total.to(torch.float32)
    return (total / world if op == "avg" else total).to(dtype)


def group_sum(t, through_host, divisor=1):
    """t = dist.all_reduce(t) (SUM), divided by divisor; through a host copy on
    the emulated CUDA runtime (which runs no torch kernel)."""
    work = t.cpu() if through_host else t
    dist.all_reduce(work, op=dist.ReduceOp.SUM)
    if divisor != 1:
        work.div_(divisor)
    if work is not t:
        t.copy_(work)


def reference_call(op, world, through_host):
    """The reference collective as a user would call it, in place. gloo has no
    AVG, so there it is SUM and a division (what Communicator's fallback does)."""
    native_avg = dist.get_backend() == "nccl"

    def call(t):
        if op == "avg" and native_avg:
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
        else:
            group_sum(t, through_host, world if op == "avg" else 1)
    return call


def reference_result(x, op, world, through_host):
    """The reference collective's sum (on the host), divided like `expected_output`,
    so it can be compared bit for bit (NCCL's AVG pre-scales in the element type)."""
    t = x.clone()
    group_sum(t, through_host)
    t = t.cpu()
    return (t.float() / world).to(t.dtype) if op == "avg" else t


def count_wrong(got, *wants):
    got = got.cpu()
    bad = torch.zeros(got.shape, dtype=torch.bool)
    for want in wants:
        bad |= got != want.cpu()
    return int(bad.sum())


# ---- timing ------------------------------------------------------------------------

def time_cpu(fns, iters, warmup):
    """Per-call microseconds of each of fns (name -> fn), timed in turns of
    iters / ALTERNATIONS calls each, so that all of them meet the same phases
    of a shared machine (this VM's speed changes several-fold within seconds,
    for every library at once): their ratio, not the phase, is what a row shows."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    dist.barrier()
    times = {name: [] for name in fns}
    turn = -(-iters // ALTERNATIONS)
    for start in range(0, iters, turn):
        for name, fn in fns.items():
            for _ in range(min(turn, iters - start)):
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e6)
    return times


def time_cuda(fn, iters, warmup, graph_batch, capture):
    """Per-iteration microseconds from CUDA events; with graph_batch, one
    iteration replays a captured graph of graph_batch calls, captured inside
    capture() (comm.capture for ours: the replays then read inputs in place)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as graph capture wants
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    run, per_iter = fn, 1
    if graph_batch:
        graph = torch.cuda.CUDAGraph()
        with capture(), torch.cuda.graph(graph):
            for _ in range(graph_batch):
                fn()
        graph.replay()  # first replay uploads the graph
        run, per_iter = graph.replay, graph_batch
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e3 / per_iter for start, end in events]


class Timer:
    """Times fn; capture: the context CUDA graphs of fn are captured in (None:
    fn cannot be captured, as the emulation's host-copy reference)."""

    def __init__(self, args, device):
        self.args, self.device = args, device
        self.emulated = device.type == "cuda" and emulated_cuda()
        # Where the ranks' small bookkeeping reductions run (gloo on the emulation: host tensors).
        self.group_device = torch.device("cpu") if self.emulated else device

    def __call__(self, fn, nbytes, capture=contextlib.nullcontext):
        a = self.args
        if self.device.type == "cuda":
            batch = GRAPH_BATCH if nbytes <= a.graph_max_bytes and capture is not None else 0
            times = time_cuda(fn, a.iters, a.warmup, batch, capture)
        else:
            times = time_cpu({"fn": fn}, a.iters, a.warmup)["fn"]
        return slowest_rank_stats(times, self.group_device)

    def interleaved(self, fns, nbytes):
        """CPU: the stats of each of fns (name -> fn), timed in turns (time_cpu)."""
        times = time_cpu(fns, self.args.iters, self.args.warmup)
        return {name: with_bandwidth(slowest_rank_stats(t, self.group_device), nbytes, dist.get_world_size())
                for name, t in times.items()}


def slowest_rank_stats(times, device):
    """The slowest rank counts: per-iteration MAX over the group, then quantiles."""
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    p10, p50, p90 = torch.quantile(t.cpu(), torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
    return {"time_us": p50, "p10_us": p10, "p90_us": p90}


def with_bandwidth(stats, nbytes, world):
    algbw = nbytes / stats["time_us"] / 1e3  # bytes/us -> GB/s
    return dict(stats, algbw=algbw, busbw=algbw * 2 * (world - 1) / world)


def sum_over_group(value, device):
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t)
    return int(t.item())


# ---- DeepSpeed ---------------------------------------------------------------------

class DeepSpeedShm:
    """DeepSpeed's CPU shm all-reduce, set up as deepspeed/comm/torch.py does
    (ShareMemCommBuilder().load(), initialize(world, rank))."""

    def __init__(self, rank, world, isa):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ["LOCAL_SIZE"] = str(world)  # DeepSpeed uses shm only when LOCAL_SIZE == world size
        try:
            from deepspeed.accelerator import get_accelerator
        except ImportError as e:
            raise SystemExit(f"--compare-deepspeed: cannot import deepspeed ({e}); install it elsewhere, e.g. "
                             f"pip install --target DIR deepspeed, and run with PYTHONPATH=DIR") from None
        import deepspeed

        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is None:
            raise SystemExit("--compare-deepspeed: DeepSpeed has no ShareMemCommBuilder for this accelerator")
        if isa == "avx2":  # what its builder picks on an AVX2-only machine (op_builder/builder.py)
            builder.name += "_avx2"
            builder.cpu_arch = lambda: "-march=haswell"
            builder.simd_width = lambda: "-D__AVX256__"
        elif isa != "native":
            raise SystemExit(f"--compare-deepspeed: no DeepSpeed build for --isa {isa}")
        # The first load JIT-compiles (minutes); rank 0 alone, since ranks
        # compiling into the same extension directory at once race.
        started = time.perf_counter()
        if rank == 0:
            self.module = builder.load(verbose=False)
        dist.barrier()
        if rank != 0:
            self.module = builder.load(verbose=False)
        self.load_s = time.perf_counter() - started
        self.module.initialize(world, rank)
        self.level = self.module.vector_kernel_level()
        self.version = deepspeed.__version__
        # DeepSpeed never unlinks its segment (shm.cpp names it like this).
        self.shm_path = Path("/dev/shm") / (f"deepspeed_allreduce_buffer_{os.getuid()}_"
                                            f"{os.environ['MASTER_ADDR']}_{os.environ['MASTER_PORT']}_{rank}")

    def supports(self, dtype, op):
        return op == "sum" and self.level >= DEEPSPEED_LEVEL[dtype]

    def __call__(self, t):
        torch.ops.deepspeed.inference_all_reduce_(t)

    def describe(self):
        return {"version": self.version, "vector_kernel_level": self.level, "load_seconds": round(self.load_s, 1)}

    def close(self):
        self.shm_path.unlink(missing_ok=True)


# ---- the measurement ------------------------------------------------------------------

def measure_size(comm, table, args, dtype_name, op, nbytes, device, timer, cache, deepspeed, mpi):
    """One size on one backend: correctness round, then timing, for every
    algo; returns the rows and the group's total of wrong elements. `cache`
    keeps the reference and bound timings, which do not depend on the backend."""
    world, rank = comm.world_size, comm.rank
    dtype = DTYPES[dtype_name]
    elem = torch.empty((), dtype=dtype).element_size()
    count = nbytes // elem
    nbytes = count * elem
    x = make_input(count, dtype, rank, device)
    want = expected_output(count, dtype, op, world)
    group = timer.group_device

    ref_out = reference_result(x, op, world, timer.emulated)
    ref_wrong = sum_over_group(count_wrong(ref_out, want), group)
    key = ("reference", dtype_name, op, nbytes)
    if key not in cache:
        call, work = reference_call(op, world, timer.emulated), x.clone()
        capture = None if timer.emulated else contextlib.nullcontext
        cache[key] = with_bandwidth(timer(lambda: call(work), nbytes, capture), nbytes, world)
    ref = dict(cache[key], wrong=ref_wrong)
    # The other CPU all-reduces (OTHERS), each checked here and timed beside
    # our in-place call, row by row: name -> (fn, its wrong elements).
    others = {}
    if deepspeed is not None and deepspeed.supports(dtype, op):
        ds_work = x.clone()
        deepspeed(ds_work)
        others["deepspeed"] = (lambda: deepspeed(ds_work), sum_over_group(count_wrong(ds_work, want), group))
    if mpi is not None:
        mpi_work = x.clone()
        mpi.call(mpi_work, op)()
        others["mpi"] = (mpi.call(mpi_work, op), sum_over_group(count_wrong(mpi_work, want), group))
    bound = None
    if device.type == "cpu":
        key = ("bound", nbytes)
        if key not in cache:
            cache[key] = measure_bound(nbytes, world, device, timer)
        bound = cache[key]

    rows, total_wrong = [], 0
    # "auto" runs the table's policy, reference fallback included; a named
    # algorithm always runs our kernels (Communicator's rule).
    comm.crossover = table
    for algo in args.algos:
        out = torch.empty_like(x)
        comm.all_reduce(x, op=op, algo=algo, out=out)
        inplace = x.clone()
        comm.all_reduce_(inplace, op=op, algo=algo)
        wrong = (count_wrong(out, want, ref_out) + count_wrong(inplace, want, ref_out)
                 + count_wrong(x, make_input(count, dtype, rank, device)))  # out-of-place keeps its input

        oop = timer(lambda: comm.all_reduce(x, op=op, algo=algo, out=out), nbytes, comm.capture)
        wrong += count_wrong(out, want)  # still right after many back-to-back (or replayed) calls
        in_place = lambda: comm.all_reduce_(inplace, op=op, algo=algo)  # noqa: E731
        beside = {}
        if others:
            beside = timer.interleaved({"ours": in_place, **{name: fn for name, (fn, _) in others.items()}}, nbytes)
            ip = beside.pop("ours")
        else:
            ip = with_bandwidth(timer(in_place, nbytes, comm.capture), nbytes, world)
        wrong = sum_over_group(wrong, group)
        total_wrong += wrong
        rows.append({
            "backend": comm.backend, "size": nbytes, "count": count, "type": dtype_name, "redop": op,
            "algo": algo, "out_of_place": with_bandwidth(oop, nbytes, world),
            "in_place": ip, "reference": ref, "speedup": ref["time_us"] / ip["time_us"], "wrong": wrong,
            **{name: dict(beside[name], wrong=others[name][1]) if name in others else None for name, _ in OTHERS},
            "bound": bound, "pct_of_bound": 100 * bound["time_us"] / ip["time_us"] if bound else None,
        })
    return rows, total_wrong


def bound_copy_bytes(nbytes, world):
    """The least memory traffic per rank of an all-reduce of nbytes on `world`
    ranks over shared memory, as the length of a copy (one read and one write
    per byte) with the same traffic. Model: two-shot with no wasted pass; each
    rank copies the W-1 slices of its input that peers reduce into shared
    memory (its own slice it reads in place), reads the W sources of its own
    slice, writes the result twice (to its output, and to shared memory for the
    peers), and copies the other W-1 reduced slices to its output:
        reads  S (W-1)/W + S + S (W-1)/W,   writes S (W-1)/W + 2 S/W + S (W-1)/W.
    For W = 2 that is 2S read and 2S written: a copy of 2S. One-shot needs
    more (every rank reads all W inputs); one rank is a copy of S."""
    if world == 1:
        return nbytes
    share = (world - 1) / world
    reads = nbytes * (2 * share + 1)
    writes = nbytes * (2 * share + 2 / world)
    return int(round((reads + writes) / 2))


def measure_bound(nbytes, world, device, timer):
    """The bandwidth bound of an all-reduce of nbytes: torch copy_ of
    bound_copy_bytes on every rank at once, timed like the collective."""
    n = bound_copy_bytes(nbytes, world)
    src = torch.ones(n, dtype=torch.uint8).to(device)
    dst = torch.empty_like(src)
    return dict(timer(lambda: dst.copy_(src), n), copy_bytes=n)


def measure_memcpy(nbytes, device, timer):
    """torch copy_ of the largest size on every rank at once (the same memory
    traffic conditions as the collective); bytes copied per second per rank."""
    src = torch.ones(nbytes, dtype=torch.uint8).to(device)
    dst = torch.empty_like(src)
    stats = timer(lambda: dst.copy_(src), nbytes)
    return dict(stats, bytes=nbytes, gbps=nbytes / stats["time_us"] / 1e3)


# ---- reporting -------------------------------------------------------------------------

HEADER = (f"#{'':>47}{'out-of-place':>26}{'in-place':>26}{'reference':>10}\n"
          f"#{'size':>11}{'count':>12}{'type':>9}{'redop':>6}{'algo':>10}"
          f"{'time':>10}{'algbw':>8}{'busbw':>8}{'time':>10}{'algbw':>8}{'busbw':>8}{'time':>10}"
          f"{'speedup':>8}{'#wrong':>8}")
UNITS = (f"#{'(B)':>11}{'(elements)':>12}{'':>25}"
         f"{'(us)':>10}{'(GB/s)':>8}{'(GB/s)':>8}{'(us)':>10}{'(GB/s)':>8}{'(GB/s)':>8}{'(us)':>10}")


# The other CPU all-reduces a row may carry (row key, column title): their
# in-place time, and for MPI its own count of wrong elements.
OTHERS = (("deepspeed", "deepspeed"), ("mpi", "mpi"))


def table_header(others):
    extra = "".join(f"{title:>11}" + (f"{'#wrong':>7}" if key == "mpi" else "") for key, title in OTHERS
                    if key in others)
    units = "".join(f"{'(us)':>11}" + (f"{'':>7}" if key == "mpi" else "") for key, _ in OTHERS if key in others)
    # %bound: the in-place time's share of the bandwidth bound (bound_copy_bytes), CPU only
    return f"{HEADER}{extra}{'%bound':>8}\n{UNITS}{'':>16}{units}"


def format_row(r, others):
    o, i, ref = r["out_of_place"], r["in_place"], r["reference"]
    line = (f" {r['size']:>11}{r['count']:>12}{r['type']:>9}{r['redop']:>6}{r['algo']:>10}"
            f"{o['time_us']:>10.1f}{o['algbw']:>8.2f}{o['busbw']:>8.2f}"
            f"{i['time_us']:>10.1f}{i['algbw']:>8.2f}{i['busbw']:>8.2f}"
            f"{ref['time_us']:>10.1f}{r['speedup']:>8.2f}{r['wrong']:>8}")
    for key, _ in OTHERS:
        if key in others:
            stats = r[key]
            line += f"{stats['time_us']:>11.1f}" if stats else f"{'n/a':>11}"
            if key == "mpi":
                line += f"{stats['wrong']:>7}"
    line += f"{r['pct_of_bound']:>8.0f}" if r.get("pct_of_bound") is not None else f"{'':>8}"
    return line


def machine_description(device, world):
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(), "cpu": policy.cpu_model(), "cores": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "pyallreduce": pyallreduce.__version__, "python": platform.python_version(),
        "world_size": world, "device": str(device), "device_kind": policy.device_kind(device),
        "cores_of_rank_0": sorted(os.sched_getaffinity(0)),
    }
    if device.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(device), cuda_runtime=torch.version.cuda,
                    nccl=".".join(map(str, torch.cuda.nccl.version())), driver=nvidia_driver(),
                    emulated=emulated_cuda())
    return info


def nvidia_driver():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, bw) = plt.subplots(1, 2, figsize=(13, 5))
    series = {}
    for r in rows:
        tag = f"{r['type']} {r['redop']}"
        for name, stats in ((f"{r['backend']} {r['algo']}", r["in_place"]), ("reference", r["reference"]),
                            ("deepspeed", r["deepspeed"]), ("mpi", r.get("mpi"))):
            if stats:
                series.setdefault(f"{name} ({tag})", {})[r["size"]] = stats
    for label, points in sorted(series.items()):
        sizes = sorted(points)
        style = "--" if label.startswith(("reference", "deepspeed", "mpi")) else "-"
        lat.plot(sizes, [points[s]["time_us"] for s in sizes], style, marker=".", label=label)
        bw.plot(sizes, [points[s]["busbw"] for s in sizes], style, marker=".", label=label)
    for ax, ylabel in ((lat, "in-place time (us)"), (bw, "busbw (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    lat.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---- crossovers ------------------------------------------------------------------------

def derive_crossover(rows, backend):
    """From the native backend's rows: per size and run, in-place medians
    summed over the measured dtypes and ops; a side wins at a size when it is
    faster in the median run (by time ratio, so one run in a slow phase of a
    shared host does not decide; two-shot must win by policy.TWO_SHOT_MARGIN). A
    crossover is the smallest size from which that side wins at every larger
    measured size."""
    totals = {}  # size -> run -> summed times
    for r in rows:
        if r["backend"] != backend:
            continue
        t = totals.setdefault(r["size"], {}).setdefault(r.get("run", 0), {})
        t[r["algo"]] = t.get(r["algo"], 0.0) + r["in_place"]["time_us"]
        if r["algo"] == "one_shot":  # the reference once per (size, dtype, op, run)
            t["reference"] = t.get("reference", 0.0) + r["reference"]["time_us"]
    sizes = sorted(s for s, runs in totals.items() if all("one_shot" in t and "two_shot" in t for t in runs.values()))
    if not sizes:
        raise ValueError(f"no size has both one_shot and two_shot rows of the {backend} backend")

    def median_ratio(size, ratio):
        values = sorted(ratio(t) for t in totals[size].values())
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2

    two_shot = policy.winning_tail_start(
        sizes, lambda s: median_ratio(s, lambda t: t["one_shot"] / t["two_shot"]) > policy.TWO_SHOT_MARGIN)
    reference = policy.winning_tail_start(
        sizes, lambda s: median_ratio(s, lambda t: min(t["one_shot"], t["two_shot"]) / t["reference"]) > 1.0)
    return {"two_shot_min_bytes": policy.NEVER if two_shot is None else two_shot,
            "reference_min_bytes": reference, "measured": True}


def write_crossovers(path, kind, world, row):
    table = json.loads(path.read_text())
    table.setdefault(kind, {})[str(world)] = row
    path.write_text(json.dumps(table, indent=2) + "\n")


# ---- main ------------------------------------------------------------------------------

def run(args):
    device = init_group(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    kind = policy.device_kind(device)
    timer = Timer(args, device)
    deepspeed = DeepSpeedShm(rank, world, args.isa) if args.compare_deepspeed else None
    mpi = MpiAllreduce(args.mpi) if args.mpi else None
    others = [key for key, present in (("deepspeed", deepspeed), ("mpi", mpi)) if present]
    say = print if rank == 0 else (lambda *a, **k: None)

    machine = machine_description(device, world)
    say(f"# pyallreduce {pyallreduce.__version__} vs torch.distributed ({dist.get_backend()}), "
        f"world size {world}, {machine['device_kind']}, OMP_NUM_THREADS={machine['omp_num_threads']}")
    if timer.emulated:
        say("# EMULATED CUDA runtime (tests/emulated): the GPU code path checked for correctness; the times are "
            "host threads', not a GPU's, and the reference is gloo through host copies")
    if deepspeed:
        say(f"# DeepSpeed {deepspeed.version} shm all-reduce: vector_kernel_level {deepspeed.level}, "
            f"loaded in {deepspeed.load_s:.0f} s")
    if mpi:
        say(f"# MPI: {mpi.version} (MPI_Allreduce in place through mpi4py; 16-bit types as fp32 copies)")
    rows, wrong = [], 0
    for run_index in range(args.repeat):
        cache = {}  # reference and bound timings: once per run
        for backend in args.backends:
            comm = pyallreduce.Communicator(device=device, backend=backend, max_bytes=args.max_bytes)
            table = policy.lookup(kind, world, path=args.crossovers_file)
            say(f"#\n# run {run_index + 1} of {args.repeat}, backend {backend}: {comm!r}\n# auto uses {table}")
            say(table_header(others))
            for dtype_name in args.dtypes:
                for op in args.ops:
                    for nbytes in args.sizes:
                        found, n = measure_size(comm, table, args, dtype_name, op, nbytes, device, timer, cache,
                                                deepspeed, mpi)
                        for r in found:
                            r["run"] = run_index
                            say(format_row(r, others), flush=True)
                        rows += found
                        wrong += n
            comm.close()

    memcpy = measure_memcpy(max(args.sizes), device, timer)
    say(f"# memcpy (torch copy_ of {memcpy['bytes']} B, all ranks at once): {memcpy['time_us']:.1f} us, "
        f"{memcpy['gbps']:.2f} GB/s per rank")
    say(f"# wrong elements: {wrong} {'FAILED' if wrong else 'OK'}")
    if rank == 0:
        if args.json:
            report = {"machine": machine, "args": {k: str(v) if isinstance(v, Path) else v
                                                   for k, v in vars(args).items()},
                      "memcpy": memcpy, "deepspeed": deepspeed.describe() if deepspeed else None,
                      "mpi": mpi.describe() if mpi else None, "rows": rows}
            args.json.write_text(json.dumps(report, indent=2) + "\n")
        if args.plot:
            plot(rows, args.plot)
        if args.write_crossovers and not wrong:
            native = NATIVE_BACKEND[device.type]
            row = derive_crossover(rows, native)
            write_crossovers(args.crossovers_file, kind, world, row)
            say(f"# crossovers for {kind}, world size {world} -> {args.crossovers_file}: {row}")
    dist.barrier()
    if deepspeed:
        deepspeed.close()
    dist.destroy_process_group()
    if wrong:
        if rank == 0:
            print(f"compare_nccl.py: {wrong} wrong elements; see the #wrong column", file=sys.stderr)
        return 1
    return 0


def main():
    args = parse_args()
    if args.isa != "native":  # before pyallreduce's kernels first run; the spawned ranks inherit it
        os.environ["PYALLREDUCE_CPU_ISA"] = args.isa
    if not (under_torchrun() or adopt_mpi_rank()):
        return spawn_ranks(__file__, args.nproc, bind_cores=args.device == "cpu", mpi=args.mpi)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
