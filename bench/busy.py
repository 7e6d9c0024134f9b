"""All-reduce on a machine that is not idle: more ranks than cores, and other
processes competing for them. Compares pyallreduce with gloo (and with an
MPI's MPI_Allreduce under --mpi), alternating.

    python bench/busy.py                                  # 4 CPU ranks; loads 0 and 2; writes nothing
    python bench/busy.py --nproc 4 --loads 0,2 --ddp --json bench/results/busy-cpu-4ranks.json
    python bench/busy.py --back-to-back --nproc 2 --loads 2,4,compile --json bench/results/busy-b2b-cpu-2ranks.json
    python bench/busy.py --back-to-back --mpi openmpi --backends pyallreduce,mpi   # against Open MPI only

Compute between calls (the default): each rank runs --iters iterations of a
slice of real compute (a small matmul repeated k times, k drawn per rank and
iteration from a schedule every rank shares, so some ranks arrive late), then
one all-reduce of the given size. The loop time (slowest rank, wall clock,
whole loop) is what a training job sees: time a waiting rank spends spinning
is time the late rank, or another process, does not get.

--back-to-back: no compute between calls (DDP's small buckets at the end of
backward, FSDP's all-gathers, a benchmark), where a waiting rank most often
finds its peer descheduled. Every call is timed on every rank; a call's time
is the slowest rank's; the table gives the median, p90 and p99 over all calls
of all repeats.

Conditions (--loads):
  0        only the ranks (with --nproc above the core count: oversubscribed)
  N        N extra processes spinning on the CPU at the ranks' priority
  compile  a real compile beside the ranks: one g++ build of the host-shim
           harness (tests/sim/harness.cpp) per core, restarted as each ends

With --ddp, bench/ddp_train.py also runs under each load (DDP's own gloo
all-reduce against pyallreduce's hook), --repeats times. Each condition runs
the backends alternately, --repeats times, and reports the medians.

--mpi openmpi|mpich starts the ranks with that MPI's launcher (bench/mpi_setup.sh
sets it up) and adds its in-place MPI_Allreduce (through mpi4py, as
compare_nccl.py times it) as a backend: MPI spins or yields while it waits as it
sees fit (Open MPI yields when its launcher sees more ranks than cores), the
load is the same for all.
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

from local_ranks import (MPIS, MpiAllreduce, add_launch_arguments, adopt_mpi_rank, init_group, spawn_ranks,
                         under_torchrun)

BACKENDS = ("pyallreduce", "gloo", "mpi")
# Back to back: the per-call quantiles each row reports (name, q).
QUANTILES = (("median", 0.5), ("p90", 0.9), ("p99", 0.99))
QUANTILE_NAMES = [name for name, _ in QUANTILES]
HERE = Path(__file__).resolve().parent


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_launch_arguments(p, nproc=4, device="cpu")
    p.add_argument("--sizes", help="all-reduce sizes in bytes, fp32 (default 4K,64K,1M; "
                   "back to back 256,4K,64K,1M,16M)")
    p.add_argument("--loads", default="0,2",
                   help="conditions: numbers of extra spinning processes, or 'compile' (default 0,2)")
    p.add_argument("--back-to-back", action="store_true", help="no compute between calls; per-call times")
    p.add_argument("--calls", type=int, default=200,
                   help="back to back: timed calls per measurement, fewer for large sizes (default 200)")
    p.add_argument("--iters", type=int, default=150, help="loop iterations per measurement (default 150)")
    p.add_argument("--work", type=int, default=6,
                   help="most matmuls a rank does per iteration; each draws 0..work (default 6)")
    p.add_argument("--repeats", type=int, default=3, help="measurements per backend and size (default 3)")
    p.add_argument("--ddp", action="store_true", help="also run bench/ddp_train.py under each load")
    p.add_argument("--ddp-steps", type=int, default=20, help="timed DDP steps per run (default 20)")
    p.add_argument("--mpi", choices=MPIS, help="also time this MPI's MPI_Allreduce (the ranks start under its launcher)")
    p.add_argument("--backends", help="comma list of pyallreduce, gloo, mpi (default: pyallreduce and gloo, "
                   "and mpi with --mpi); the first is the one the others are divided by")
    p.add_argument("--json", type=Path, help="write configuration and results here")
    args = p.parse_args(argv)
    args.backends = (args.backends or "pyallreduce,gloo" + (",mpi" if args.mpi else "")).split(",")
    unknown = set(args.backends) - set(BACKENDS)
    if unknown or not args.backends:
        p.error(f"--backends: {sorted(unknown)} not among {BACKENDS}")
    if "mpi" in args.backends and not args.mpi:
        p.error("--backends mpi needs --mpi openmpi|mpich")
    if args.ddp and args.backends[:2] != ["pyallreduce", "gloo"]:
        p.error("--ddp compares pyallreduce's hook with DDP's gloo: keep --backends pyallreduce,gloo[,mpi]")
    if args.sizes is None:
        args.sizes = "256,4K,64K,1M,16M" if args.back_to_back else "4K,64K,1M"
    return args


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


def calls_for(size, args):
    """Back to back: fewer calls for large sizes, so a slow condition still ends."""
    return max(20, min(args.calls, (64 << 20) // size))


def call_seconds(reduce, x, calls):
    """Back to back: the time of every call on this rank (a float64 tensor)."""
    times = torch.empty(calls, dtype=torch.float64)
    for _ in range(3):  # warm-up: first-touch of buffers, gloo's pairs
        reduce(x)
    dist.barrier()
    for i in range(calls):
        start = time.perf_counter()
        reduce(x)
        times[i] = time.perf_counter() - start
    return times


def percentile(values, q):
    return float(torch.quantile(torch.as_tensor(values, dtype=torch.float64), q))


def rank_main(args):
    init_group("cpu")
    import pyallreduce

    comm = pyallreduce.Communicator(device="cpu")
    mpi = MpiAllreduce(args.mpi) if "mpi" in args.backends else None
    rows = []
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        x = torch.ones(size // 4)
        mpi_call = mpi.call(x, "sum") if mpi else None  # bound to x's NumPy view once, as compare_nccl.py's
        reducers = {"pyallreduce": comm.all_reduce_, "gloo": dist.all_reduce, "mpi": lambda t: mpi_call()}
        times = {b: [] for b in args.backends}
        for rep in range(args.repeats):
            for backend in args.backends:
                x.fill_(1.0)
                if args.back_to_back:
                    mine = call_seconds(reducers[backend], x, calls_for(size, args))
                    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
                    dist.all_gather(every, mine)
                    times[backend] += torch.stack(every).amax(0).tolist()  # a call's slowest rank
                else:
                    mine = loop_seconds(reducers[backend], x, args, seed=rep)
                    every = [None] * dist.get_world_size()
                    dist.all_gather_object(every, mine)
                    times[backend].append(max(every))
        if args.back_to_back:
            rows.append(dict(bytes=size, calls=len(times[args.backends[0]]),
                             **{f"{b}_{name}_s": percentile(t, q) for b, t in times.items() for name, q in QUANTILES}))
        else:
            rows.append(dict(bytes=size, **{f"{b}_loop_s": statistics.median(t) for b, t in times.items()},
                             **{f"{b}_runs_s": t for b, t in times.items()}))
    comm.close()
    if dist.get_rank() == 0:
        Path(os.environ["BUSY_OUT"]).write_text(json.dumps(dict(rows=rows, mpi=mpi.describe() if mpi else None)))
    dist.destroy_process_group()


# ---- the driver ---------------------------------------------------------------------------


def start_load(load):
    """The processes of one condition (see the module docstring)."""
    if load == "compile":
        sys.path.insert(0, str(HERE.parent / "tests" / "sim"))
        from build import command  # the harness's own compile command

        outs = [Path(tempfile.gettempdir()) / f"busy-harness-{os.getpid()}-{i}" for i in os.sched_getaffinity(0)]
        return [subprocess.Popen(["bash", "-c", f"while :; do {' '.join(command(out))} || exit 1; done"])
                for out in outs]
    spin = "while True:\n    pass\n"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(int(load))]


def stop_load(procs):
    for p in procs:
        if p.args[0] == "bash":  # the compile loop: its g++ and g++'s cc1plus first
            subprocess.run(["pkill", "-KILL", "-f", f"busy-harness-{os.getpid()}"], check=False)
        p.kill()
    for p in procs:
        p.wait()
    for out in Path(tempfile.gettempdir()).glob(f"busy-harness-{os.getpid()}-*"):
        out.unlink()


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


def print_header(args, cores):
    others = args.backends[1:]
    if args.back_to_back:
        print(f"# {args.nproc} ranks on {cores} cores, fp32, back to back; per call (slowest rank), "
              f"median, p90 and p99 over {args.repeats} alternating runs, microseconds; x: their time / ours")
        first, *rest = QUANTILE_NAMES
        cols = [f"{args.backends[0]} {first}", *rest] + [
            c for b in others for c in (f"{b} {first}", *rest, *(f"x {n}" for n in QUANTILE_NAMES))]
    else:
        print(f"# {args.nproc} ranks on {cores} cores, fp32, {args.iters} iterations "
              f"of uneven compute + one all-reduce; loop time of the slowest rank, median of {args.repeats}, "
              f"seconds; x: their time / ours")
        cols = [f"{args.backends[0]} s"] + [c for b in others for c in (f"{b} s", "x")]
    print(f"{'load':>7} {'size':>8} " + " ".join(f"{c:>12}" for c in cols))


def print_rows(load, rows, args):
    ours, others = args.backends[0], args.backends[1:]
    for r in rows:
        if args.back_to_back:
            text = " ".join(f"{r[f'{ours}_{n}_s'] * 1e6:>12.1f}" for n in QUANTILE_NAMES)
            for b in others:
                text += "".join(f" {r[f'{b}_{n}_s'] * 1e6:>12.1f}" for n in QUANTILE_NAMES)
                text += "".join(f" {r[f'{b}_{n}_s'] / r[f'{ours}_{n}_s']:>12.2f}" for n in QUANTILE_NAMES)
        else:
            cells = [r[f"{ours}_loop_s"]] + [c for b in others for c in (r[f"{b}_loop_s"],
                                                                          r[f"{b}_loop_s"] / r[f"{ours}_loop_s"])]
            text = " ".join(f"{c:>12.3f}" for c in cells)
        print(f"{load:>7} {r['bytes']:>8} {text}")


def main():
    args = parse_args()
    if under_torchrun() or adopt_mpi_rank():
        return rank_main(args)
    conditions = []
    cores = len(os.sched_getaffinity(0))
    print_header(args, cores)
    for load in args.loads.split(","):
        load = load if load == "compile" else int(load)
        procs = start_load(load)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                os.environ["BUSY_OUT"] = str(Path(tmp) / "rows.json")
                os.environ.setdefault("OMP_NUM_THREADS", "1")
                code = spawn_ranks(__file__, args.nproc, mpi=args.mpi)
                if code:
                    sys.exit(f"a rank failed with exit code {code}")
                out = json.loads(Path(os.environ["BUSY_OUT"]).read_text())
                rows, mpi_library = out["rows"], out["mpi"]
            loadavg = os.getloadavg()  # the 1-minute average: the run is about that long
            ddp, ddp_runs = run_ddp(args) if args.ddp else (None, None)
        finally:
            stop_load(procs)
        print_rows(load, rows, args)
        if ddp:
            print(f"{load:>7} {'DDP step':>8} {ddp['pyallreduce']:>14.4f} {ddp['default']:>10.4f} "
                  f"{ddp['default'] / ddp['pyallreduce']:>10.2f}")
        print(f"# load average after load {load}: {loadavg[0]:.2f} (1 min), {loadavg[1]:.2f} (5 min)")
        conditions.append(dict(load=load, loadavg=loadavg, rows=rows, ddp_step_s=ddp, ddp_runs_step_s=ddp_runs,
                               mpi=mpi_library))
    if args.json:
        doc = dict(nproc=args.nproc, cores=cores, back_to_back=args.back_to_back, iters=args.iters,
                   backends=args.backends, mpi=args.mpi,
                   work=args.work, calls=args.calls, repeats=args.repeats,
                   cpu=platform.processor() or platform.machine(), host=platform.node(),
                   torch=torch.__version__, date=time.strftime("%Y-%m-%d"), conditions=conditions)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"# wrote {args.json}")


if __name__ == "__main__":
    main()
