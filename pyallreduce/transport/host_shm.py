"""Host transport: one POSIX shared-memory segment per rank."""
import os
import secrets

import torch
import torch.distributed as dist

from .. import _C


class HostShmTransport:
    """Maps every rank's segment into every rank of `group`.

    Segments are created exclusively with mode 0600 under an unguessable name,
    and unlinked as soon as every rank has mapped them, so nothing stays in
    /dev/shm once the processes are gone, however they end (the memory lives as
    long as a mapping does).
    """

    def __init__(self, group, max_bytes):
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.max_bytes = max_bytes
        self.device = torch.device("cpu")
        self.region_bytes = _C.region_bytes(max_bytes)
        self.regions = []
        name = f"/pyallreduce-{os.getpid()}-{secrets.token_hex(12)}"
        own = _C.shm_create(name, self.region_bytes)  # zero-filled: flags and epochs start at 0
        names = [name]
        try:
            peers = [None] * self.world_size
            dist.all_gather_object(peers, (name, os.getpid()), group=group)
            names = [n for n, _ in peers]
            self.pids = [pid for _, pid in peers]
            for q, peer_name in enumerate(names):
                self.regions.append(own if q == self.rank else _C.shm_map(peer_name, self.region_bytes))
            own = None
            # Every rank has mapped every segment: the names are no longer needed.
            dist.barrier(group=group)
        except BaseException:
            if own is not None:
                _C.shm_unmap(own, self.region_bytes)
            self.close()
            raise
        finally:
            # Any rank may remove any name (a dead peer's too); ENOENT is fine.
            for n in names:
                _C.shm_remove(n)

    def close(self):
        for addr in self.regions:
            _C.shm_unmap(addr, self.region_bytes)
        self.regions = []
