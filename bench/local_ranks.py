"""What the bench scripts share: running a script once per local rank when it is
not under torchrun, and joining the process group on CPU (gloo) or CUDA (NCCL;
gloo on the emulated CUDA runtime)."""
import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def add_launch_arguments(parser, *, nproc, device=None):
    """--device and --nproc, as every bench script takes them. device: the
    default, else CUDA where a GPU is visible and CPU otherwise."""
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=("cpu", "cuda"), default=device or auto,
                        help=f"device of the tensors (default: {device or 'cuda if available, else cpu'})")
    parser.add_argument("--nproc", type=int, default=nproc,
                        help=f"ranks to spawn when not under torchrun (default {nproc})")


def under_torchrun():
    return "RANK" in os.environ


def core_sets(nproc):
    """The cores each rank is bound to: an equal share of this process's cores
    each, or None (no binding) when there are fewer cores than ranks."""
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // nproc
    if share == 0:
        return None
    return [set(cores[r * share:(r + 1) * share]) for r in range(nproc)]


def spawn_ranks(script, nproc, bind_cores=False):
    """Runs `script` with this process's arguments once per rank, with torchrun's
    environment; returns 0, or the exit code of the first rank seen failing. A
    rank that fails takes the others down with it, so a run never waits on
    ranks blocked in a collective.
    bind_cores: pin the ranks to disjoint cores (core_sets), as a CPU job
    would be run for speed; two spinning ranks sharing a core measure the
    scheduler, not the all-reduce."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = str(max(1, (os.cpu_count() or 1) // nproc))
    binding = core_sets(nproc) if bind_cores else None
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.setdefault("OMP_NUM_THREADS", threads)
        pin = (lambda cores=binding[rank]: os.sched_setaffinity(0, cores)) if binding else None
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(script), *sys.argv[1:]], env=env,
                                      preexec_fn=pin))
    failed = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = next((c for c in codes if c not in (None, 0)), 0)
            if failed or all(c == 0 for c in codes):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    return failed  # the failing rank's code, not the SIGKILL of the ranks stopped after it


def emulated_cuda():
    """Whether CUDA here is the emulated runtime of tests/emulated (the GPU code
    path runs on host threads: no NCCL, no torch kernels, no meaningful time)."""
    return torch.cuda.is_available() and torch.cuda.get_device_name(0).startswith("Emulated")


def init_group(device_type):
    """Joins the default process group; returns this rank's device. On the
    emulated CUDA runtime the group is gloo (there is no NCCL)."""
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"])) % torch.cuda.device_count()
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        if emulated_cuda():
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device
