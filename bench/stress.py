"""Stress: thousands of all-reduces with random sizes, dtypes, ops, algorithms,
layouts and per-rank delays, every result checked bit for bit; then no leaked
shared memory and flat memory use.

    python bench/stress.py                                   # 4 CPU ranks, 10,000 calls
    python bench/stress.py --nproc 4 --calls 500 --json out.json
    torchrun --nproc-per-node=8 bench/stress.py --device cuda

Every rank draws the same sequence of calls from --seed and sleeps its own random
delays before them, so the ranks arrive in every order. Inputs are either small
integers (every sum exact in every dtype) or random floats, whose expected result
is the library's definition: an fp32 sum in rank order, divided by the world size
for avg, cast once. dtypes pyallreduce does not reduce (float64, int32) go through
the torch.distributed fallback in the same stream of calls.

Exit status 1 on any wrong result, leaked segment, or memory growth past --slack-mib.
"""
import argparse
import ctypes
import ctypes.util
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import pyallreduce
from pyallreduce.protocol import REDUCED_DTYPES
from pyallreduce.transport.host_shm import leaked_segments
from local_ranks import add_launch_arguments, init_group, spawn_ranks, under_torchrun

FAST_DTYPES = REDUCED_DTYPES  # the kernels' dtypes
FALLBACK_DTYPES = (torch.float64, torch.int32)
FALLBACK_SHARE = 0.05
RANDOM_FLOAT_SHARE = 0.25
ALGOS = ("auto", "one_shot", "two_shot")
LAYOUTS = ("contiguous", "transposed", "offset_view", "scalar")
LAYOUT_WEIGHTS = (0.8, 0.1, 0.07, 0.03)
CALL_STYLES = ("out_of_place", "in_place", "out")
SAMPLES = 10  # memory readings, one per tenth of the run
try:
    LIBC = ctypes.CDLL(ctypes.util.find_library("c"))
    LIBC.malloc_trim  # glibc only
except (OSError, AttributeError, TypeError):
    LIBC = None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_launch_arguments(p, nproc=4, device="cpu")
    p.add_argument("--calls", type=int, default=10_000)
    p.add_argument("--backend", default="auto", choices=("auto", "cpu", "cuda", "triton"))
    # The defaults reach both kinds of splitting: Communicator's chunks of max_bytes
    # and, above 256 KiB, the CPU backend's protocol rounds.
    p.add_argument("--max-bytes", type=int, default=512 << 10,
                   help="the communicator's max_bytes; larger messages are chunked (default 512 KiB)")
    p.add_argument("--largest", type=int, default=2 << 20, help="largest message in bytes (default 2 MiB)")
    p.add_argument("--max-delay-ms", type=float, default=1.0, help="longest random delay before a call")
    p.add_argument("--delay-share", type=float, default=0.2, help="share of calls a rank delays")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0, help="the communicator's deadline in seconds")
    p.add_argument("--slack-mib", type=float, default=8.0,
                   help="allowed growth of a rank's resident memory between the run's first and second half "
                        "(medians of the readings; default 8 MiB)")
    p.add_argument("--json", type=Path, help="write the summary here")
    args = p.parse_args(argv)
    if args.calls < SAMPLES or args.largest < 1 or args.max_bytes < 1 or args.nproc < 1:
        p.error(f"--calls must be >= {SAMPLES}; --largest, --max-bytes, --nproc >= 1")
    return args


# ---- one call ----------------------------------------------------------------------

def draw_call(plan, largest):
    """The next call, the same on every rank."""
    if plan.random() < FALLBACK_SHARE:
        dtype = plan.choice(FALLBACK_DTYPES)
    else:
        dtype = plan.choice(FAST_DTYPES)
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = int(2 ** plan.uniform(0, largest.bit_length()))  # log-uniform: small sizes matter most
    numel = min(nbytes, largest) // elem
    algo = plan.choice(ALGOS)
    return dict(dtype=dtype, numel=numel,
                op="sum" if not dtype.is_floating_point else plan.choice(("sum", "avg")),
                algo=algo, style=plan.choice(CALL_STYLES), layout=plan.choices(LAYOUTS, LAYOUT_WEIGHTS)[0],
                # "auto" may hand large messages to torch.distributed, whose float
                # sums are not in rank order; a named algorithm always runs ours.
                random_floats=dtype in FAST_DTYPES and algo != "auto" and plan.random() < RANDOM_FLOAT_SHARE,
                salt=plan.randrange(1 << 20))


def flat_input(call, rank, device):
    n, dtype = call["numel"], call["dtype"]
    if call["random_floats"]:
        g = torch.Generator().manual_seed(call["salt"] * 64 + rank)
        return torch.randn(n, generator=g).to(dtype).to(device)
    # |x| <= 4: any sum over <= 8 ranks is exact in every dtype.
    i = torch.arange(n, dtype=torch.int64)
    return ((i * 7 + call["salt"] + rank * 5) % 9 - 4).to(dtype).to(device)


def expected(call, world, device):
    inputs = [flat_input(call, q, "cpu") for q in range(world)]
    dtype = call["dtype"]
    if dtype in FAST_DTYPES:  # the definition: fp32 sum in rank order, / W, one cast
        acc = inputs[0].float()
        for x in inputs[1:]:
            acc = acc + x.float()
    else:  # the fallback reduces in the dtype itself; these inputs are exact there
        acc = sum(inputs[1:], inputs[0].clone())
    if call["op"] == "avg":
        acc = acc / world
    return acc.to(dtype).to(device)


GUARD = 99  # the storage around an offset view: must be left alone


def guarded(n, like):
    """A view of n elements in the middle of a larger storage filled with GUARD,
    and a check that nothing outside the view was written."""
    storage = torch.full((n + 5,), GUARD, dtype=like.dtype, device=like.device)
    view = storage[3:3 + n]
    return view, lambda: bool((storage[:3] == GUARD).all() and (storage[3 + n:] == GUARD).all())


def shaped(flat, layout):
    """The same elements in the layout under test, the way back to flat order, and
    a check that the layout's surroundings are intact."""
    n = flat.numel()
    if layout == "transposed" and n % 2 == 0 and n > 0:
        t = flat.view(2, n // 2).t()  # non-contiguous
        return t, lambda r: r.t().reshape(-1), lambda: True
    if layout == "offset_view":
        view, intact = guarded(n, flat)
        view.copy_(flat)
        return view, lambda r: r.reshape(-1), intact
    if layout == "scalar" and n > 0:
        return flat[0].clone().reshape(()), lambda r: r.reshape(1), lambda: True
    return flat, lambda r: r.reshape(-1), lambda: True


def run_call(comm, call, rank, world, device):
    """Runs one call; returns None if it was right, else what went wrong."""
    x, to_flat, input_intact = shaped(flat_input(call, rank, device), call["layout"])
    out_intact = lambda: True  # noqa: E731
    want = expected(call, world, device)
    if call["layout"] == "scalar" and call["numel"] > 0:
        want = want[:1]
    kw = dict(op=call["op"], algo=call["algo"])
    if call["style"] == "in_place":
        got = comm.all_reduce_(x, **kw)
        if got is not x:
            return "all_reduce_ did not return its argument"
    elif call["style"] == "out":
        if call["layout"] == "offset_view":
            out, out_intact = guarded(x.numel(), x)
        else:
            out = torch.empty_like(x)
        out.fill_(77)
        got = comm.all_reduce(x, out=out, **kw)
        if got is not out:
            return "all_reduce(out=) did not return out"
    else:
        got = comm.all_reduce(x, **kw)
        x.fill_(-3)  # the caller may reuse its input at once
    if not (input_intact() and out_intact()):
        return "wrote outside the tensor's view"
    if got.shape != x.shape or got.dtype != x.dtype:
        return f"result has shape {tuple(got.shape)} {got.dtype}, input {tuple(x.shape)} {x.dtype}"
    flat = to_flat(got)
    if not torch.equal(flat, want):
        bad = (flat != want) & ~(flat.isnan() & want.isnan())
        return f"{int(bad.sum())} of {want.numel()} elements wrong"
    return None


def describe(i, call):
    return (f"call {i}: {str(call['dtype']).replace('torch.', '')} numel={call['numel']} op={call['op']} "
            f"algo={call['algo']} {call['style']} {call['layout']}{' random' if call['random_floats'] else ''}")


# ---- memory and leaks --------------------------------------------------------------

def resident_mib():
    """This process's resident memory after glibc hands its free pages back, so
    that what malloc keeps cached does not read as growth."""
    if LIBC is not None:
        LIBC.malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def growth(samples):
    """Median of the second half minus median of the first: a leak grows steadily,
    noise does not."""
    if not samples:
        return 0.0
    half = len(samples) // 2
    return round(statistics.median(samples[half:]) - statistics.median(samples[:half]), 3)


# ---- main ---------------------------------------------------------------------------

def run(args):
    device = init_group(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = random.Random(args.seed)  # the same calls on every rank
    delays = random.Random(args.seed * 1000 + rank + 1)  # different timing on every rank
    wrong, rss, cuda_mib, counts = [], [], [], {}
    started = time.perf_counter()
    with pyallreduce.Communicator(device=device, backend=args.backend, max_bytes=args.max_bytes,
                                  timeout=args.timeout) as comm:
        if rank == 0:
            print(f"# stress: {args.calls} calls, {world} ranks, {comm!r}", flush=True)
        for i in range(args.calls):
            call = draw_call(plan, args.largest)
            key = "fallback" if call["dtype"] not in FAST_DTYPES else call["algo"]
            counts[key] = counts.get(key, 0) + 1
            if delays.random() < args.delay_share:
                time.sleep(delays.uniform(0, args.max_delay_ms / 1000))
            problem = run_call(comm, call, rank, world, device)
            if problem:
                wrong.append(f"{describe(i, call)}: {problem}")
            if (i + 1) % (args.calls // SAMPLES) == 0:
                # Nothing from the calls is alive here (run_call's tensors died with it).
                rss.append(round(resident_mib(), 1))
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    cuda_mib.append(round(torch.cuda.memory_allocated(device) / 2**20, 3))
    elapsed = time.perf_counter() - started
    mine = dict(rank=rank, wrong=len(wrong), first_wrong=wrong[:5], rss_mib=rss, cuda_allocated_mib=cuda_mib,
                rss_growth_mib=growth(rss), cuda_growth_mib=growth(cuda_mib))
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    failed = False
    if rank == 0:
        total_wrong = sum(r["wrong"] for r in ranks)
        grew = [r["rank"] for r in ranks
                if r["rss_growth_mib"] > args.slack_mib or r["cuda_growth_mib"] > 0]
        for r in ranks:
            print(f"rank {r['rank']}: {r['wrong']} wrong; resident MiB per tenth {r['rss_mib']}"
                  + (f"; CUDA allocated MiB {r['cuda_allocated_mib']}" if r["cuda_allocated_mib"] else ""))
            for line in r["first_wrong"]:
                print(f"  {line}")
        print(f"# {args.calls} calls in {elapsed:.1f} s ({counts}); wrong results: {total_wrong}; "
              f"memory grew on ranks: {grew or 'none'}")
        failed = bool(total_wrong or grew)
        if args.json:
            args.json.write_text(json.dumps(dict(
                args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                world_size=world, device=str(device), backend=comm.backend, torch=torch.__version__,
                pyallreduce=pyallreduce.__version__, seconds=round(elapsed, 1), calls_by_algo=counts,
                wrong=total_wrong, memory_grew_on_ranks=grew, ranks=ranks), indent=2) + "\n")
    verdict = [failed]
    dist.broadcast_object_list(verdict, src=0)
    dist.destroy_process_group()
    return 1 if verdict[0] else 0


def main():
    args = parse_args()
    if under_torchrun():
        return run(args)
    before = set(leaked_segments())
    code = spawn_ranks(__file__, args.nproc)
    leaked = sorted(set(leaked_segments()) - before)
    print(f"# leaked shared-memory segments: {leaked or 'none'}")
    if args.json and args.json.exists():
        report = json.loads(args.json.read_text())
        report["leaked_segments"] = leaked
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if leaked else code


if __name__ == "__main__":
    sys.exit(main())
