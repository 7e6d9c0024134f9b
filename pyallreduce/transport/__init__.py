"""Symmetric regions: every rank allocates one region (csrc/common/protocol.h
layout), exports it, and maps every peer's. A transport never reduces.

Every transport exposes: rank, world_size, max_bytes, device (torch.device),
regions (list[int]: each rank's region base address as mapped in this
process, own included), pids (list[int]) and close().
"""
from .host_shm import HostShmTransport

__all__ = ["HostShmTransport"]
