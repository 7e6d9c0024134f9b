"""Host transport: one POSIX shared-memory segment per rank."""
import os
import re
import secrets

import torch
import torch.distributed as dist

from .. import _C

SEGMENT_PREFIX = "pyallreduce-"
_SEGMENT = re.compile(SEGMENT_PREFIX + r"(\d+)-")  # pyallreduce-<creator pid>-<random>
SHM_DIR = "/dev/shm"


def leaked_segments():
    """Our segments in /dev/shm whose creating process is gone: nobody will ever
    unlink them. (A live creator's segment is a setup in progress.)"""
    return sorted(n for n in os.listdir(SHM_DIR)
                  if (m := _SEGMENT.match(n)) and not os.path.exists(f"/proc/{m.group(1)}"))


class HostShmTransport:
    """Maps every rank's segment into every rank of `group`.

    Segments are created exclusively with mode 0600 under an unguessable name,
    and unlinked as soon as every rank has mapped them, so nothing stays in
    /dev/shm once the processes are gone (the memory lives as long as a mapping
    does), unless every rank is killed outright between creating and unlinking.
    """

    def __init__(self, group, max_bytes):
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.max_bytes = max_bytes
        self.device = torch.device("cpu")
        self.region_bytes = _C.region_bytes(max_bytes)
        self.regions = []
        name = f"/{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(12)}"
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

    def close(self, sync=True):
        """Unmaps every region (local: nothing to agree on, so `sync` changes nothing)."""
        for addr in self.regions:
            _C.shm_unmap(addr, self.region_bytes)
        self.regions = []
