"""The Triton engine: pyallreduce.triton_kernels over the transport's regions
(CUDA IPC on a GPU; POSIX shared memory under TRITON_INTERPRET=1 on CPU).
Keeps the C++ backends' rules: a failure mid-protocol breaks the engine for
good, a mismatch (every rank raises it, epochs back in step) does not; and on
a GPU one communicator's launches run one after another whatever stream each
is on (csrc/cuda/call_plan.h LaunchOrder)."""
from __future__ import annotations

import threading
from typing import Optional

import torch

from .. import _C, triton_kernels
from ..protocol import staged_piece_bytes
from . import make_transport, no_graph_table, relaxed_capture_mode, set_up_on_every_rank, stream_capturing
from .cuda import CUDA_NBLOCKS
from .native import checked_nblocks

# Programs per rank on CPU, where the interpreter runs them one after another:
# few keeps the per-call cost down.
TRITON_CPU_NBLOCKS = 2


class TritonEngine:
    name = "triton"
    handle: Optional[int] = None  # no C++ context: no eager fast path

    def __init__(self, group, rank, device, max_bytes, nblocks, timeout_s):
        self.device, self.max_bytes, self.rank, self.nblocks, self.timeout_s = (
            device, max_bytes, rank, nblocks, timeout_s)
        self.transport = make_transport(group, max_bytes, device, self.wait_until_unused)
        self.world_size = self.transport.world_size
        self._broken_reason = None
        self._last_stream, self._launched = None, None  # the launch order on a GPU
        self._captured = False  # a launch went into a CUDA graph, which may replay on any stream
        # Held by a launch and by close(): a close on another thread (abort()) waits for a
        # launch in progress, and for an interpreted kernel, which runs inside its launch.
        self._launching = threading.Lock()
        set_up_on_every_rank(self, group, lambda: triton_kernels.prepare(self.transport.regions, device))

    @classmethod
    def resolve_nblocks(cls, nblocks, device):
        if nblocks is None:
            nblocks = CUDA_NBLOCKS if device.type == "cuda" else TRITON_CPU_NBLOCKS
        return checked_nblocks(nblocks)

    @classmethod
    def gpu_capacity(cls, device, world_size):
        """One program per SM, which these kernels always fit (not queried)."""
        if device.type != "cuda" or world_size > _C.MAX_RANKS:
            return None
        return (_C.cuda_pci_bus_id(device.index), torch.cuda.get_device_properties(device.index).multi_processor_count)

    def all_reduce(self, src, dst, algo, average, call):
        self._launch(triton_kernels.all_reduce, src, dst, self.transport.regions, self.rank, self.world_size,
                     self.max_bytes, self.nblocks, algo, average, self.timeout_s, call)

    def scatter_or_gather(self, collective, src, dst, average, call):
        common = (self.transport.regions, self.rank, self.world_size, self.max_bytes, self.nblocks)
        if collective == _C.REDUCE_SCATTER:
            self._launch(triton_kernels.reduce_scatter, src, dst, *common, average, self.timeout_s, call)
        else:
            self._launch(triton_kernels.all_gather, src, dst, *common, self.timeout_s, call)

    def agree(self, dtype_code, nbytes, mode, average, in_place, collective, call, device):
        self._launch(triton_kernels.agree, dtype_code, nbytes, mode, average, in_place, self.transport.regions,
                     self.rank, self.world_size, self.nblocks, self.timeout_s, device, call, algo=collective)

    def piece_bytes(self, collective, element_size):
        return staged_piece_bytes(self.max_bytes, self.world_size, collective, element_size)

    def register(self, tensor):
        return False  # every call copies through staging

    def unregister(self, tensor):
        return False

    def capture(self):
        return no_graph_table()

    def check(self):
        pass  # a call raises what its kernel recorded

    def wait_until_unused(self):
        """No kernel of this communicator may still run once this returns
        (csrc/cuda/runtime.h wait_until_unused): its eager launches, or the
        whole device once one was captured. Raises RuntimeError when CUDA
        cannot wait now."""
        if self.device.type == "cuda":
            launched = self._launched.cuda_event if self._launched is not None else 0
            _C.cuda_wait_for_launches(self.device.index, launched, self._captured)

    def interrupt(self, end_kernels):
        # Not under _launching, which the launch whose kernel waits holds.
        self._broken_reason = "it was aborted"
        if end_kernels:
            triton_kernels.interrupt(self.transport.regions, self.device)

    def close(self, sync):
        with self._launching:
            regions = list(self.transport.regions)  # close() empties them
            try:
                self.wait_until_unused()
                waited = True
            except Exception:  # the transport's close raises it or parks: so do the kernels' tables
                waited = False
            self.transport.close(sync=sync)
            if waited:
                triton_kernels.release(regions, self.device)

    def _launch(self, fn, *args, **kwargs):
        with self._launching:
            self._launch_now(fn, *args, **kwargs)

    def _launch_now(self, fn, *args, **kwargs):
        if self._broken_reason is not None:
            raise RuntimeError(f"pyallreduce: this communicator is unusable after an earlier failure "
                               f"({self._broken_reason}); close() it and create a new Communicator on every rank")
        # Captured launches are not chained, as in the CUDA engine.
        stream = None
        if self.device.type == "cuda" and stream_capturing(self.device):
            self._captured = True
        elif self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            if self._last_stream is not None and self._last_stream != stream:
                stream.wait_event(self._launched)
        try:
            fn(*args, **kwargs)
        except triton_kernels.CallMismatch as e:
            raise RuntimeError(str(e)) from None
        except RuntimeError as e:
            self._broken_reason = str(e).split("\n", 1)[0]  # epochs are out of step across ranks now
            raise
        finally:
            if stream is not None:
                with relaxed_capture_mode(self.device):  # the first record creates the event
                    self._launched = self._launched or torch.cuda.Event()
                    self._launched.record(stream)
                self._last_stream = stream
