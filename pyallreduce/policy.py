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
