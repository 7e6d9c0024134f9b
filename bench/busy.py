"""All-reduce on a machine that is not idle: more ranks than cores, and other
processes competing for them. Compares pyallreduce with gloo on the same loop.

    python bench/busy.py                                  # 4 CPU ranks; loads 0 and 2; writes nothing
    python bench/busy.py --nproc 4 --loads 0,2 --ddp --json bench/results/busy-cpu-4ranks.json

Each rank runs --iters iterations of: a slice of real compute (a small matmul
repeated k times, k drawn per rank and iteration from a schedule every rank
shares, so some ranks arrive late), then one all-reduce of the given size.
The loop time (slowest rank, wall clock, whole loop) is what a training job
sees: time a waiting rank spends spinning is time the late rank, or another
process, does not get. Conditions:

  load 0   only the ranks (with --nproc above the core count: oversubscribed)
  load N   N extra processes spinning on the CPU at the ranks' priority

With --ddp, bench/ddp_train.py also runs under each load (DDP's own gloo
all-reduce against pyallreduce's hook), --repeats times. Each condition runs
the two backends alternately, --repeats times, and reports the medians.
"""
import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from local_ranks import add_launch_arguments, init_group, spawn_ranks, under_torchrun

BACKENDS = ("pyallreduce", "gloo")
HERE = Path(__file__).resolve().parent


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_launch_arguments(p, nproc=4, device="cpu")
    p.add_argument("--sizes", default="4K,64K,1M", help="all-reduce sizes in bytes, fp32 (default 4K,64K,1M)")
    p.add_argument("--loads", default="0,2", help="numbers of extra spinning processes (default 0,2)")
    p.add_argument("--iters", type=int, default=150, help="loop iterations per measurement (default 150)")
    p.add_argument("--work", type=int, default=6,
                   help="most matmuls a rank does per iteration; each draws 0..work (default 6)")
    p.add_argument("--repeats", type=int, default=3, help="measurements per backend and size (default 3)")
    p.add_argument("--ddp", action="store_true", help="also run bench/ddp_train.py under each load")
    p.add_argument("--ddp-steps", type=int, default=20, help="timed DDP steps per run (default 20)")
    p.add_argument("--json", type=Path, help="write configuration and results here")
    return p.parse_args(argv)


# ---- one condition, inside the ranks ---------------------------------------------------


def loop_seconds(reduce, x, args, seed):
    """Wall time of the whole loop on this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    schedule = random.Random(seed)  # the same draws on every rank
    a = torch.randn(96, 96)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.iters):
        work = [schedule.randint(0, args.work) for _ in range(world)]
        for _ in range(work[rank]):
            a = torch.tanh(a @ a)  # tanh keeps the values bounded
        reduce(x)
    return time.perf_counter() - start


def rank_main(args):
    init_group("cpu")
    import pyallreduce

    comm = pyallreduce.Communicator(device="cpu")
    reducers = {
        "pyallreduce": comm.all_reduce_,
        "gloo": lambda t: dist.all_reduce(t),
    }
    rows = []
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        x = torch.ones(size // 4)
        times = {b: [] for b in BACKENDS}
        for rep in range(args.repeats):
            for backend in BACKENDS:
                x.fill_(1.0)
                mine = loop_seconds(reducers[backend], x, args, seed=rep)
                every = [None] * dist.get_world_size()
                dist.all_gather_object(every, mine)
                times[backend].append(max(every))
        rows.append(dict(bytes=size, **{f"{b}_loop_s": statistics.median(t) for b, t in times.items()},
                         **{f"{b}_runs_s": t for b, t in times.items()}))
    comm.close()
    if dist.get_rank() == 0:
        Path(os.environ["BUSY_OUT"]).write_text(json.dumps(rows))
    dist.destroy_process_group()


# ---- the driver ---------------------------------------------------------------------------


def start_load(n):
    spin = "while True:\n    pass\n"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]


def stop_load(procs):
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def run_ddp(args):
    """DDP step time per mode (bench/ddp_train.py), median of --repeats runs."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ddp.json"
        cmd = [sys.executable, str(HERE / "ddp_train.py"), "--nproc", str(args.nproc), "--steps",
               str(args.ddp_steps), "--warmup", "3", "--json", str(out)]
        for _ in range(args.repeats):
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"))
            runs.append({mode: r["step_s"] for mode, r in json.loads(out.read_text())["results"].items()})
    return {mode: statistics.median(r[mode] for r in runs) for mode in runs[0]}, runs


def main():
    args = parse_args()
    if under_torchrun():
        return rank_main(args)
    conditions = []
    print(f"# {args.nproc} ranks on {len(os.sched_getaffinity(0))} cores, fp32, {args.iters} iterations "
          f"of uneven compute + one all-reduce; loop time of the slowest rank, median of {args.repeats}")
    print(f"{'load':>4} {'size':>8} {'pyallreduce s':>14} {'gloo s':>10} {'gloo/ours':>10}")
    for load in [int(n) for n in args.loads.split(",")]:
        procs = start_load(load)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                os.environ["BUSY_OUT"] = str(Path(tmp) / "rows.json")
                os.environ.setdefault("OMP_NUM_THREADS", "1")
                code = spawn_ranks(__file__, args.nproc)
                if code:
                    sys.exit(f"a rank failed with exit code {code}")
                rows = json.loads(Path(os.environ["BUSY_OUT"]).read_text())
            ddp, ddp_runs = run_ddp(args) if args.ddp else (None, None)
        finally:
            stop_load(procs)
        for r in rows:
            ratio = r["gloo_loop_s"] / r["pyallreduce_loop_s"]
            print(f"{load:>4} {r['bytes']:>8} {r['pyallreduce_loop_s']:>14.3f} {r['gloo_loop_s']:>10.3f} "
                  f"{ratio:>10.2f}")
        if ddp:
            print(f"{load:>4} {'DDP step':>8} {ddp['pyallreduce']:>14.4f} {ddp['default']:>10.4f} "
                  f"{ddp['default'] / ddp['pyallreduce']:>10.2f}")
        conditions.append(dict(load=load, rows=rows, ddp_step_s=ddp, ddp_runs_step_s=ddp_runs))
    if args.json:
        doc = dict(nproc=args.nproc, cores=len(os.sched_getaffinity(0)), iters=args.iters, work=args.work,
                   repeats=args.repeats, cpu=platform.processor() or platform.machine(), host=platform.node(),
                   torch=torch.__version__, date=time.strftime("%Y-%m-%d"), conditions=conditions)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"# wrote {args.json}")


if __name__ == "__main__":
    main()
