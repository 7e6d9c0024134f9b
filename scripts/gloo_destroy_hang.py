"""Does this torch's gloo hang in destroy_process_group? (No pyallreduce here.)

    python scripts/gloo_destroy_hang.py [runs] [all-reduces per run]

Each run starts two processes that join a gloo group, all-reduce, agree on an
object and destroy the group. A process still in destroy_process_group after
15 s prints its stack and exits with 1; the script counts those runs. Run it
beside busy processes (`yes > /dev/null &`, one per core): torch 2.4.1 hung in
13 runs of 39 and 2.7.1 in 12 of 40, 2.14.1 in none of 40 (2026-11-28, 2
cores). tests/launch.py leaves a plain gloo group undestroyed on torch < 2.8
for this reason.
"""
import faulthandler
import multiprocessing as mp
import os
import socket
import sys

STUCK_AFTER_S = 15


def rank_main(rank, port, all_reduces):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = torch.ones(1000)
    for _ in range(all_reduces):
        dist.all_reduce(x)
    dist.broadcast_object_list([None])
    faulthandler.dump_traceback_later(STUCK_AFTER_S, exit=True)
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    all_reduces = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    ctx = mp.get_context("forkserver")
    hung = 0
    for run in range(runs):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [ctx.Process(target=rank_main, args=(r, port, all_reduces)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(4 * STUCK_AFTER_S)
            if p.exitcode is None:
                p.kill()
                p.join()
        codes = [p.exitcode for p in procs]
        if codes != [0, 0]:
            hung += 1
            print(f"run {run}: exit codes {codes}", flush=True)
    import torch

    print(f"torch {torch.__version__}: {hung} of {runs} runs hung in destroy_process_group")
    return 1 if hung else 0


if __name__ == "__main__":
    sys.exit(main())
