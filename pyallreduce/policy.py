"""Which algorithm runs at which size: the one place that decides, from the
crossovers bench/compare_nccl.py measures and writes to crossovers.json
(`python bench/compare_nccl.py ... --write-crossovers`).

The table is keyed by device kind ("cpu", or "cuda:<GPU name>") and world size;
a missing world size uses the kind's "default" row, a missing kind the
top-level "default" row.
"""
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

CROSSOVERS_FILE = Path(__file__).with_name("crossovers.json")


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
    device = torch.device(device)
    if device.type == "cuda":
        return "cuda:" + torch.cuda.get_device_name(device)
    return device.type


@functools.lru_cache(maxsize=None)
def _table(path=CROSSOVERS_FILE):
    return json.loads(Path(path).read_text())


def lookup(kind, world_size, path=CROSSOVERS_FILE):
    table = _table(path)
    rows = table.get(kind) or table.get(kind.split(":")[0]) or {}
    row = rows.get(str(world_size)) or rows.get("default") or table["default"]
    return Crossover(row["two_shot_min_bytes"], row.get("reference_min_bytes"), bool(row.get("measured", False)))


def resident_nblocks(nblocks, devices):
    """The grid size every rank launches: the requested nblocks, made small
    enough that the blocks of all ranks sharing a GPU (MPS, or several
    processes per GPU) are resident at once.

    Block b of each rank spins at the barriers until block b of every peer
    arrives; when the spinning blocks of some ranks fill a GPU's SMs, the
    blocks of another rank on that GPU never start, and the call hangs until
    its deadline. So for every GPU, nblocks x (ranks on it) must not exceed
    the blocks it holds at once (the kernels' occupancy x SMs).

    devices: per rank, (GPU identity, blocks that GPU holds at once), the
    same list on every rank (gathered), so every rank gets the same answer.
    Returns (nblocks, reason or None when nothing was reduced). Raises when
    even one block per rank does not fit.
    """
    ranks_on, capacity = {}, {}
    for key, blocks in devices:
        ranks_on[key] = ranks_on.get(key, 0) + 1
        capacity[key] = blocks
    bound = min(capacity[key] // ranks_on[key] for key in ranks_on)
    if bound < 1:
        worst = min(sorted(ranks_on), key=lambda k: capacity[k] // ranks_on[k])
        raise ValueError(f"pyallreduce: {ranks_on[worst]} ranks share GPU {worst}, which holds only "
                         f"{capacity[worst]} blocks of the all-reduce kernels at once: use fewer ranks per GPU")
    if nblocks <= bound:
        return nblocks, None
    shared = {k: n for k, n in sorted(ranks_on.items()) if n > 1}
    return bound, (f"nblocks {nblocks} -> {bound}: ranks share GPUs ({shared} ranks per GPU), and every "
                   f"rank's blocks must be resident at once")
