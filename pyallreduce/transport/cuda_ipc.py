"""CUDA transport: one cudaMalloc'd region per rank, exported with legacy CUDA IPC.

Nothing here assumes one GPU per rank: several processes may share a GPU
(legacy IPC maps another process's allocation on the same device too), which
is how the GPU tests run on a single-GPU machine.
"""
import contextlib
import logging
import os

import torch
import torch.distributed as dist

from .. import _C
from ..group import gather, raise_if_failed  # gather looked up here at each call: tests stub it here
from ..protocol import host_id


logger = logging.getLogger("pyallreduce")

# What a close(sync=False) could not free: the own region (peers' kernels may
# still write flags into it, and CUDA leaves freeing an exported allocation a
# peer still maps undefined), registered tensors and the inputs of zero-copy
# graph entries (peers may still read them through their mappings). Kept until
# the process exits, when the driver releases them. Entries: (device index,
# own region address or None, tensors).
_parked = []
PARKED_REASON = ("a communicator was closed without the other ranks (close(sync=False): an exception "
                 "inside `with Communicator(...)`, garbage collection or process exit) or its close failed; "
                 "its region and registered buffers stay allocated until the process exits, because peers "
                 "(or its own kernels) may still use them. Call comm.close() on every rank, outside any "
                 "other thread's CUDA graph capture, to free them")
_parked_logged = False


def park(device_index, own, tensors):
    """Keeps `own` (a region address, or None) and `tensors` allocated until the
    process exits, with one log line saying why."""
    global _parked_logged
    tensors = [t for t in tensors if t is not None]
    if own is None and not tensors:
        return
    _parked.append((device_index, own, tensors))
    if not _parked_logged:
        _parked_logged = True
        logger.warning("pyallreduce: %s", PARKED_REASON)


# The CUDA kernels access every buffer in 16-byte vectors (kVecBytes in
# csrc/cuda/all_reduce.cuh; the C++ side checks it again). Allocation bases are
# far more aligned than that, so a buffer's offset in its allocation tells.
ALIGNMENT_BYTES = 16


class RegistrationError(RuntimeError):
    """register() could not export or map the buffer on some rank.

    Raised on every rank alike, so every rank falls back to the staging copy.
    """


def _device_index(device):
    if device is None:
        return torch.cuda.current_device()
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"pyallreduce: the CUDA transport needs a CUDA device, got {device}")
    return torch.cuda.current_device() if device.index is None else device.index


def agree(error, group, what, exc=RegistrationError):
    """Collective: raises on every rank if `error` (a str or None) is set on any."""
    raise_if_failed(gather(error, group), what, exc)


def buffer_verdict(exported):
    """None if a buffer can be read in place by every rank, else why not.

    exported: every rank's (handle, offset, nbytes) for it, or the string
    saying why that rank could not export it. Every rank gets the same list,
    so every rank reaches the same verdict."""
    failed = [f"rank {q}: {e}" for q, e in enumerate(exported) if isinstance(e, str)]
    if failed:
        return "; ".join(failed)
    sizes = sorted({nbytes for _, _, nbytes in exported})
    if len(sizes) != 1:
        return f"the ranks' buffers differ in size ({sizes} bytes)"
    misaligned = [q for q, (_, offset, _) in enumerate(exported) if offset % ALIGNMENT_BYTES]
    if misaligned:
        return f"the buffers of ranks {misaligned} are not {ALIGNMENT_BYTES}-byte aligned"
    return None


class CudaIpcTransport:
    """Maps every rank's region (protocol.h layout) into every rank of `group`.

    Same interface as HostShmTransport: rank, world_size, max_bytes, device,
    regions (each rank's region base as a device address mapped in this
    process, own included), pids, close(). Plus register(), unregister() and
    share_buffers() for zero copy.

    Lifetimes. A peer's allocation is mapped here once, however many of its
    buffers are read (legacy IPC exports whole allocations, and torch's caching
    allocator puts many tensors in one), and unmapped when its last user goes:
    the peer's region, a registered buffer (until unregister()), a buffer of
    share_buffers() (graph entries: until close()). Our own memory that peers
    map (the region, registered tensors, tensors given to keep()) is freed
    only once every peer has unmapped it: after the unmapping barrier of a
    collective close(), or never before the process exits after a local one.
    """

    def __init__(self, group, max_bytes, device, wait_until_unused):
        """wait_until_unused(): returns once no kernel of the communicator may
        read or write its memory any more (its engine knows how), else raises
        RuntimeError."""
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.max_bytes = max_bytes
        self.device = torch.device("cuda", _device_index(device))
        self.region_bytes = _C.region_bytes(max_bytes)
        self.regions = []
        self.pids = []
        self._group = group
        self._wait_until_unused = wait_until_unused
        self._opened = {}  # peer IPC handle -> [address mapped here, users]
        self._registered = {}  # data_ptr -> [(tensor, the peer handles it maps)]: peers read it in place
        self._kept = []  # other tensors peers map (graph entries' inputs): dropped like registered ones
        self._own = None
        maybe_mapped = False  # whether a peer may have mapped our region
        try:
            # Failures before and during the exchange are shared through the
            # same collectives, so every rank raises together instead of some
            # waiting in a collective that the failed rank never joins.
            error, handle = None, None
            try:
                # Zeroed and synchronised before its handle leaves this process:
                # a peer must never see flags or epochs that are not zero.
                self._own = _C.cuda_alloc_region(self.device.index, self.region_bytes)
                handle = _C.cuda_ipc_handle(self.device.index, self._own)
            except RuntimeError as e:
                error = str(e)
            peers = gather((host_id(), os.getpid(), handle, error), group)
            raise_if_failed([e for _, _, _, e in peers], "allocating and exporting the regions", RuntimeError)
            hosts = sorted({host for host, _, _, _ in peers})
            if len(hosts) != 1:
                raise RuntimeError(
                    f"pyallreduce: CUDA IPC needs every rank on one host; the group spans {hosts}"
                )
            self.pids = [pid for _, pid, _, _ in peers]
            error = None
            maybe_mapped = True  # every rank got this far and maps the others now
            try:
                for q, (_, _, peer_handle, _) in enumerate(peers):
                    self.regions.append(self._own if q == self.rank else self._open(peer_handle))
            except RuntimeError as e:
                error = str(e)
            errors = gather(error, group)
            if any(errors):
                with contextlib.suppress(RuntimeError):  # the mapping error is the one to see
                    self.close(sync=True)  # every rank is here: unmap together, then free
                raise_if_failed(errors, "mapping the peers' regions", RuntimeError)
        except BaseException:
            if maybe_mapped:
                self._close_locally()  # a peer that mapped our region may not have unmapped it yet
            else:
                self._release()
            raise

    def _open(self, handle):
        """Maps a peer's allocation here (once) and counts one more user of it."""
        entry = self._opened.get(handle)
        if entry is None:
            entry = self._opened[handle] = [_C.cuda_ipc_open(self.device.index, handle), 0]
        entry[1] += 1
        return entry[0]

    def _unuse(self, handles):
        """One user fewer of each handle's mapping; unmaps those nobody uses any
        more. Returns None or what went wrong (the others are still unmapped)."""
        errors = []
        for handle in handles:
            entry = self._opened.get(handle)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] > 0:
                continue
            del self._opened[handle]
            try:
                _C.cuda_ipc_close(self.device.index, entry[0])
            except RuntimeError as e:
                errors.append(str(e))
        return "; ".join(errors) or None

    def register(self, tensor):
        """Collective: exports `tensor` for zero-copy reads by every peer.

        Every rank passes its corresponding buffer (same number of bytes).
        Returns every rank's buffer address as mapped in this process (own
        included) for _C.cuda_register_buffer. Raises RegistrationError on every
        rank when any rank's memory cannot be exported or mapped (torch's
        expandable segments and cudaMallocAsync memory cannot be exported with
        legacy IPC): the caller then keeps the staging copy. The tensor is kept
        alive until unregister() or close() (see the class docstring), so its
        memory is never reused while peers may read it; the peers' buffers stay
        mapped as long.
        """
        if not (tensor.is_cuda and tensor.device == self.device and tensor.is_contiguous()):
            buffer = f"needs a contiguous tensor on {self.device}, got {tensor.device}"
        else:
            buffer = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
        (addrs,), (handles,) = self._share([buffer])
        if isinstance(addrs, str):
            raise RegistrationError(f"pyallreduce: register: {addrs}")
        # The C++ table keeps one entry per address (registering a buffer again
        # is a no-op there); this side keeps every registration of it until
        # unregister(), as any of them may be the one the kernels read.
        self._registered.setdefault(tensor.data_ptr(), []).append((tensor, handles))
        return addrs

    def unregister(self, ptr):
        """Local: forgets the buffer registered at `ptr` and unmaps the peers'
        allocations nothing else here uses. Returns (the tensors registered
        there, none when it was not; None or what went wrong unmapping). The
        caller makes sure no kernel of ours can read the peers' buffers any
        more before, and keeps the tensors until every peer has unmapped them
        after (see Communicator.unregister)."""
        entries = self._registered.pop(ptr, [])
        return [t for t, _ in entries], self._unuse([h for _, handles in entries for h in handles])

    def keep(self, tensors):
        """Keeps tensors that peers map (inputs of zero-copy graph entries)
        alive as long as the registered ones: until the unmapping barrier of a
        collective close(), or until the process exits after a local one."""
        self._kept.extend(tensors)

    def share_buffers(self, buffers):
        """Collective: maps every rank's buffers[i] into every rank.

        buffers: this rank's (address, nbytes) per buffer, or a string saying
        why it cannot be shared; every rank passes the same number, rank q's
        buffers[i] corresponding to everyone's buffers[i]. Returns per buffer
        either every rank's address of it as mapped here (own included) or why
        it cannot be read in place; the verdicts are the same on every rank.
        Raises RegistrationError on every rank if mapping failed anywhere.
        The peers' allocations stay mapped until close(). Keeping our own
        memory alive while peers may read it is the caller's part.
        """
        return self._share(buffers)[0]

    def _share(self, buffers):
        """share_buffers(), plus per buffer the peer handles it mapped (one use
        of each, for _unuse)."""
        exported = [buf if isinstance(buf, str) else self._export(*buf) for buf in buffers]
        every = gather(exported, self._group)
        counts = {len(e) for e in every}
        if len(counts) != 1:
            raise RegistrationError(f"pyallreduce: ranks shared different numbers of buffers {sorted(counts)}")
        verdicts = [buffer_verdict([e[i] for e in every]) for i in range(len(buffers))]

        results, used, error = [], [], None
        try:
            for i, reason in enumerate(verdicts):
                handles = []
                used.append(handles)
                if reason is not None:
                    results.append(reason)
                    continue
                addrs = []
                for q, e in enumerate(every):
                    if q == self.rank:
                        addrs.append(buffers[i][0])
                    else:
                        addrs.append(self._open(e[i][0]) + e[i][1])
                        handles.append(e[i][0])
                results.append(addrs)
        except RuntimeError as e:
            error = str(e)
        try:
            agree(error, self._group, "mapping the peers' buffers")
        except RegistrationError:
            self._unuse([h for handles in used for h in handles])  # nothing will read them
            raise
        return results, used

    def _export(self, ptr, nbytes):
        """(IPC handle of ptr's allocation, ptr's offset in it, nbytes), or why not."""
        index = self.device.index
        try:
            if not _C.cuda_ipc_exportable(index, ptr):
                return ("memory cannot be exported with legacy CUDA IPC (expandable segments "
                        "or a cudaMallocAsync pool?)")
            base, _ = _C.cuda_address_range(index, ptr)
            return (_C.cuda_ipc_handle(index, base), ptr - base, nbytes)
        except RuntimeError as e:
            return str(e)

    def close(self, sync=True):
        """Unmaps the peers and frees the own region and drops the tensors peers
        read in place (registered, kept).

        With sync (the default) this is collective, because CUDA leaves freeing
        an exported allocation that another process still maps undefined: the
        device is synchronised and the group passes a barrier (no kernel reads
        any region any more; a one-shot call has no end barrier, so a peer may
        read our staging buffer after our own kernel ended), every rank unmaps
        its peers, an agreement (a second barrier that also shares errors), then
        every rank frees its own memory. If any rank failed on the way, nobody
        frees: see sync=False.
        sync=False does not wait for the peers: for error paths and process
        exit, when the peers may be gone or elsewhere. It waits for our own
        kernels (bounded by their deadline), unmaps the peers, and keeps the
        own region and the tensors allocated until the process exits (module
        list `_parked`, one log line), since peers' kernels may still write
        flags into the region and peers may still map it all. If the wait
        fails (a graph replay it cannot wait for beside another thread's
        capture, an unusable device), the peers stay mapped too.
        """
        if not (sync and self._own is not None and dist.is_initialized()):
            self._close_locally()
            return
        error = None
        try:
            self._wait_until_unused()
        except RuntimeError as e:
            error = f"waiting for the communicator's kernels failed: {e}"
        try:
            agree(error, self._group, "closing the communicator", RuntimeError)  # the first barrier
        except RuntimeError:
            self._close_locally()
            raise
        error = self._close_peers()
        try:
            agree(error, self._group, "unmapping the peers' memory", RuntimeError)  # the second barrier
        except RuntimeError:
            self._close_locally()  # some peer still maps our memory
            raise
        self._release()

    def _close_peers(self):
        """Unmaps every peer allocation; returns None or what went wrong."""
        errors = []
        for addr, _ in self._opened.values():
            try:
                _C.cuda_ipc_close(self.device.index, addr)
            except RuntimeError as e:
                errors.append(str(e))
        self._opened = {}
        self.regions = []
        return "; ".join(errors) or None

    def _close_locally(self):
        """close(sync=False): see there."""
        try:
            if self._own is not None or self._opened:
                self._wait_until_unused()
        except Exception:  # CUDA errors of a failed device come in several types
            self._opened, self.regions = {}, []  # our kernels may still read them: they stay mapped
        error = self._close_peers()
        own, self._own = self._own, None
        tensors = [t for entries in self._registered.values() for t, _ in entries] + self._kept
        self._registered, self._kept = {}, []
        park(self.device.index, own, tensors)
        if error:
            raise RuntimeError("pyallreduce: closing peer mappings failed: " + error)

    def _release(self):
        """Frees everything at once: only when no peer maps our memory any more
        (or never did) and no kernel uses it."""
        error = self._close_peers()
        self._registered, self._kept = {}, []
        if self._own is not None:
            own, self._own = self._own, None
            _C.cuda_free_region(self.device.index, own)
        if error:
            raise RuntimeError("pyallreduce: closing peer mappings failed: " + error)
