"""The native engine: the C++ context (csrc/) over a transport's regions.
Serves CPU tensors (POSIX shared memory); the CUDA engine builds on it."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .. import _C, policy
from . import CLOSED_DURING_CALL, make_transport, no_graph_table

# The op overloads themselves: calling them skips torch.ops' overload resolution.
_all_reduce_out = torch.ops.pyallreduce.all_reduce_out.default
_all_reduce_inplace = torch.ops.pyallreduce.all_reduce_.default
_reduce_scatter_out = torch.ops.pyallreduce.reduce_scatter_out.default
_all_gather_out = torch.ops.pyallreduce.all_gather_out.default


def checked_nblocks(nblocks) -> int:
    if not 1 <= int(nblocks) <= _C.MAX_BLOCKS:
        raise ValueError(f"pyallreduce: nblocks must be in 1..{_C.MAX_BLOCKS}, got {nblocks}")
    return int(nblocks)


class NativeEngine:
    name = "cpu"
    handle: Optional[int] = None  # the C++ context, from construction to close
    # Why close could not wait for the kernels (None: it did, or had none): then
    # everything they may still use stays allocated until the process exits.
    unwaited: Optional[str] = None

    def __init__(self, group, rank: int, device: torch.device, max_bytes: int, nblocks: int, timeout_s: float):
        self.device, self.max_bytes = device, max_bytes
        self.transport = make_transport(group, max_bytes, device, self.wait_until_unused)
        try:
            self.handle = _C.create_context(
                self.transport.regions, rank, max_bytes, nblocks, timeout_s,
                device.index if device.index is not None else -1, self.transport.pids,
                device.type == "cpu" and policy.ranks_outnumber_cores(self.transport.pids))
        except BaseException:
            self._close_transport(sync=False)
            raise

    @classmethod
    def resolve_nblocks(cls, nblocks, device: torch.device) -> int:
        return 1  # the host kernel runs one block per rank

    @classmethod
    def gpu_capacity(cls, device: torch.device, world_size: int):
        """(this rank's GPU, how many blocks of our kernels it holds at once), or None."""
        return None

    def _handle_of_call(self) -> int:
        handle = self.handle  # read once: a close() on another thread clears it
        if handle is None:  # (one that closed it after the call read the handle: csrc's get_context says so)
            raise RuntimeError(CLOSED_DURING_CALL)
        return handle

    def all_reduce(self, src, dst, algo, average, call):
        if src is dst:
            _all_reduce_inplace(dst, self._handle_of_call(), algo, average)
        else:
            _all_reduce_out(src, dst, self._handle_of_call(), algo, average)

    def scatter_or_gather(self, collective, src, dst, average, call):
        if collective == _C.REDUCE_SCATTER:
            _reduce_scatter_out(src, dst, self._handle_of_call(), average)
        else:
            _all_gather_out(src, dst, self._handle_of_call())

    def agree(self, dtype_code, nbytes, mode, average, in_place, collective, call, device):
        _C.agree(self._handle_of_call(), dtype_code, nbytes, mode, average, in_place, collective)

    def piece_bytes(self, collective, element_size):
        return None  # the host kernels run reduce-scatter and all-gather of any size in rounds

    def register(self, tensor) -> bool:
        return False  # every call copies through staging

    def unregister(self, tensor) -> bool:
        return False

    def capture(self) -> contextlib.AbstractContextManager:
        return no_graph_table()

    def check(self) -> None:
        pass  # host calls raise at once

    def wait_until_unused(self) -> None:
        pass  # a host call has finished when it returns

    def interrupt(self, end_kernels: bool) -> None:
        handle = self.handle  # read once: close() may clear it meanwhile
        if handle is not None:
            _C.abort_context(handle, end_kernels)

    def close(self, sync: bool) -> None:
        try:
            self._destroy_context()
        finally:
            self._close_transport(sync)

    def _destroy_context(self):
        if self.handle is not None:
            _C.destroy_context(self.handle, keep_alive=self.unwaited is not None)
            self.handle = None

    def _close_transport(self, sync):
        self.transport.close(sync=sync)
