"""Host transport: one POSIX shared-memory segment per rank."""
import os
import re
import secrets

import torch
import torch.distributed as dist

from .. import _C
from ..group import gather, raise_if_failed

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
        created, mapped, error = [], [], None  # the names to remove, the addresses to unmap on failure
        try:
            # A failure on one rank (a full /dev/shm) goes through the same
            # collectives as the others' success, so every rank raises together
            # instead of some waiting for a rank that never joins.
            try:
                mapped.append(_C.shm_create(name, self.region_bytes))  # zero-filled: flags and epochs start at 0
                created.append(name)
            except Exception as e:  # any: the others must hear of it
                error = str(e)
            peers = gather((name, os.getpid(), error), group)
            created = [n for n, _, e in peers if e is None]
            raise_if_failed([e for _, _, e in peers], "creating the shared-memory segments")
            self.pids = [pid for _, pid, _ in peers]
            try:
                for q, (peer_name, _, _) in enumerate(peers):
                    if q != self.rank:
                        mapped.append(_C.shm_map(peer_name, self.region_bytes))
            except Exception as e:
                error = str(e)
            # Every rank has mapped every segment, or says why not: the names are no longer needed.
            raise_if_failed(gather(error, group), "mapping the peers' shared-memory segments")
            self.regions = mapped[1:]
            self.regions.insert(self.rank, mapped[0])  # rank order, own included
        except BaseException:
            for addr in mapped:
                _C.shm_unmap(addr, self.region_bytes)
            raise
        finally:
            # Any rank may remove any name (a dead peer's too); ENOENT is fine.
            for n in created:
                _C.shm_remove(n)

    def close(self, sync=True):
        """Unmaps every region (local: nothing to agree on, so `sync` changes nothing)."""
        for addr in self.regions:
            _C.shm_unmap(addr, self.region_bytes)
        self.regions = []
