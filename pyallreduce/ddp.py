"""DDP communication hook: gradient buckets averaged by a pyallreduce Communicator.

    model = torch.nn.parallel.DistributedDataParallel(module, ...)
    state = pyallreduce.ddp.register(model)                    # every rank, before backward
    state = pyallreduce.ddp.register(model, compression="bf16")

The result is the same as DDP's default hook (the bucket averaged over the ranks of the
model's process group); only the way the bytes move differs.

* CPU: the reduction runs inside the hook, on the thread that calls it, and the hook
  returns a completed Future.
* CUDA: the reduction runs on a dedicated side stream that first waits for the stream the
  bucket was produced on, so backward keeps computing while the bucket is reduced; the
  Future is created for the device and completed while the side stream is current, so
  whoever waits on it (DDP, before it copies the result into the gradients) waits for the
  side stream's work on the GPU, not on the host. `nblocks` bounds how many blocks the
  kernel takes from the SMs the training runs on.
* Zero copy (CUDA only): DDP's bucket buffers live for the whole training once DDP has
  rebuilt its buckets after the first iteration, so each one is registered with the
  communicator (`Communicator.register`, where the communicator has it) and read in place
  instead of through the staging buffers. Registration is collective; it happens in bucket
  index order, which DDP follows on every rank, and again for every bucket after DDP's
  rebuild (the one moment all ranks agree the storage may have moved). At the first hook
  call after the rebuild every buffer registered before it (the first iteration's buckets,
  their compressed copies) is unregistered, in bucket index order, so that DDP's old
  buckets are freed and unmapped by the peers instead of doubling the gradients' memory.
  On CPU this is a no-op: the host kernel always copies through its shared-memory staging
  buffers.
* Buckets the communicator should not take (its group cannot be served, a dtype it does not
  reduce, sizes where the crossover table says the reference wins) go to the process
  group's own asynchronous all-reduce, with the reason logged once.
* Several hosts: see `Hierarchy`.
"""
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import logs
from .communicator import Communicator
from .protocol import host_id

COMPRESSION = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}

__all__ = ["HookState", "Hierarchy", "allreduce_hook", "register", "COMPRESSION"]


@dataclass
class Hierarchy:
    """Reduction of a group that spans several hosts, each with the same number of ranks.

    (a) all-reduce the whole bucket inside the host (pyallreduce, `host_group`);
    (b) local rank i all-reduces shard i of it across hosts with the group's own backend
        (`cross_group`: the ranks with local rank i on every host);
    (c) every rank zeroes all but its own shard and all-reduces the bucket inside the host
        again, which gathers the shards.

    A reduce-scatter and an all-gather would move 1/local_size of the bucket in (a) and
    (c); both use all-reduce here (written before the Communicator had the other two
    collectives), so both move the whole bucket. (c) is still
    exact: every element is its owner's value plus zeros, and x + 0 == x in any order and
    precision. Only (b) crosses hosts, with 1/local_size of the bucket per rank, which is the
    point of the hierarchy.
    """
    host_group: object
    cross_group: object
    local_rank: int
    local_size: int
    nhosts: int


class HookState:
    """What `allreduce_hook` needs: the communicator, the options and counters.

    Counters (per rank): calls (hook calls), reference_calls (buckets given to the process
    group's own all-reduce), registrations and unregistrations (zero-copy buffers), seconds
    (host time spent inside the hook; on CPU the whole reduction, on CUDA only issuing the
    work).
    """

    def __init__(self, model, communicator=None, *, compression=None, nblocks=None, backend=None,
                 max_bytes=None, timeout=None, hierarchical=True):
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"pyallreduce.ddp: expected a torch.nn.parallel.DistributedDataParallel model, "
                            f"got {type(model).__name__}; wrap the module in DistributedDataParallel first")
        if getattr(model, "is_multi_device_module", False):
            raise ValueError("pyallreduce.ddp: the module's parameters are on several devices; "
                             "the hook serves single-device modules")
        if compression not in COMPRESSION:
            raise ValueError(f"pyallreduce.ddp: compression must be None, 'bf16' or 'fp16', got {compression!r}")
        self.group = model.process_group
        self.world_size = dist.get_world_size(self.group)
        self.device = model.device
        self.compression = COMPRESSION[compression]
        self.calls = 0
        self.reference_calls = 0
        self.registrations = 0
        self.unregistrations = 0
        self.seconds = 0.0
        self.hierarchy = None
        self._model = weakref.ref(model)  # DDP holds the state: no cycle through it
        self._always_reference = None  # a reason every bucket goes to the reference
        self._owned = []  # communicators created here, closed by close()
        # bucket index -> (the tensor registered, or None where the communicator declined it,
        # its data_ptr, nbytes): what was last registered for the bucket
        self._registered = {}
        self._wire = {}  # bucket index -> persistent low-precision buffer (compression + zero copy)
        self._seen_rebuild = False  # whether the buffers registered before DDP's rebuild are gone

        comm_options = {k: v for k, v in dict(nblocks=nblocks, backend=backend, max_bytes=max_bytes,
                                               timeout=timeout).items() if v is not None}
        if communicator is not None:
            self._check_communicator(communicator, comm_options)
            self.comm = communicator
        else:
            self.comm = self._create_communicator(comm_options, hierarchical)
        self._zero_copy = (self.comm is not None and self.device.type == "cuda"
                           and self.comm.fallback_reason is None and hasattr(self.comm, "register"))
        self._stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None

    # ---- construction --------------------------------------------------------

    def _check_communicator(self, comm, comm_options):
        if comm_options:
            raise ValueError(f"pyallreduce.ddp: {sorted(comm_options)} only apply when register() creates "
                             "the communicator; pass them to Communicator(...) instead")
        if not isinstance(comm, Communicator):
            raise TypeError(f"pyallreduce.ddp: communicator must be a pyallreduce.Communicator, "
                            f"got {type(comm).__name__}")
        if dist.get_process_group_ranks(comm.group) != dist.get_process_group_ranks(self.group):
            raise ValueError("pyallreduce.ddp: the communicator's group is not the model's process group")
        if comm.device != self.device:
            raise ValueError(f"pyallreduce.ddp: the communicator serves {comm.device} but the model is on "
                             f"{self.device}")

    def _create_communicator(self, comm_options, hierarchical):
        """Collective over the model's group: host names, and subgroups when there are several hosts."""
        hosts = [None] * self.world_size
        dist.all_gather_object(hosts, host_id(), group=self.group)
        names = list(dict.fromkeys(hosts))  # hosts in order of first rank: the same on every rank
        if len(names) == 1:
            comm = Communicator(self.group, device=self.device, **comm_options)
            self._owned.append(comm)
            return comm
        members = [[r for r, h in enumerate(hosts) if h == name] for name in names]
        reason = None
        if not hierarchical:
            reason = "the group spans several hosts and hierarchical=False"
        elif self.world_size != dist.get_world_size():
            # dist.new_group must be called by every rank of the world, and the ranks outside
            # this group do not run this code.
            reason = "the group spans several hosts but is not the world group"
        elif len({len(m) for m in members}) != 1:
            reason = f"the hosts have different numbers of ranks {[len(m) for m in members]}"
        elif len(members[0]) == 1:
            reason = "one rank per host: there is nothing to reduce inside a host"
        if reason is not None:
            self._always_reference = reason
            return None
        rank = dist.get_rank(self.group)
        host_group = cross_group = None
        for m in members:  # every rank creates every subgroup, in the same order
            g = dist.new_group(m)
            if rank in m:
                host_group = g
        local_size = len(members[0])
        for i in range(local_size):
            g = dist.new_group([m[i] for m in members])
            if rank in (m[i] for m in members):
                cross_group = g
        local_rank = next(m.index(rank) for m in members if rank in m)
        self.hierarchy = Hierarchy(host_group, cross_group, local_rank, local_size, len(members))
        comm = Communicator(host_group, device=self.device, **comm_options)
        self._owned.append(comm)
        return comm

    def close(self):
        """Closes the communicators register() created (not one passed in). Not collective."""
        for comm in self._owned:
            comm.close()
        self._owned = []

    def __repr__(self):
        how = f"hierarchical over {self.hierarchy.nhosts} hosts" if self.hierarchy else "flat"
        if self._always_reference:
            how = f"reference ({self._always_reference})"
        return (f"HookState({how}, compression={self.compression}, calls={self.calls}, "
                f"reference_calls={self.reference_calls}, seconds={self.seconds:.3f})")

    # ---- one bucket ------------------------------------------------------------

    def _reference_reason(self, dtype, nbytes):
        """Why this bucket should go to the process group's all-reduce; None if it should not.
        Every input is the same on every rank, so every rank makes the same choice."""
        if self._always_reference is not None:
            return self._always_reference
        return self.comm._reference_reason(dtype, nbytes)

    def all_reduce(self, buffer, index):
        self._follow_rebuild()  # first: also when every rebuilt bucket goes to the reference
        wire_dtype = self.compression or buffer.dtype
        reason = self._reference_reason(wire_dtype, buffer.numel() * wire_dtype.itemsize)
        if reason is not None:
            logs.log_once(f"DDP bucket given to torch.distributed.all_reduce: {reason}")
            self.reference_calls += 1
            return self._reference(buffer)
        if self._stream is None:
            self._reduce(buffer, index)
            fut = torch.futures.Future()
            fut.set_result(buffer)
            return fut
        stream = self._stream
        # The bucket's gradients were written on the current stream: start after them.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._reduce(buffer, index)
            # DDP may free this buffer (bucket rebuild) while the side stream still uses it.
            buffer.record_stream(stream)
            # Completed with the side stream current: the Future records an event on it, and
            # a consumer's wait() makes the consumer's stream wait for that event.
            fut = torch.futures.Future(devices=[self.device])
            fut.set_result(buffer)
        return fut

    def _reduce(self, buffer, index):
        wire = self._wire_buffer(buffer, index)
        self._register(index, wire)
        if self.hierarchy is None:
            self.comm.all_reduce_(wire, op="avg")  # the division happens in fp32 in the kernel
        else:
            self._hierarchical(wire)
        if wire is not buffer:
            buffer.copy_(wire)

    def _hierarchical(self, flat):
        h = self.hierarchy
        self.comm.all_reduce_(flat, op="avg")  # (a) mean of this host's ranks
        n = flat.numel()
        lo, hi = n * h.local_rank // h.local_size, n * (h.local_rank + 1) // h.local_size
        if hi > lo:  # n is the same on every rank, so every rank of cross_group skips together
            shard = flat[lo:hi]
            shard.div_(h.nhosts)  # before the sum, as DDP's default hook does: no fp16 overflow
            dist.all_reduce(shard, group=h.cross_group)  # (b)
        flat[:lo].zero_()
        flat[hi:].zero_()
        self.comm.all_reduce_(flat, op="sum")  # (c) each element: its owner's value + zeros

    def _wire_buffer(self, buffer, index):
        """The tensor that is actually reduced: the bucket, or its low-precision copy."""
        if self.compression is None:
            return buffer
        if not self._zero_copy:
            return buffer.to(self.compression)
        # Registered buffers must stay put: one per bucket, replaced only when the bucket's
        # size changes (DDP's rebuild), which it does on every rank at the same call.
        wire = self._wire.get(index)
        if wire is None or wire.numel() != buffer.numel():
            if wire is not None:
                self._unregister(index)  # or it stays allocated, and mapped by every peer
            wire = self._wire[index] = torch.empty(buffer.numel(), dtype=self.compression, device=buffer.device)
        return wire.copy_(buffer)

    def _follow_rebuild(self):
        """At the first hook call after DDP rebuilt its buckets (every rank sees the flag
        turn at the same call), unregisters every buffer registered before: the old
        buckets, which DDP no longer uses, and their compressed copies, which would
        otherwise stay allocated here and mapped by every peer for the whole training."""
        if not self._zero_copy or self._seen_rebuild:
            return
        if not getattr(self._model(), "_has_rebuilt_buckets", False):
            return
        self._seen_rebuild = True
        self._wire = {}
        for index in sorted(self._registered):  # unregistration is collective: the same order on every rank
            self._unregister(index)

    def _unregister(self, index):
        tensor, _, _ = self._registered.pop(index, (None, 0, 0))
        if tensor is not None:
            self.comm.unregister(tensor)
            self.unregistrations += 1

    def _register(self, index, tensor):
        if not self._zero_copy:
            return
        key = (tensor.data_ptr(), tensor.nbytes)
        old = self._registered.get(index)
        if old is not None:
            if old[1:] == key:
                return
            # Registration is collective, and nothing tells the other ranks that this
            # rank's storage moved: registering here alone would deadlock.
            raise RuntimeError(f"pyallreduce.ddp: bucket {index}'s storage moved although DDP did not rebuild "
                               "its buckets; zero-copy registration cannot follow it")
        registered = self.comm.register(tensor)
        # Held only while registered (the communicator holds it then anyway), to unregister it.
        self._registered[index] = (tensor if registered else None, *key)
        self.registrations += 1

    def _reference(self, buffer):
        """The process group's own all-reduce, asynchronous so backward goes on meanwhile (the
        Communicator's own fallback would block the hook until it is done). Divides before
        the sum as DDP's default hook does, so an fp32 bucket gets exactly DDP's result."""
        if self.compression is None:
            buffer.div_(self.world_size)
            work = dist.all_reduce(buffer, group=self.group, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])
        wire = buffer.to(self.compression).div_(self.world_size)
        work = dist.all_reduce(wire, group=self.group, async_op=True)

        def decompress(fut):
            return buffer.copy_(fut.value()[0])

        return work.get_future().then(decompress)


def allreduce_hook(state, bucket):
    """DDP communication hook: hook(state, bucket) -> Future holding the bucket averaged
    over the model's process group (DDP's default hook computes the same). `state` is the
    HookState that register() creates."""
    if not isinstance(state, HookState):
        raise TypeError(f"pyallreduce.ddp.allreduce_hook: state must be a HookState (see "
                        f"pyallreduce.ddp.register), got {type(state).__name__}")
    start = time.perf_counter()
    try:
        return state.all_reduce(bucket.buffer(), bucket.index())
    finally:
        state.calls += 1
        state.seconds += time.perf_counter() - start


def register(model, communicator=None, *, compression=None, nblocks=None, backend=None, max_bytes=None,
             timeout=None, hierarchical=True):
    """Registers `allreduce_hook` on a DistributedDataParallel model and returns its HookState.

    Collective: every rank of the model's process group calls it, before the first backward.
    communicator: a Communicator over the model's process group and device; by default one
        is created (with nblocks, backend, max_bytes, timeout passed to it). A given
        communicator is used as is, also when the group spans several hosts (then every
        bucket goes to the process group's all-reduce: pass none to get the hierarchy).
    compression: None, "bf16" or "fp16": reduce a low-precision copy of the bucket (the
        average divided in fp32 inside the kernel), then copy it back.
    nblocks: blocks the GPU kernel may use (the rest of the SMs stay with the training).
    hierarchical: when the group spans several hosts, reduce inside each host with
        pyallreduce and across hosts with the group's backend (see Hierarchy); False sends
        every bucket to the group's all-reduce.
    """
    state = HookState(model, communicator, compression=compression, nblocks=nblocks, backend=backend,
                      max_bytes=max_bytes, timeout=timeout, hierarchical=hierarchical)
    try:
        model.register_comm_hook(state, allreduce_hook)
    except BaseException:
        state.close()
        raise
    return state
