"""What the bench scripts share: running a script once per local rank when it is
not under torchrun (or under an MPI's launcher, to time that MPI in the same
processes), and joining the process group on CPU (gloo) or CUDA (NCCL; gloo on
the emulated CUDA runtime)."""
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

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


# ---- MPI -----------------------------------------------------------------------------
# Debian's Open MPI and MPICH install side by side; each needs its own build
# of mpi4py (bench/mpi_setup.sh puts them under build/mpi/<name>).
MPIS = ("openmpi", "mpich")
MPI4PY_DIR = Path(__file__).resolve().parent.parent / "build" / "mpi"
# Where an MPI launcher puts a rank's number and the world size.
MPI_RANK_ENV = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"))


def mpi_launcher(mpi, nproc):
    """The command that starts nproc ranks under this MPI: no binding by the
    launcher (the ranks bind themselves as spawn_ranks binds them, so both
    libraries run on the same cores), Open MPI allowed to run as root and to
    oversubscribe (more ranks than cores, as the busy-machine rows are)."""
    exe = shutil.which(f"mpiexec.{mpi}")
    if exe is None:
        raise SystemExit(f"--mpi {mpi}: mpiexec.{mpi} not found; bash bench/mpi_setup.sh installs Debian's "
                         f"Open MPI and MPICH and builds mpi4py for each")
    if mpi == "openmpi":
        return [exe, "-n", str(nproc), "--bind-to", "none", "--oversubscribe", "--allow-run-as-root"]
    return [exe, "-n", str(nproc), "-bind-to", "none"]


def import_mpi4py(mpi):
    """mpi4py built against this MPI (build/mpi/<mpi>), imported; MPI itself
    initialised by the import."""
    path = MPI4PY_DIR / mpi
    if not (path / "mpi4py").is_dir():
        raise SystemExit(f"no mpi4py built against {mpi} in {path}: run bash bench/mpi_setup.sh")
    sys.path.insert(0, str(path))
    from mpi4py import MPI

    return MPI


def adopt_mpi_rank():
    """Under an MPI launcher (spawn_ranks(..., mpi=...)): torchrun's rank
    environment from the launcher's, and the core binding spawn_ranks would
    have given. Returns whether this process is an MPI rank."""
    for rank_var, size_var in MPI_RANK_ENV:
        if rank_var in os.environ and "PYALLREDUCE_BENCH_MPI" in os.environ:
            rank, world = int(os.environ[rank_var]), int(os.environ[size_var])
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                              LOCAL_WORLD_SIZE=str(world))
            binding = core_sets(world) if os.environ.get("PYALLREDUCE_BENCH_BIND") == "1" else None
            if binding:
                os.sched_setaffinity(0, binding[rank])
            return True
    return False


class MpiAllreduce:
    """An MPI's MPI_Allreduce in place, as a torch user calls it through
    mpi4py: on the tensor's NumPy view (no copy). MPI has no average (a sum
    and a division, as gloo's reference) and no bfloat16 (the 16-bit types go
    as fp32 copies, what a user of MPI does; the copies are timed with it)."""

    def __init__(self, mpi):
        self.MPI = import_mpi4py(mpi)
        self.comm = self.MPI.COMM_WORLD
        self.world = self.comm.Get_size()
        self.version = self.MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]
        self.mpi = mpi

    def call(self, t, op):
        """The in-place all-reduce of t as a callable."""
        MPI, comm, world = self.MPI, self.comm, self.world
        if t.dtype == torch.float32:
            view = t.numpy()

            def run():
                comm.Allreduce(MPI.IN_PLACE, view, op=MPI.SUM)
                if op == "avg":
                    t.div_(world)
            return run
        wide = t.float()
        view = wide.numpy()

        def run_wide():
            wide.copy_(t)
            comm.Allreduce(MPI.IN_PLACE, view, op=MPI.SUM)
            if op == "avg":
                wide.div_(world)
            t.copy_(wide)
        return run_wide

    def describe(self):
        return {"mpi": self.mpi, "library": self.version}


def core_sets(nproc):
    """The cores each rank is bound to: an equal share of this process's cores
    each, or None (no binding) when there are fewer cores than ranks."""
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // nproc
    if share == 0:
        return None
    return [set(cores[r * share:(r + 1) * share]) for r in range(nproc)]


def spawn_ranks(script, nproc, bind_cores=False, mpi=None):
    """Runs `script` with this process's arguments once per rank, with torchrun's
    environment; returns 0, or the exit code of the first rank seen failing. A
    rank that fails takes the others down with it, so a run never waits on
    ranks blocked in a collective.
    bind_cores: pin the ranks to disjoint cores (core_sets), as a CPU job
    would be run for speed; two spinning ranks sharing a core measure the
    scheduler, not the all-reduce.
    mpi: start the ranks with that MPI's launcher instead (mpi_launcher; the
    script calls adopt_mpi_rank first), so they can time it beside us."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = str(max(1, (os.cpu_count() or 1) // nproc))
    binding = core_sets(nproc) if bind_cores else None
    if mpi is not None:
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYALLREDUCE_BENCH_MPI=mpi,
                   PYALLREDUCE_BENCH_BIND="1" if binding else "0")
        env.setdefault("OMP_NUM_THREADS", threads)
        procs = [subprocess.Popen([*mpi_launcher(mpi, nproc), sys.executable, os.path.abspath(script),
                                   *sys.argv[1:]], env=env, start_new_session=True)]
        try:
            return procs[0].wait()
        finally:
            if procs[0].poll() is None:
                os.killpg(procs[0].pid, 9)
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
