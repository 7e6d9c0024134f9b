"""Signal helpers shared by the kernels: the call epoch, the flag stores and
loads, the start of a call (descriptor, start barrier, agreement check), the
later barriers and their deadline, the writes of the status record
(status.py), and the agreement-only kernel. Protocol: csrc/common/protocol.h (the spec), docs/architecture.md.

The same code runs compiled on a GPU (peer regions mapped with CUDA IPC) and
under TRITON_INTERPRET=1 on CPU tensors (peer regions in POSIX shared memory).
Which of the two is decided once, when this module is imported, because that
is when Triton reads TRITON_INTERPRET (at @triton.jit decoration time).

Flags (issue 13 item 11):
  GPU          plain `st.release.sys.global.u32` / `ld.acquire.sys.global.u32`
               in inline PTX, as the CUDA kernels do: a peer reached over PCIe
               without native peer-to-peer atomics does not guarantee atomics,
               but it does plain stores and loads. An inline-asm op has no
               mask and runs in every thread that holds a lane, so a few
               threads store the same value to the same word: harmless.
  interpreter  atomics with release/acquire semantics (there is no PTX).
Deadline clock:
  GPU          %globaltimer (nanoseconds), read with inline PTX.
  interpreter  the host's time.monotonic_ns(). The interpreter runs a kernel as
               plain Python, so the kernel can call a plain Python function;
               the same call also yields the CPU, so that 4 ranks spinning on
               2 cores still let the late rank run.

Branches that hold CTA barriers (record_failure's claim broadcast and the
barrier before the code, signal_peers) are taken by a whole program or not
at all: a wait's outcome is one vote per program (wait_peers), a scalar
atomic's result is the same in every thread, and the descriptors compared
after the start barrier are stable by then.
"""
import os
import time

import triton
import triton.language as tl

from pyallreduce import _C

from pyallreduce import triton_requirements as requirements
from .status import (CODE_ABORTED, CODE_DEADLINE, CODE_MISMATCH, START_BARRIER, STATUS_ABORTED, STATUS_BARRIER,
                     STATUS_CALL64, STATUS_CODE, STATUS_DESCS64, STATUS_EPOCH, STATUS_GENERATION, STATUS_LAST_CALL64,
                     STATUS_MISMATCHES, STATUS_MISSING, STATUS_PROGRAM)


if (_why := requirements.triton_too_old()) is not None:
    raise ImportError(f"pyallreduce: {_why}")
INTERPRET = bool(triton.knobs.runtime.interpret)
if INTERPRET and (_why := requirements.interpreter_unusable()) is not None:
    raise ImportError(f"pyallreduce: {_why}")
_INTERPRET = tl.constexpr(INTERPRET)

# Region layout: the numbers of protocol.h, through pyallreduce._C.
MAX_RANKS = tl.constexpr(_C.MAX_RANKS)
MAX_BLOCKS = tl.constexpr(_C.MAX_BLOCKS)
START_FLAGS_OFFSET = tl.constexpr(_C.START_FLAGS_OFFSET)
MID_FLAGS_OFFSET = tl.constexpr(_C.MID_FLAGS_OFFSET)
EPOCH_OFFSET = tl.constexpr(_C.EPOCH_OFFSET)
DESC_OFFSET = tl.constexpr(_C.DESC_OFFSET)
DESC_BYTES = tl.constexpr(_C.DESC_BYTES)
DATA_OFFSET = tl.constexpr(_C.DATA_OFFSET)
# The bits of a descriptor's second word (epoch | kind << 32) every rank must
# agree on: all but kind's hint bit (protocol.h kDescCompared, same_call).
DESC_WORD1_COMPARED = tl.constexpr((_C.DESC_COMPARED << 32 | 0xFFFFFFFF) - (1 << 64))
# tl.arange needs a power of two: one lane per possible peer.
RANK_LANES = tl.constexpr(triton.next_power_of_2(_C.MAX_RANKS))
# Warps of the data kernels (the agreement kernel runs 1). A wait's vote
# (wait_peers) needs at least one lane per thread: with fewer, lanes would be
# replicated across threads and each copy reduced on its own.
NUM_WARPS = 4
VOTE_LANES = tl.constexpr(32 * NUM_WARPS)


if INTERPRET:
    def clock_ns():
        # Plain Python on purpose (see the module docstring). sched_yield hands
        # the core to a peer process that still has to arrive.
        os.sched_yield()
        return tl.full((), time.monotonic_ns(), tl.int64)

    def lane_clock_ns(lanes):
        return tl.full(lanes.shape, time.monotonic_ns(), tl.int64)
else:
    @triton.jit
    def clock_ns():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                         is_pure=False, pack=1)

    @triton.jit
    def lane_clock_ns(lanes):
        """The clock as read by the thread holding each element of `lanes`
        (whose values are unused: the input only gives the asm its shape, so
        every thread reads the clock itself)."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [lanes], dtype=tl.int64,
                                         is_pure=False, pack=1)


@triton.jit
def store_release(addrs, values):
    """*addrs = values (addrs: int64 addresses of 32-bit words), release at system scope."""
    if _INTERPRET:
        tl.atomic_xchg(addrs.to(tl.pointer_type(tl.int32)), values, sem="release", scope="sys")
    else:
        # The mov only gives the asm the output inline_asm_elementwise requires.
        tl.inline_asm_elementwise(
            "{ .reg .u64 g; cvta.to.global.u64 g, $1; st.release.sys.global.u32 [g], $2; mov.u32 $0, 0; }",
            "=r,l,r", [addrs, values], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def load_acquire(addrs):
    """*addrs (int64 addresses of 32-bit words), acquire at system scope."""
    if _INTERPRET:
        # Read-modify-write of 0: the interpreter's acquire load.
        return tl.atomic_add(addrs.to(tl.pointer_type(tl.int32)), 0, sem="acquire", scope="sys")
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .u64 g; cvta.to.global.u64 g, $1; ld.acquire.sys.global.u32 $0, [g]; }",
            "=r,l", [addrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def next_epoch(own_base, pid):
    """e = ++epoch[pid] in this rank's own region (own_base: its address, int64).

    The counter lives in the region, not on the host, so a replayed CUDA graph
    keeps counting. One atomic instead of load + store: on a GPU every thread of
    the program would otherwise load, and a warp that loads after another warp
    stored would see e instead of e - 1. Only this rank's program pid touches it.
    """
    epoch_ptr = (own_base + EPOCH_OFFSET).to(tl.pointer_type(tl.int32)) + pid
    return tl.atomic_add(epoch_ptr, 1, sem="relaxed", scope="gpu") + 1


@triton.jit
def signal_peers(regions_ptr, flags_offset: tl.constexpr, pid, rank, e, WORLD_SIZE: tl.constexpr,
                 ALSO_MID: tl.constexpr = False):
    """Stores e into flags[pid][rank] of every rank's region (regions_ptr: *i64
    [WORLD_SIZE] region base addresses), release at system scope; with
    ALSO_MID into mid_flags[pid][rank] too (the wrap fix, protocol.h).

    The CTA barrier first makes every thread's earlier stores (the staging
    copy, the descriptor, the two-shot reduction) happen before the releasing
    store, so a peer that acquires the flag also sees them.
    """
    tl.debug_barrier()
    # Lanes past W repeat rank W - 1: an unmasked flag store (inline asm has
    # no mask) then only repeats lane W - 1's, which stores the same value.
    bases = tl.load(regions_ptr + tl.minimum(tl.arange(0, RANK_LANES), WORLD_SIZE - 1))
    slot = (pid * MAX_RANKS + rank).to(tl.int64) * 4
    e_lanes = tl.full([RANK_LANES], 0, tl.int32) + e
    if ALSO_MID:
        store_release(bases + MID_FLAGS_OFFSET + slot, e_lanes)
    store_release(bases + flags_offset + slot, e_lanes)


@triton.jit
def claim_word(regions_ptr, WORLD_SIZE: tl.constexpr):
    """The status record's claim word (int32): the slot after the region table
    (regions_ptr[WORLD_SIZE], device memory; triton_kernels.prepare)."""
    return (regions_ptr + WORLD_SIZE).to(tl.pointer_type(tl.int32), bitcast=True)


@triton.jit
def record_failure(status_ptr, claim_ptr, code: tl.constexpr, barrier_id, pid, e, missing, call, descs,
                   WORLD_SIZE: tl.constexpr):
    """Fills in the status record (status_ptr: *i32 [STATUS_WORDS]) unless an
    earlier failing program of its generation did (claim_ptr: claim_word);
    descs: [RANK_LANES, 2] int64 descriptor words as read (mismatch), or 0."""
    generation = tl.load(status_ptr + STATUS_GENERATION)
    if _INTERPRET:
        won = tl.load(claim_ptr) < generation  # programs run one after another here
        tl.store(claim_ptr, tl.maximum(tl.load(claim_ptr), generation))
    else:
        won = tl.atomic_max(claim_ptr, generation, sem="relaxed", scope="gpu") < generation
    if won:
        tl.store(status_ptr + STATUS_BARRIER, barrier_id)
        tl.store(status_ptr + STATUS_PROGRAM, pid)
        tl.store(status_ptr + STATUS_EPOCH, e)
        tl.store(status_ptr + STATUS_MISSING, missing)
        words = status_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
        tl.store(words + STATUS_CALL64, call.to(tl.int64))
        q = tl.arange(0, RANK_LANES)[:, None]
        k = tl.arange(0, 2)[None, :]
        tl.store(words + STATUS_DESCS64 + 2 * q + k, descs, mask=(q < WORLD_SIZE) & (k < 2))
        value = tl.full((), code, tl.int32)
        if _INTERPRET and code == CODE_DEADLINE:  # a wait that gave up because of an abort (or after one) says so
            value = tl.where(tl.load(status_ptr + STATUS_ABORTED) != 0, CODE_ABORTED, value)
        # Code last, after a CTA barrier: whichever thread's release store the
        # host sees, the fields above (one thread's plain stores) precede it.
        tl.debug_barrier()
        store_release((status_ptr + STATUS_CODE).to(tl.int64), value)


@triton.jit
def count_mismatch(status_ptr, pid, call):
    """Counts a mismatched call in the status record and notes its number:
    the host may look only after later calls ran (on a GPU it raises a
    recorded mismatch after launching the next call), and none of them may go
    unreported. Program 0 counts: every program of a mismatched call sees the
    mismatch, and a communicator's launches run one after another. Plain
    loads and stores (no atomic on the mapped host memory): every thread of
    the program loads the count before any stores it (the CTA barrier), and
    all store the same value."""
    if pid == 0:
        count = tl.load(status_ptr + STATUS_MISMATCHES)
        tl.debug_barrier()
        tl.store(status_ptr + STATUS_MISMATCHES, count + 1)
        words = status_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
        tl.store(words + STATUS_LAST_CALL64, call.to(tl.int64))


# A wait's vote (wait_peers): the largest wins.
WAITING = tl.constexpr(0)
LATE = tl.constexpr(1)
ARRIVED = tl.constexpr(2)


@triton.jit
def wait_peers(own_base, flags_offset: tl.constexpr, pid, rank, e, timeout_ns, status_ptr, claim_ptr, call,
               barrier_id: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """Spins until flags[pid][q] of this rank's region (own_base: its address)
    has reached e for every q < WORLD_SIZE, acquire at system scope; returns
    True then. Past timeout_ns it records the missing ranks in the status
    record and returns False. Under the interpreter it also gives up once
    the host has aborted the communicator (STATUS_ABORTED, read every round:
    a host read there); every call here is staged, so any barrier may give
    up: peers read only our region, which no call rewrites after an abort and
    which stays allocated. Compiled for a GPU it does not look (yet): every
    form of the look tried (in the spin, every round or by the clock; in an
    outer loop once a millisecond) made ptxas trade registers for spills in
    two-shot's data loop (tests/test_triton_targets.py), so an abort there
    waits for the kernel's deadline.

    One decision per program. Each thread loads the flags and reads the clock
    itself, so at the deadline instant two warps could see different things
    and take different paths (the deadline's and the barrier's) and never
    meet again. Every round therefore ends in a vote over VOTE_LANES lanes,
    at least one per thread, reduced through shared memory: ARRIVED if any
    thread saw every peer there (flags only move forward within a call, so
    every peer was), else LATE if any thread's clock passed the deadline, else
    WAITING. Every thread gets the same result of the reduction, so the whole
    program leaves the loop in the same round with the same answer.
    """
    q = tl.arange(0, RANK_LANES)
    live = q < WORLD_SIZE
    flags = own_base + flags_offset + (pid * MAX_RANKS + tl.minimum(q, WORLD_SIZE - 1)).to(tl.int64) * 4
    vote_lanes = tl.zeros([VOTE_LANES], tl.int32)  # gives lane_clock_ns its shape (an arange made ptxas spill)
    deadline = clock_ns() + timeout_ns.to(tl.int64)
    reached = q >= WORLD_SIZE
    state = tl.full((), WAITING, tl.int32)
    if _INTERPRET:
        # An earlier program of this launch already gave up (a deadline, an
        # abort): the call has failed, do not wait a second time. (A mismatch
        # recorded by an earlier program does not count: this program still has
        # to meet its peers to stay in step.)
        code = tl.load(status_ptr + STATUS_CODE)
        state = tl.where((code == CODE_DEADLINE) | (code == CODE_ABORTED), LATE, WAITING)
    while state == WAITING:
        seen = load_acquire(flags)
        # "Reached" is seen - e in {0, 1} (protocol.h, epoch_reached): a peer may
        # already be one barrier ahead and have overwritten e with e + 1, and a
        # stale flag must not count. The int32 difference wraps.
        ahead = seen - e
        reached = ((ahead == 0) | (ahead == 1)) | ~live
        arrived = tl.min(reached.to(tl.int32), axis=0) == 1
        late = lane_clock_ns(vote_lanes) > deadline
        if _INTERPRET:  # (see the docstring: not compiled for a GPU)
            late = late | (tl.load(status_ptr + STATUS_ABORTED) != 0)
        votes = tl.where(arrived, ARRIVED, tl.where(late, LATE, WAITING))
        state = tl.max(votes, axis=0)
    if state == LATE:
        missing = tl.sum(tl.where(reached, 0, 1 << q), axis=0)
        record_failure(status_ptr, claim_ptr, CODE_DEADLINE, barrier_id, pid, e, missing, call,
                       tl.zeros([RANK_LANES, 2], tl.int64), WORLD_SIZE)
    # Every thread's later loads of peer data come after the acquire above.
    tl.debug_barrier()
    return state == ARRIVED


@triton.jit
def barrier(regions_ptr, own_base, flags_offset: tl.constexpr, pid, rank, e, timeout_ns, status_ptr, call,
            barrier_id: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """A later barrier (mid) of program pid at epoch e among the same program of every rank."""
    signal_peers(regions_ptr, flags_offset, pid, rank, e, WORLD_SIZE)
    return wait_peers(own_base, flags_offset, pid, rank, e, timeout_ns, status_ptr, claim_word(regions_ptr, WORLD_SIZE),
                      call, barrier_id, WORLD_SIZE)


@triton.jit
def start_call(regions_ptr, own_base, pid, rank, e, desc_bytes, kind, timeout_ns, status_ptr, call,
               HAS_MID: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """The start of call e (protocol.h): publish this rank's descriptor to every
    peer, signal (start flags, and the mid flags too when the call has no mid
    barrier: the wrap fix), wait for every peer, and check every peer's
    descriptor against ours before any peer data is read. Returns True when the
    call may go on. Otherwise the status record says why (deadline, or
    mismatch); on a mismatch this program is back in step with its peers
    (protocol.h): its epoch counter stays e (every Triton call uses one
    epoch) and its mid flags are at e, so every rank continues from e + 1.
    """
    # CallDesc as two int64 words: bytes, then epoch | kind << 32.
    words = tl.arange(0, 2)
    mine = tl.where(words == 0, desc_bytes.to(tl.int64), (e.to(tl.int64) & 0xFFFFFFFF) | (kind.to(tl.int64) << 32))
    q = tl.minimum(tl.arange(0, RANK_LANES), WORLD_SIZE - 1)[:, None]
    # Byte offset of desc[e % 2][pid][0] (protocol.h desc_offset), and of its words.
    descs_offset = DESC_OFFSET + ((e & 1).to(tl.int64) * MAX_BLOCKS + pid) * MAX_RANKS * DESC_BYTES + words * 8
    # Into every peer's desc[e % 2][pid][rank], plain stores; signal_peers'
    # CTA barrier and release publish them with the flag.
    bases = tl.load(regions_ptr + q)
    tl.store((bases + descs_offset + rank * DESC_BYTES).to(tl.pointer_type(tl.int64)),
             tl.broadcast_to(mine[None, :], [RANK_LANES, 2]))
    signal_peers(regions_ptr, START_FLAGS_OFFSET, pid, rank, e, WORLD_SIZE, ALSO_MID=not HAS_MID)
    claim_ptr = claim_word(regions_ptr, WORLD_SIZE)
    ok = wait_peers(own_base, START_FLAGS_OFFSET, pid, rank, e, timeout_ns, status_ptr, claim_ptr, call, START_BARRIER,
                    WORLD_SIZE)
    if ok:
        # After the acquire (and wait_peers' CTA barrier): rank q's descriptor of e.
        descs = tl.load((own_base + descs_offset + q * DESC_BYTES).to(tl.pointer_type(tl.int64)))
        compared = tl.where(words == 0, -1, DESC_WORD1_COMPARED).to(tl.int64)  # -1: every bit
        agree = tl.min(tl.min((((descs ^ mine[None, :]) & compared[None, :]) == 0).to(tl.int32), axis=1), axis=0) == 1
        if not agree:
            if HAS_MID:  # the call skips its mid barrier: store e there, as a call without one does
                signal_peers(regions_ptr, MID_FLAGS_OFFSET, pid, rank, e, WORLD_SIZE)
            record_failure(status_ptr, claim_ptr, CODE_MISMATCH, 0, pid, e, 0, call, descs, WORLD_SIZE)
            count_mismatch(status_ptr, pid, call)
        ok = agree
    return ok


@triton.jit(do_not_specialize=["rank", "timeout_ns", "desc_bytes", "kind", "call"])
def _agree_kernel(
    regions_ptr,         # *i64 [WORLD_SIZE]: base address of every rank's region, as mapped in this process
    status_ptr,          # *i32 [STATUS_WORDS]: the status record
    rank,                # this rank
    timeout_ns,          # deadline of the start barrier
    desc_bytes: tl.int64,  # the descriptor: the call's payload in bytes
    kind: tl.int32,      # the descriptor's kind (desc_kind, algo AGREE_ONLY)
    call: tl.int64,      # the user's call number, for the status record
    WORLD_SIZE: tl.constexpr,
):
    """The agreement round (protocol.h kAgreeOnly): each program advances its
    epoch and runs the start of a call without a mid barrier; no data moves."""
    pid = tl.program_id(0)
    own = tl.load(regions_ptr + rank)
    e = next_epoch(own, pid)
    start_call(regions_ptr, own, pid, rank, e, desc_bytes, kind, timeout_ns, status_ptr, call, False, WORLD_SIZE)
