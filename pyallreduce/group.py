"""Agreement among a group's ranks. gather() and raise_if_failed(): what every
step that can fail on one rank alone (mapping memory, registering a buffer)
uses, so that every rank raises together instead of some waiting in a
collective the failed rank never joins. agree_on_group(): the facts a
Communicator's ranks must share before any memory is mapped — one host, the
same settings, a GPU topology the kernels can use, the blocks that may be
resident at once — decided collectively, so that every rank reaches the same
answer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from . import _C, calibrate, live, logs, policy
from .protocol import host_id


def backend_of(group, device):
    """The backend that runs `group`'s collectives on `device`'s tensors. A
    Python subclass of ProcessGroup (pyallreduce's backend before torch 2.9,
    backend.py) has no backends per device: it runs them all itself."""
    return group._get_backend(device) if type(group) is dist.ProcessGroup else group


def gather(obj, group):
    """Collective: every rank's obj, in rank order."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def raise_if_failed(errors, what, exc=RuntimeError):
    """Raises exc if any rank's entry of `errors` (gathered: a str, or None) is set."""
    failed = [f"rank {q}: {e}" for q, e in enumerate(errors) if e]
    if failed:
        raise exc(f"pyallreduce: {what} failed on " + "; ".join(failed))


@dataclass
class GroupSetup:
    fallback_reason: Optional[str]  # why the group goes to torch.distributed, or None
    crossover: policy.Crossover     # rank 0's row: the same on every rank
    nblocks: int                    # lowered alike on every rank where ranks share a GPU
    gpu: Optional[str]              # the GPU whose blocks the kernels hold (policy.resident_nblocks)
    kind: Optional[str] = None      # rank 0's device kind (policy.device_kind)
    calibrate: bool = False         # rank 0's answer: measure the crossover here (calibrate.py)
    round_bytes: Optional[int] = None  # rank 0's policy.host_round_bytes (CPU tensors)


def agree_on_group(group, world_size, device, backend, engine_class, max_bytes, nblocks) -> GroupSetup:
    """Collective. Raises on every rank when the ranks asked for different
    settings: a different nblocks makes blocks wait for peers that never come,
    a different max_bytes makes odd-epoch reads run past a smaller peer's
    region. Lowers nblocks on every rank alike when ranks share a GPU, and
    takes rank 0's crossover row on every rank (a rank whose kind differs, e.g.
    another PYALLREDUCE_CPU_ISA, or that read a cache file another process
    had just written, would otherwise pick other algorithms), and rank 0's
    answer to whether it is to be measured here, and on CPU its round size
    (policy.host_round_bytes: ranks with other round sizes would wait for
    rounds their peers never run)."""
    kind, kind_error = None, None
    try:
        kind = policy.device_kind(device)
    except RuntimeError as e:  # raised below on every rank, not here on this one alone
        kind_error = str(e)
    gpu = _gpu_capacity(engine_class, device, world_size)
    if gpu is not None:
        gpu = (*gpu, live.blocks_held(gpu[0]))
    crossover = policy.lookup(kind, world_size) if kind is not None else None
    measure = crossover is not None and calibrate.wanted(device, backend, crossover)
    round_bytes = policy.host_round_bytes() if device.type == "cpu" else None
    mine = (host_id(), backend, device.type, max_bytes, nblocks, gpu, kind, kind_error, crossover, measure,
            round_bytes)
    every = gather(mine, group)
    failed = [f"rank {q}: {e[7]}" for q, e in enumerate(every) if e[7]]
    if failed:
        raise RuntimeError("pyallreduce: " + "; ".join(failed))
    setup = GroupSetup(None, every[0][8], nblocks, None, every[0][6], every[0][9], every[0][10])
    if len({e[1:5] for e in every}) > 1:
        rows = "\n".join(f"  rank {q}: backend={e[1]!r}, device={e[2]}, max_bytes={e[3]}, nblocks={e[4]}"
                         for q, e in enumerate(every))
        raise ValueError("pyallreduce: the ranks created this Communicator with different settings; "
                         f"every rank must pass the same backend, device type, max_bytes and nblocks:\n{rows}")
    hosts = {e[0] for e in every}
    if len(hosts) > 1:
        setup.fallback_reason = f"the group spans {len(hosts)} hosts"
        return setup
    gpus = [e[5] for e in every]
    if None not in gpus:
        setup.nblocks, reason = policy.resident_nblocks(nblocks, gpus)
        if reason:
            logs.log_once(reason)
        setup.gpu = gpu[0]
    if world_size > _C.MAX_RANKS:
        setup.fallback_reason = f"world size {world_size} exceeds {_C.MAX_RANKS}"
    elif device.type == "cuda":
        from .transport.topology import check_topology

        ok, reason = check_topology(group, device)
        if not ok:
            setup.fallback_reason = reason
    return setup


def _gpu_capacity(engine_class, device, world_size):
    """(this rank's GPU, how many blocks of the engine's kernels it holds at
    once), or None (no GPU kernels, or the GPU cannot tell)."""
    try:
        return engine_class.gpu_capacity(device, world_size)
    except RuntimeError:
        return None
