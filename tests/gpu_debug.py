"""Runs one check of tests/test_cuda.py on W ranks with rank 0 under a
debugger, for a crash in native code on a GPU machine (faulthandler shows
only the Python frame): each rank is its own process, rank 0 runs inside
`cuda-gdb -batch` (or gdb), which prints the native backtrace of the thread
that faulted and of every thread. bench/gpu_check.sh runs it after a failed
test_cuda.py.

    python tests/gpu_debug.py check_eager 2 [--timeout 300]
"""
import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rank_main(check, rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable()
    sys.path.insert(0, str(HERE))
    import test_cuda

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        getattr(test_cuda, check)(rank, world)
        print(f"rank {rank}: {check} passed", flush=True)
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("check")
    p.add_argument("world", type=int)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        return rank_main(args.check, args.rank, args.world, args.port)
    sys.path.insert(0, str(HERE))
    from launch import free_port

    port = free_port()
    os.environ["PYALLREDUCE_TEST_TRACE"] = "1"  # test_cuda.trace: each rank names the iteration it starts
    debugger = shutil.which("cuda-gdb") or shutil.which("gdb")
    procs = []
    for r in range(args.world):
        cmd = [sys.executable, __file__, args.check, str(args.world), "--rank", str(r), "--port", str(port)]
        if r == 0 and debugger:
            cmd = [debugger, "-q", "-batch", "-ex", "set pagination off", "-ex", "handle SIGPIPE nostop noprint",
                   "-ex", "run", "-ex", "bt 60", "-ex", "thread apply all bt 20", "--args", *cmd]
        procs.append(subprocess.Popen(cmd))
    deadline = time.monotonic() + args.timeout
    codes = []
    try:
        for proc in procs:
            codes.append(proc.wait(timeout=max(1, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        print(f"gpu_debug: ranks did not finish within {args.timeout:.0f} s", flush=True)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    print(f"gpu_debug: exit codes {codes} (debugger: {debugger})", flush=True)
    return 0 if codes == [0] * args.world else 1


if __name__ == "__main__":
    sys.exit(main())
