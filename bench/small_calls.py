"""Where a small CPU all-reduce's time goes, from the floors up, in one run:

    python bench/small_calls.py                       # 2 ranks, 256 B and 4 KiB fp32
    python bench/small_calls.py --nproc 2 --sizes 256,4K --json bench/results/small-calls-cpu-2ranks.json

Each ladder step adds one layer to the one below it:
  cache line        one cache line bounced between two of the ranks' cores (bench/floor,
                    C, two threads): the hardware's floor for a flag round trip
  _C call           a do-nothing call into pyallreduce._C from Python (pybind11)
  barrier           _C.agree: the protocol's start barrier alone (descriptors
                    published, flags signalled, peers' awaited and compared), from Python
  C++ entry         the communicator's C++ all-reduce callable (_C.eager_all_reduce):
                    the whole call, decisions included, from Python
  comm one_shot     Communicator.all_reduce_(t, algo="one_shot"): the public call
  comm auto         Communicator.all_reduce_(t): the public call, the crossover deciding
Per step, the time per call is the slowest rank's over a batch of back-to-back
calls divided by the batch (the clock read per call would be a sizeable part
of a microsecond), median and p90 over the batches.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import pyallreduce
from pyallreduce import _C

from compare_nccl import machine_description
from local_ranks import add_launch_arguments, init_group, spawn_ranks, under_torchrun

HERE = Path(__file__).resolve().parent
BATCH = 200  # calls per timed batch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_launch_arguments(p, nproc=2, device="cpu")
    p.add_argument("--sizes", default="256,4K", help="comma list of fp32 sizes in bytes, K suffix (default 256,4K)")
    p.add_argument("--batches", type=int, default=100, help=f"timed batches of {BATCH} calls per step (default 100)")
    p.add_argument("--json", type=Path, help="write the machine and every step here")
    args = p.parse_args(argv)
    args.sizes = [int(s[:-1]) * 1024 if s.upper().endswith("K") else int(s) for s in args.sizes.split(",")]
    return args


def cache_line_round_trip_ns(core_a, core_b):
    """The C floor between two cores (bench/floor/cache_line_round_trip.c)."""
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "rt"
        subprocess.run(["cc", "-O2", "-pthread", str(HERE / "floor" / "cache_line_round_trip.c"), "-o", str(exe)],
                       check=True)
        out = subprocess.run([str(exe), str(core_a), str(core_b)], check=True, capture_output=True, text=True)
    return float(out.stdout)


def time_step(call, batches):
    """Per-call microseconds of the slowest rank, per batch."""
    for _ in range(BATCH):
        call()
    dist.barrier()
    per_call = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(BATCH):
            call()
        per_call.append((time.perf_counter() - t0) / BATCH * 1e6)
    t = torch.tensor(per_call, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    median, p90 = torch.quantile(t, torch.tensor([0.5, 0.9], dtype=torch.float64)).tolist()
    return {"time_us": median, "p90_us": p90}


def run(args):
    init_group("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    comm = pyallreduce.Communicator(device="cpu")
    handle, entry = comm._engine.handle, comm._eager.all_reduce
    # The floor between ranks 0's and 1's cores; none where they share one.
    cores = [None] * world
    dist.all_gather_object(cores, sorted(os.sched_getaffinity(0)))
    floor_us = None
    if world > 1 and not set(cores[0]) & set(cores[1]):
        floor = torch.tensor([cache_line_round_trip_ns(cores[0][0], cores[1][0]) / 1e3 if rank == 0 else 0.0],
                             dtype=torch.float64)
        dist.broadcast(floor, 0)
        floor_us = floor.item()
    machine = machine_description(torch.device("cpu"), world)
    say(f"# pyallreduce {pyallreduce.__version__}, {world} ranks, {machine['cpu']}")
    say(f"# cache line round trip between the ranks' cores: "
        f"{'n/a (ranks share cores)' if floor_us is None else f'{floor_us * 1e3:.0f} ns'}")
    code = _C.dtype_code(torch.float32)
    results = []
    for nbytes in args.sizes:
        t = torch.zeros(nbytes // 4)  # zeros stay zeros however often summed (no inf, no denormals)
        steps = [
            ("_C call", lambda: _C.cpu_isa()),
            ("barrier", lambda: _C.agree(handle, code, nbytes, 0, False, True)),
            ("C++ entry", lambda: entry(t, t, "sum", "one_shot")),
            ("comm one_shot", lambda: comm.all_reduce_(t, algo="one_shot")),
            ("comm auto", lambda: comm.all_reduce_(t)),
        ]
        say(f"#\n# {nbytes} B fp32 ({'auto: ' + comm.crossover.algo_for(nbytes)})\n"
            f"# {'step':<16}{'median us':>10}{'p90 us':>10}{'added us':>10}")
        below = 0.0
        for name, call in steps:
            stats = time_step(call, args.batches)
            say(f"  {name:<16}{stats['time_us']:>10.3f}{stats['p90_us']:>10.3f}{stats['time_us'] - below:>10.3f}")
            below = stats["time_us"]
            results.append(dict(stats, size=nbytes, step=name))
        t.fill_(rank + 1)  # the result checked exactly, so a fast wrong path cannot pass
        comm.all_reduce_(t)
        if not torch.equal(t, torch.full_like(t, world * (world + 1) // 2)):
            raise SystemExit(f"rank {rank}: wrong all-reduce result at {nbytes} B")
    if rank == 0 and args.json:
        args.json.write_text(json.dumps({"machine": machine, "cache_line_round_trip_us": floor_us, "batch": BATCH,
                                         "rows": results}, indent=2) + "\n")
    comm.close()
    dist.destroy_process_group()
    return 0


def main():
    args = parse_args()
    if not under_torchrun():
        return spawn_ranks(__file__, args.nproc, bind_cores=True)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
