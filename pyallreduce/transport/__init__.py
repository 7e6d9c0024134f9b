"""Symmetric regions: every rank allocates one region (csrc/common/protocol.h
layout), exports it, and maps every peer's. A transport never reduces.
`Transport` is what every transport offers; HostShmTransport (POSIX shared
memory) and cuda_ipc.CudaIpcTransport (CUDA IPC, imported only for GPUs)
implement it."""
from __future__ import annotations

from typing import List, Protocol

import torch

from .host_shm import HostShmTransport


class Transport(Protocol):
    rank: int
    world_size: int
    max_bytes: int
    device: torch.device
    regions: List[int]  # each rank's region base address as mapped in this process, own included
    pids: List[int]     # each rank's process id

    def close(self, sync: bool = True) -> None:
        """Unmaps the peers and releases the own region; `sync`: collectively,
        where the transport must agree with the peers before freeing."""


__all__ = ["HostShmTransport", "Transport"]
