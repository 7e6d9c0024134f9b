"""Which algorithm runs at which size: the one place that decides, from the
crossovers bench/compare_nccl.py measures and writes to crossovers.json
(`python bench/compare_nccl.py ... --write-crossovers`), or, for a machine
that table has no row for, from the crossover measured on it at first use
(calibrate.py) and kept in a cache file (cache_file()).

The table is keyed by device kind (policy.device_kind: "cpu:<model>:<ISA>",
"cuda:<GPU name>", or a family "cpu", "cuda" that serves kinds without a row)
and world size; see lookup() for the fallbacks. Only a kind's own row counts
as measured: one machine's crossover is not another's (a two-shot crossover
measured at 4 KiB on one CPU was 25% slower there on another).
"""
import functools
import json
import os
import platform
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

CROSSOVERS_FILE = Path(__file__).with_name("crossovers.json")
# Where Linux describes CPU 0's caches (host_round_bytes).
CPU0_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
# The host backend's largest round (host_round_bytes; the smallest: _C.DEFAULT_ROUND_BYTES).
ROUND_BYTES_MAX = 512 << 10
# Where crossovers measured at first use are kept (default: $XDG_CACHE_HOME or ~/.cache, then pyallreduce/).
CACHE_DIR_ENV = "PYALLREDUCE_CACHE_DIR"
# Two-shot is chosen only where it beats one-shot by this factor: it has a
# second barrier, so it loses more when cross-core latency rises (a busy
# host; on the 2-core VM such phases made two-shot at 4 KiB 45% slower than
# one-shot while it was 7% faster in quiet ones), and a small win does not pay for that.
TWO_SHOT_MARGIN = 1.1
# two_shot_min_bytes where two-shot never beat one-shot up to the largest
# measured size (the policy reads an int, not null).
NEVER = 2**63 - 1


def ranks_outnumber_cores(pids) -> bool:
    """Whether the processes `pids` (a communicator's ranks) outnumber the
    cores they may run on together (their CPU affinity, read once here): then
    some peer a waiting rank needs is not running, most likely queued behind it
    on its own core, and the host backend's waits yield instead of spinning
    (csrc/cpu/all_reduce.cpp, wait_reached). False where an affinity cannot be
    read (a peer in another PID namespace)."""
    cores = set()
    try:
        for pid in pids:
            cores |= os.sched_getaffinity(pid)
    except OSError:
        return False
    return len(cores) < len(pids)


def host_round_bytes(caches=CPU0_CACHES):
    """The round size of the host backend's large calls on this machine
    (csrc/cpu/all_reduce.cpp, run_rounds): half of a core's L2 cache, rounded
    down to a power of two, between _C.DEFAULT_ROUND_BYTES (256 KiB; also
    where the L2 cannot be read) and ROUND_BYTES_MAX. A round's staging copy
    is to be in cache still when the peers read it, and every round costs
    barriers. Measured: on the 2-core Intel Xeon VM, 256 KiB rounds beat 1 MiB
    ones at 16 MiB (3.0 against 3.3 ms); on the AMD EPYC VM (1 MiB of L2 a
    core), 256 KiB rounds made a 512 KiB - 1 MiB call in place twice as slow
    in some processes and not in others (1 MiB: 78-98 us against 44-53),
    512 KiB rounds never (43-49 us), and from 2 MiB up rounds of 256 KiB,
    512 KiB and 1 MiB took the same time within the VM's noise. CPU 0's cache
    here, not this process's core: the ranks take rank 0's answer anyway
    (group.agree_on_group), as a hybrid CPU's cores differ."""
    from . import _C

    l2 = None
    try:
        for index in caches.glob("index*"):
            if (index / "level").read_text().strip() == "2":
                size = re.fullmatch(r"(\d+)([KM]?)", (index / "size").read_text().strip())  # "1024K"
                l2 = int(size[1]) << {"": 0, "K": 10, "M": 20}[size[2]] if size else None
    except (OSError, ValueError):  # ValueError: not text
        l2 = None
    if not l2 or l2 // 2 < _C.DEFAULT_ROUND_BYTES:
        return _C.DEFAULT_ROUND_BYTES
    return min(ROUND_BYTES_MAX, 1 << ((l2 // 2).bit_length() - 1))


@dataclass(frozen=True)
class Crossover:
    two_shot_min_bytes: int  # at or above this size two-shot beats one-shot
    reference_min_bytes: Optional[int]  # at or above, the reference collective (NCCL/gloo) wins; None: never
    measured: bool  # False: a default, not yet measured on this kind

    def algo_for(self, nbytes):
        return "two_shot" if nbytes >= self.two_shot_min_bytes else "one_shot"

    def prefers_reference(self, nbytes):
        return self.reference_min_bytes is not None and nbytes >= self.reference_min_bytes


def device_kind(device):
    """"cuda:<GPU name>", or "cpu:<CPU model>:<vector ISA the kernels use>":
    machine types whose crossovers differ get their own rows."""
    device = torch.device(device)
    if device.type == "cuda":
        return "cuda:" + torch.cuda.get_device_name(device)
    if device.type == "cpu":
        from . import _C

        return f"cpu:{cpu_model()}:{_C.cpu_isa()}"
    return device.type


@functools.lru_cache(maxsize=None)
def cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


@functools.lru_cache(maxsize=None)
def _table(path=CROSSOVERS_FILE):
    return json.loads(Path(path).read_text())


def lookup(kind, world_size, path=CROSSOVERS_FILE, cache=None):
    """The table's row for this kind and world size; else the one measured on
    this machine at first use (the cache file; None: cache_file()); else, not
    measured for this kind, the kind's family ("cpu", "cuda") for this world
    size, their "default" rows, the table's."""
    table, ws = _table(path), str(world_size)
    own, family = table.get(kind, {}), table.get(kind.split(":")[0], {})
    row = own.get(ws)
    if row is None:
        try:
            row = json.loads((cache or cache_file()).read_text()).get(kind, {}).get(measured_key(world_size))
        except (OSError, ValueError):  # no cache yet, or unreadable: measured again
            row = None
        if row is not None and row.get("built") != build_identity():
            row = None  # measured by another build of the extension: measured again
    if row is not None:
        return Crossover(row["two_shot_min_bytes"], row.get("reference_min_bytes"), bool(row.get("measured", False)))
    row = family.get(ws) or own.get("default") or family.get("default") or table["default"]
    return Crossover(row["two_shot_min_bytes"], row.get("reference_min_bytes"), False)


def measured_key(world_size):
    """A measured row's key in the cache file: the world size and the cores
    this process may run on. The same ranks on fewer cores wait otherwise
    (they yield: csrc/cpu/all_reduce.cpp, wait_reached), so the crossover
    measured with one core each is not theirs (4 ranks on the 2-core VM:
    two-shot from 64 KiB, where the row measured before their waits yielded
    said never, and one-shot took 1.8x two-shot's time at 4 MiB). This
    process's cores only, as it knows them before the ranks exchange anything:
    ranks bound one to a core and ranks sharing that one core get the same key."""
    return f"{world_size}@{len(os.sched_getaffinity(0))}cores"


@functools.lru_cache(maxsize=None)
def build_identity():
    """The extension build a measured row belongs to (its shared object's
    size and modification time): a rebuild, whose kernels or waits may
    differ, measures again rather than reading another build's row."""
    from . import _C

    try:
        st = os.stat(_C.__file__)
    except OSError:  # the file went away under the loaded module: no row is this build's
        return f"unknown build, pid {os.getpid()}"
    return f"{st.st_size}:{st.st_mtime_ns}"


def cache_file():
    base = os.environ.get(CACHE_DIR_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache",
                                                 "pyallreduce")
    return Path(base) / "crossovers.json"


def remember(kind, world_size, crossover, cache=None):
    """Adds a crossover measured here to the cache file (written whole and
    renamed into place: a process reading it sees the old file or the new)."""
    path = cache or cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    table.setdefault(kind, {})[measured_key(world_size)] = {
        "two_shot_min_bytes": crossover.two_shot_min_bytes, "reference_min_bytes": crossover.reference_min_bytes,
        "measured": True, "how": "at first use (pyallreduce/calibrate.py)", "built": build_identity()}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".crossovers.")
    with os.fdopen(fd, "w") as f:
        json.dump(table, f, indent=2)
    os.replace(tmp, path)


def winning_tail_start(sizes, wins):
    """The smallest of the ascending `sizes` from which wins(size) holds at
    every larger size; None when it does not hold at the largest. How a
    crossover is read off measurements: a win at one size with losses above
    it is noise, not a crossover."""
    start = None
    for size in reversed(sizes):
        if not wins(size):
            break
        start = size
    return start


def resident_nblocks(nblocks, devices):
    """The grid size every rank launches: the requested nblocks, made small
    enough that the blocks of all ranks sharing a GPU (MPS, or several
    processes per GPU), together with the blocks of their other live
    communicators on that GPU, are resident at once.

    Block b of each rank spins at the barriers until block b of every peer
    arrives; when spinning blocks fill a GPU's SMs, the blocks of another rank
    on that GPU never start, and the call hangs until its deadline. The same
    happens across communicators: the backend's and the DDP hook's, or a
    tensor-parallel and a data-parallel group, whose kernels rank 0 launches
    in one order and rank 1 in the other, each waiting for peers whose blocks
    the other communicator's occupy. So for every GPU, the blocks of every
    live communicator of its ranks must fit at once: nblocks x (ranks on it)
    + (blocks already held there) <= the blocks it holds at once (the
    kernels' occupancy x SMs). Kernels of other libraries (NCCL's) and
    communicators of processes outside this group cannot be counted; see
    README.

    devices: per rank, (GPU identity, blocks that GPU holds at once, blocks
    this rank's other live communicators hold on it), the same list on every
    rank (gathered), so every rank gets the same answer.
    Returns (nblocks, reason or None when nothing was reduced). Raises when
    even one block per rank does not fit.
    """
    ranks_on, capacity, held = {}, {}, {}
    for key, blocks, already in devices:
        ranks_on[key] = ranks_on.get(key, 0) + 1
        capacity[key] = blocks
        held[key] = held.get(key, 0) + already
    free = {key: capacity[key] - held[key] for key in ranks_on}
    bound = min(free[key] // ranks_on[key] for key in ranks_on)
    if bound < 1:
        worst = min(sorted(ranks_on), key=lambda k: free[k] // ranks_on[k])
        others = (f", of which other live communicators of these ranks hold {held[worst]} (close some)"
                  if held[worst] else "")
        raise ValueError(f"pyallreduce: {ranks_on[worst]} ranks share GPU {worst}, which holds only "
                         f"{capacity[worst]} blocks of the all-reduce kernels at once{others}: use fewer ranks "
                         "per GPU")
    if nblocks <= bound:
        return nblocks, None
    shared = {k: n for k, n in sorted(ranks_on.items()) if n > 1}
    busy = {k: n for k, n in sorted(held.items()) if n > 0}
    why = [f"ranks share GPUs ({shared} ranks per GPU)"] if shared else []
    why += [f"other live communicators hold blocks there ({busy})"] if busy else []
    why = why or [f"a GPU holds only {bound} blocks of these kernels at once"]
    return bound, (f"nblocks {nblocks} -> {bound}: {' and '.join(why)}, and every rank's blocks of every "
                   "live communicator must be resident at once")
