"""The CUDA engine: the native engine's C++ context with the CUDA kernels, over
CUDA IPC (transport/cuda_ipc.py). Owns what only these kernels have:
registered (zero-copy) buffers, the graph table of comm.capture(), the status
record's check, and a close that parks what peers may still map."""
from __future__ import annotations

import contextlib

from .. import _C, logs
from ..protocol import staged_piece_bytes
from ..transport import cuda_ipc  # its functions looked up at each call: tests stub them there
from . import set_up_on_every_rank, stream_capturing
from .native import NativeEngine, checked_nblocks

CUDA_NBLOCKS = 32  # not yet measured on a GPU; see README
# Graph-table entries per block (72 bytes of device memory each): one
# comm.capture() can make at least half a block of captured calls zero copy.
GRAPH_TABLE_BLOCK = 8192
CAPTURE_ABORTED = "its capture raised"  # what a rank whose capture failed tells the others at exit


class CudaEngine(NativeEngine):
    name = "cuda"

    def __init__(self, group, rank, device, max_bytes, nblocks, timeout_s):
        super().__init__(group, rank, device, max_bytes, nblocks, timeout_s)
        self.group = group
        # The status record and launch-order event: here, not at the first call, which may be in a capture.
        set_up_on_every_rank(self, group, lambda: _C.cuda_prepare(self.handle))

    @classmethod
    def resolve_nblocks(cls, nblocks, device):
        return checked_nblocks(CUDA_NBLOCKS if nblocks is None else nblocks)

    @classmethod
    def gpu_capacity(cls, device, world_size):
        if world_size > _C.MAX_RANKS:
            return None
        return (_C.cuda_pci_bus_id(device.index), _C.cuda_resident_blocks(device.index, world_size))

    def piece_bytes(self, collective, element_size):
        return staged_piece_bytes(self.max_bytes, self.transport.world_size, collective, element_size)

    def check(self):
        _C.check(self.handle)

    _captured = False  # the context's capture mark, kept when close frees its record

    def wait_until_unused(self):
        """No kernel of this communicator may still run once this returns
        (csrc/cuda/runtime.h wait_until_unused): its eager launches, or the
        whole device once one was captured. Raises RuntimeError when CUDA
        cannot wait now."""
        if self.handle is None and self.unwaited is not None:
            raise RuntimeError(self.unwaited)
        launched = 0  # closing, the record gone: its eager kernels were waited for before
        if self.handle is not None:
            launched, self._captured = _C.cuda_launch_chain(self.handle)
        _C.cuda_wait_for_launches(self.device.index, launched, self._captured)

    # ---- registered buffers ----------------------------------------------------

    def register(self, tensor):
        try:
            addrs = self.transport.register(tensor)
        except cuda_ipc.RegistrationError as e:
            logs.log_once(f"buffer not registered, the staging copy is used: {e}")
            return False
        _C.cuda_register_buffer(self.handle, tensor.data_ptr(), tensor.nbytes, addrs)
        return True

    def unregister(self, tensor):
        ptr, kept, error, found = tensor.data_ptr(), [], None, False
        try:
            self.wait_until_unused()
            found = _C.cuda_unregister_buffer(self.handle, ptr)
            kept, error = self.transport.unregister(ptr)
        except RuntimeError as e:
            error = str(e)
        try:
            cuda_ipc.agree(error, self.group, "unregistering a buffer", RuntimeError)
        except RuntimeError:
            cuda_ipc.park(self.device.index, None, kept)
            raise
        return bool(found or kept)

    # ---- the graph table ---------------------------------------------------------

    @contextlib.contextmanager
    def capture(self):
        """Collective: the graph table around the captures of a comm.capture()
        (Communicator.capture says what it does for the user)."""
        self._open_graph_table()
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):  # the capture's own error is the one to see
                self._register_captured(aborted=True)
            raise
        self._register_captured(aborted=False)

    def _open_graph_table(self):
        """Collective: opens the graph table on every rank, or on none."""
        error = None
        try:
            _C.cuda_graph_capture_begin(self.handle, GRAPH_TABLE_BLOCK)
        except RuntimeError as e:
            error = str(e)
        try:
            cuda_ipc.agree(error, self.group, "opening the graph table for comm.capture()", RuntimeError)
        except RuntimeError:
            if error is None:
                _C.cuda_graph_capture_end(self.handle)  # opened here, but not on every rank
            raise

    def _register_captured(self, aborted):
        """Collective, at capture() exit: makes the captured calls that have a
        graph entry on every rank zero copy on every rank, or on none. Every
        rank makes the same gathers whatever happens here: a rank whose capture
        failed (aborted) or that cannot take part says so in the first one and
        every other rank raises, instead of some waiting for the others."""
        calls, calls_without_entry, problem = [], 0, CAPTURE_ABORTED if aborted else None
        try:
            calls, calls_without_entry = _C.cuda_graph_capture_end(self.handle)
            if stream_capturing(self.device):
                problem = problem or ("leave comm.capture() after the torch.cuda.graph(...) capture "
                                      "ended, not inside it")
        except RuntimeError as e:
            problem = problem or str(e)
        # Per call: (bytes, in place, algo, dtype, average, has an entry here).
        every = cuda_ipc.gather(problem or [(*signature, slot >= 0) for slot, _, *signature in calls], self.group)
        if aborted:
            return  # the capture's own error propagates
        mismatch = captures_mismatch(every)
        if mismatch:
            raise RuntimeError(mismatch)
        if calls_without_entry:
            logs.log_once(f"{calls_without_entry} captured calls keep the staging copy: more than "
                          f"{GRAPH_TABLE_BLOCK // 2} in one comm.capture() may not all get a graph entry")
        # A call is zero copy only where every rank could give it an entry
        # (an input a rank had to copy for alignment has none there).
        zero_copy = [k for k in range(len(calls)) if all(e[k][-1] for e in every)]
        if not zero_copy:
            return
        buffers = [(calls[k][1], calls[k][2]) for k in zero_copy]
        try:  # no kernel of ours may read an entry while it changes, on any rank
            self.wait_until_unused()
        except RuntimeError as e:  # the peers still take part in the exchange below
            buffers = [f"waiting for the communicator's kernels failed: {e}"] * len(zero_copy)
        try:
            shared = self.transport.share_buffers(buffers)
        except cuda_ipc.RegistrationError as e:  # raised on every rank alike
            logs.log_once(f"the captured calls keep the staging copy: {e}")
            return
        kept = [addrs for addrs in shared if isinstance(addrs, str)]
        if kept:
            logs.log_once(f"{len(kept)} of {len(zero_copy)} captured calls keep the staging copy: {kept[0]}")
        slots = [calls[k][0] for k, addrs in zip(zero_copy, shared) if not isinstance(addrs, str)]
        error = None
        try:
            _C.cuda_graph_set_entries(self.handle, slots, [a for a in shared if not isinstance(a, str)])
        except RuntimeError as e:
            error = str(e)
        try:  # also: nobody replays before every rank wrote
            cuda_ipc.agree(error, self.group, "registering the captured buffers", RuntimeError)
        except RuntimeError:
            _C.cuda_graph_reset_entries(self.handle, slots)  # staged again, like every other rank
            raise

    # ---- closing -----------------------------------------------------------------

    def close(self, sync):
        try:
            if self.handle is not None:
                # First no call of another thread runs or starts (seal_context waits for
                # one in flight): such a call uses the status record and may launch a
                # kernel that nothing below would wait for. Then no kernel of ours may
                # read the graph table or the status record while they are freed; if
                # that cannot be known (a replay beside another thread's capture, an
                # unusable device), they stay, with the context. The inputs of zero-copy
                # graph entries, which peers map, come back: the transport drops them
                # with the registered buffers, after every rank has unmapped them (or
                # never, without sync).
                # Without the peers (an abort, an error, exit) once kernels were captured,
                # nothing is waited for: a graph may replay them at any time, after this
                # close too, so no wait makes freeing safe, and the device-wide wait could
                # hang behind another library's kernel that waits for a dead peer (as
                # ncclCommAbort does not wait for it). Everything stays, as below.
                _C.seal_context(self.handle)
                self._captured = _C.cuda_launch_chain(self.handle)[1]
                if self._captured and not sync:
                    self.unwaited = ("pyallreduce: a communicator was closed without its peers after its kernels "
                                     "were captured into CUDA graphs, which may still replay them: what they use "
                                     "stays allocated and mapped until the process exits")
                    logs.log_once(self.unwaited)
                else:
                    try:
                        self.wait_until_unused()
                    except Exception as e:  # CUDA errors of a failed device come in several types
                        self.unwaited = str(e)
                    else:
                        self.transport.keep(_C.cuda_clear_buffers(self.handle))
        finally:
            super().close(sync)


def captures_mismatch(every):
    """None, or the error for ranks whose captures inside comm.capture() differ.
    every[q]: rank q's (bytes, in place, algo, dtype, average, has an entry)
    per captured call, or why rank q cannot take part (CAPTURE_ABORTED: its
    capture raised)."""
    failed = [f"rank {q}: {calls}" for q, calls in enumerate(every) if isinstance(calls, str)]
    if failed:
        return ("pyallreduce: comm.capture() failed on " + "; ".join(failed) + ". Do not replay this "
                "graph on the other ranks: its calls would wait for ranks that never replay")
    if all([c[:-1] for c in calls] == [c[:-1] for c in every[0]] for calls in every):
        return None
    rows = "\n".join(f"  rank {q}: {len(calls)} calls, (bytes, in place, algo, dtype, avg) of the first: "
                     f"{[c[:-1] for c in calls[:3]]}" for q, calls in enumerate(every))
    return ("pyallreduce: the ranks captured different all_reduce calls inside comm.capture(); every "
            "rank must capture the same calls in the same order, or the replays wait for each other "
            f"until the deadline:\n{rows}")
