"""Signal helpers shared by the one-shot and two-shot kernels: the call epoch,
the per-program barrier (csrc/common/protocol.h, docs/architecture.md) and its
deadline.

The same code runs compiled on a GPU (peer regions mapped with CUDA IPC) and
under TRITON_INTERPRET=1 on CPU tensors (peer regions in POSIX shared memory).
Which of the two is decided once, when this module is imported, because that
is when Triton reads TRITON_INTERPRET (at @triton.jit decoration time).

Deadline clock:
  GPU          %globaltimer (nanoseconds), read with inline PTX.
  interpreter  the host's time.monotonic_ns(). The interpreter runs a kernel as
               plain Python, so the kernel can call a plain Python function;
               the same call also yields the CPU, so that 4 ranks spinning on
               2 cores still let the late rank run.
Past the deadline:
  GPU          device_print of barrier, rank, program, epoch and missing ranks,
               then `trap` (the CUDA context is lost; the host's next
               synchronisation raises), like the CUDA C++ kernels.
  interpreter  an error record in the status tensor, which the launcher checks
               after the launch and turns into a Python exception naming the
               missing ranks; the program skips the rest of its work.
"""
import os
import time

import triton
import triton.language as tl

from pyallreduce import _C

INTERPRET = bool(triton.knobs.runtime.interpret)
_INTERPRET = tl.constexpr(INTERPRET)

# Region layout: the numbers of protocol.h, through pyallreduce._C.
MAX_RANKS = tl.constexpr(_C.MAX_RANKS)
START_FLAGS_OFFSET = tl.constexpr(_C.START_FLAGS_OFFSET)
MID_FLAGS_OFFSET = tl.constexpr(_C.MID_FLAGS_OFFSET)
EPOCH_OFFSET = tl.constexpr(_C.EPOCH_OFFSET)
DATA_OFFSET = tl.constexpr(_C.DATA_OFFSET)
# tl.arange needs a power of two: one lane per possible peer.
RANK_LANES = tl.constexpr(triton.next_power_of_2(_C.MAX_RANKS))

# Which barrier missed its deadline, as written in the status record.
START_BARRIER = tl.constexpr(1)
MID_BARRIER = tl.constexpr(2)
BARRIER_NAMES = {1: "start", 2: "mid"}
# Status record (int32): [barrier id (0 = no failure), program, epoch, bitmask of missing ranks].
STATUS_WORDS = 4


if INTERPRET:
    def clock_ns():
        # Plain Python on purpose (see the module docstring). sched_yield hands
        # the core to a peer process that still has to arrive.
        os.sched_yield()
        return tl.full((), time.monotonic_ns(), tl.int64)
else:
    @triton.jit
    def clock_ns():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                         is_pure=False, pack=1)

    @triton.jit
    def _trap():
        # `trap` aborts the kernel; the mov only gives the asm its required output.
        tl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def next_epoch(own_base, pid):
    """e = ++epoch[pid] in this rank's own region (own_base: its address, int64).

    The counter lives in the region, not on the host, so a replayed CUDA graph
    keeps counting. One atomic instead of load + store: on a GPU every thread of
    the program would otherwise load, and a warp that loads after another warp
    stored would see e instead of e - 1.
    """
    epoch_ptr = (own_base + EPOCH_OFFSET).to(tl.pointer_type(tl.int32)) + pid
    return tl.atomic_add(epoch_ptr, 1, sem="relaxed", scope="gpu") + 1


@triton.jit
def signal_peers(regions_ptr, flags_offset: tl.constexpr, pid, rank, e, WORLD_SIZE: tl.constexpr):
    """Stores e into flags[pid][rank] of every rank's region (regions_ptr: *i64
    [WORLD_SIZE] region base addresses), release at system scope.

    The CTA barrier first makes every thread's earlier stores (the staging
    copy, the two-shot reduction) happen before the releasing store, so a peer
    that acquires the flag also sees them.
    """
    tl.debug_barrier()
    q = tl.arange(0, RANK_LANES)
    live = q < WORLD_SIZE
    bases = tl.load(regions_ptr + q, mask=live, other=0)
    flags = (bases + flags_offset).to(tl.pointer_type(tl.int32)) + (pid * MAX_RANKS + rank)
    tl.atomic_xchg(flags, tl.full([RANK_LANES], 0, tl.int32) + e, mask=live, sem="release", scope="sys")


@triton.jit
def _report_deadline(status_ptr, barrier_id: tl.constexpr, rank, pid, e, missing):
    if _INTERPRET:
        # Keep the first failing program's record; the launcher raises from it.
        if tl.load(status_ptr) == 0:
            tl.store(status_ptr + 1, pid)
            tl.store(status_ptr + 2, e)
            tl.store(status_ptr + 3, missing)
            tl.store(status_ptr, barrier_id)
    else:
        # One value per print: Triton prints each operand on its own line anyway.
        # The line prefix "pid (x, 0, 0)" names the program.
        tl.device_print("pyallreduce triton: barrier deadline passed on rank", rank)
        tl.device_print("pyallreduce triton: in barrier (1 start, 2 mid)", barrier_id)
        tl.device_print("pyallreduce triton: of call (epoch)", e)
        tl.device_print("pyallreduce triton: missing ranks, bit q set = rank q never arrived", missing)
        _trap()


@triton.jit
def wait_peers(own_base, flags_offset: tl.constexpr, pid, rank, e, timeout_ns, status_ptr,
               barrier_id: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """Spins until flags[pid][q] of this rank's region (own_base: its address)
    has reached e for every q < WORLD_SIZE, acquire at system scope; returns
    True then. Past timeout_ns it reports the missing ranks (see the module
    docstring; status_ptr: *i32 [STATUS_WORDS]) and returns False.
    """
    q = tl.arange(0, RANK_LANES)
    live = q < WORLD_SIZE
    flags = (own_base + flags_offset).to(tl.pointer_type(tl.int32)) + (pid * MAX_RANKS + q)
    deadline = clock_ns() + timeout_ns.to(tl.int64)
    reached = q >= WORLD_SIZE
    state = tl.full((), 0, tl.int32)  # 0 waiting, 1 every peer arrived, 2 deadline passed
    if _INTERPRET:
        # An earlier program of this launch already missed its deadline: the
        # call has failed, do not wait a second time.
        state = tl.where(tl.load(status_ptr) != 0, 2, 0)
    while state == 0:
        # Read-modify-write of 0: an acquire load that works on both targets.
        seen = tl.atomic_add(flags, 0, mask=live, sem="acquire", scope="sys")
        # "Reached" is seen - e in {0, 1} (protocol.h, epoch_reached): a peer may
        # already be one barrier ahead and have overwritten e with e + 1, and a
        # stale mid flag of any age must not count. The int32 difference wraps.
        ahead = seen - e
        reached = ((ahead == 0) | (ahead == 1)) | ~live
        arrived = tl.min(reached.to(tl.int32), axis=0) == 1
        state = tl.where(arrived, 1, tl.where(clock_ns() > deadline, 2, 0))
    if state == 2:
        missing = tl.sum(tl.where(reached, 0, 1 << q), axis=0)
        _report_deadline(status_ptr, barrier_id, rank, pid, e, missing)
    # Every thread's later loads of peer data come after the acquire above.
    tl.debug_barrier()
    return state == 1


@triton.jit
def barrier(regions_ptr, own_base, flags_offset: tl.constexpr, pid, rank, e, timeout_ns, status_ptr,
            barrier_id: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """Barrier of program pid at epoch e among the same program of every rank."""
    signal_peers(regions_ptr, flags_offset, pid, rank, e, WORLD_SIZE)
    return wait_peers(own_base, flags_offset, pid, rank, e, timeout_ns, status_ptr, barrier_id, WORLD_SIZE)


def missing_ranks(mask, world_size):
    return [q for q in range(world_size) if mask >> q & 1]
