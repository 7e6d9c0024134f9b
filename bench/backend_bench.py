"""The "pyallreduce" torch.distributed backend against gloo, on CPU: all-reduce,
reduce-scatter and all-gather through dist.* on a group of each backend, the
same calls on a pyallreduce.Communicator directly (the backend's overhead is
the difference), and torch's own floors: dist.* on a Python backend that does
nothing and returns a completed Work (what any Python backend pays), and on
torch's C++ fake backend (what any backend pays; the pyallreduce backend's
calls run in C++ once its Communicator exists, csrc/backend.cpp).

    python bench/backend_bench.py --nproc 2 --sizes 256:16M --json out.json   # spawns the ranks itself

Size is the larger tensor's bytes (all-reduce: the tensor; reduce-scatter: its
input; all-gather: its output), as nccl-tests counts them. Every size first
checks every path's result against the exact answer (small-integer inputs,
zero tolerance; a wrong element makes the run exit non-zero), then times it:
per iteration the slowest rank, median over iterations.
"""
import argparse
import json
import sys

import torch
import torch.distributed as dist

from torch._C._distributed_c10d import Backend as _C10dBackend

import pyallreduce
from pyallreduce.backend import _finished
from pyallreduce.reference import _dist_all_gather, _dist_reduce_scatter

from compare_nccl import machine_description, size_range, slowest_rank_stats, time_cpu
from local_ranks import add_launch_arguments, init_group, spawn_ranks, under_torchrun

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
# dist.* on gloo, dist.* on pyallreduce, Communicator methods, dist.* on the do-nothing
# Python backend, dist.* on torch's C++ fake backend
# torch 2.14 made c10d's Backend a class Python can subclass; before, the Python
# floor cannot be built ("No constructor defined") and its columns stay empty.
PYTHON_FLOOR = torch.__version__ >= (2, 14)  # a TorchVersion, which compares with tuples
PATHS = tuple(p for p in ("gloo", "backend", "direct", "floor", "cpp_floor") if PYTHON_FLOOR or p != "floor")
FLOOR = "pyallreduce_floor"


class FloorBackend(_C10dBackend):
    """torch.distributed's dispatch floor for a Python backend: every served
    collective does nothing and returns the pyallreduce backend's Work of a finished call."""

    def __init__(self, store, rank, world_size, timeout):
        super().__init__(rank, world_size)

    def getBackendName(self):
        return FLOOR

    def allreduce(self, tensors, opts):
        return _finished(tensors)

    def reduce_scatter_single(self, output, input, opts):
        return _finished([output])

    def all_gather_single(self, output, input, opts):
        return _finished([output])



def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_launch_arguments(p, nproc=2, device="cpu")
    p.add_argument("--sizes", default="256:16M", help="min:max bytes (suffixes K, M)")
    p.add_argument("--factor", type=int, default=4, help="size step factor")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--json", help="write the rows and the machine here")
    args = p.parse_args(argv)
    if args.device != "cpu":
        p.error("the backend benchmark runs on CPU (its CUDA path has not run on a GPU yet)")
    return args


def exact(numel, rank):
    """Small integers: every sum over the ranks is exact."""
    return ((torch.arange(numel) * 7 + 5 * rank) % 9 - 4).float()


def calls(collective, nbytes, rank, world, group, comm):
    """(run, result, want, before_timing) for one path: run() makes the call,
    result() returns what it wrote, want is the exact answer, before_timing()
    (or None) prepares the timed loop."""
    numel = max(world, nbytes // 4 // world * world)
    seg = numel // world
    if collective == "all_reduce":
        x = exact(numel, rank)
        want = sum(exact(numel, q) for q in range(world))
        buf = x.clone()
        run = (lambda: comm.all_reduce_(buf)) if comm else (lambda: dist.all_reduce(buf, group=group))
        return run, lambda: buf, want, buf.zero_  # in place: zeros stay zeros (no overflow) at the same speed
    if collective == "reduce_scatter":
        x = exact(numel, rank)
        out = torch.empty(seg)
        want = sum(exact(numel, q) for q in range(world))[rank * seg:(rank + 1) * seg]
        run = ((lambda: comm.reduce_scatter(x, out=out)) if comm
               else (lambda: _dist_reduce_scatter(out, x, group=group)))
        return run, lambda: out, want, None
    x = exact(seg, rank)
    out = torch.empty(numel)
    want = torch.cat([exact(seg, q) for q in range(world)])
    run = (lambda: comm.all_gather(x, out=out)) if comm else (lambda: _dist_all_gather(out, x, group=group))
    return run, lambda: out, want, None


def run(args):
    init_group("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    if PYTHON_FLOOR and FLOOR.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(FLOOR, FloorBackend, devices=["cpu"])
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

    groups = {"gloo": dist.new_group(backend="gloo"), "backend": dist.new_group(backend="pyallreduce"),
              "cpp_floor": dist.new_group(backend="fake")}
    if PYTHON_FLOOR:
        groups["floor"] = dist.new_group(backend=FLOOR)
    comm = pyallreduce.Communicator(groups["gloo"], device="cpu")
    rows, wrong_total = [], 0
    if rank == 0:
        print(f"# {machine_description(torch.device('cpu'), world)}")
        print(f"# {'collective':>14} {'size (B)':>10} {'gloo (us)':>11} {'backend':>10} {'direct':>10} "
              f"{'floor':>8} {'C++ floor':>9} {'vs gloo':>8} {'overhead':>9} {'over floor':>10} "
              f"{'over C++':>9} {'#wrong':>7}")
    for collective in COLLECTIVES:
        for nbytes in size_range(args.sizes, args.factor):
            row = {"collective": collective, "bytes": nbytes, "world": world}
            wrong = 0
            for path in PATHS:
                run_call, result, want, before_timing = calls(collective, nbytes, rank, world, groups.get(path),
                                                              comm if path == "direct" else None)
                run_call()
                if path not in ("floor", "cpp_floor"):  # they compute nothing
                    wrong += int((result() != want).sum())
                if before_timing:
                    before_timing()
                times = time_cpu({path: run_call}, args.iters, args.warmup)[path]
                row[f"{path}_us"] = slowest_rank_stats(times, torch.device("cpu"))["time_us"]
            row.setdefault("floor_us", None)
            t = torch.tensor([wrong])
            dist.all_reduce(t)
            row["wrong"] = int(t)
            wrong_total += row["wrong"]
            row["speedup_vs_gloo"] = row["gloo_us"] / row["backend_us"]
            row["overhead_us"] = row["backend_us"] - row["direct_us"]
            # The target (issue: backend <= direct + floor + 3 us): what is ours beyond torch's floor.
            row["over_floor_us"] = None if row["floor_us"] is None else row["overhead_us"] - row["floor_us"]
            row["over_cpp_floor_us"] = row["overhead_us"] - row["cpp_floor_us"]
            rows.append(row)
            if rank == 0:
                print(f"  {collective:>14} {nbytes:>10} {row['gloo_us']:>11.1f} {row['backend_us']:>10.1f} "
                      f"{row['direct_us']:>10.1f} {_us(row['floor_us']):>8} {row['cpp_floor_us']:>9.1f} "
                      f"{row['speedup_vs_gloo']:>7.1f}x {row['overhead_us']:>9.1f} {_us(row['over_floor_us']):>10} "
                      f"{row['over_cpp_floor_us']:>9.1f} {row['wrong']:>7}", flush=True)
    comm.close()
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_description(torch.device("cpu"), world), "iters": args.iters,
                       "rows": rows}, f, indent=1)
    dist.destroy_process_group()
    return 1 if wrong_total else 0


def _us(value):
    return "-" if value is None else f"{value:.1f}"


def main():
    args = parse_args()
    if not under_torchrun():
        return spawn_ranks(__file__, args.nproc, bind_cores=True)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
