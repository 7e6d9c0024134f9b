"""The status record of the Triton kernels (protocol.h CallStatus's twin):
its layout and codes, and the host's side of it: clear, read, raise. The
kernels write it in signal.py (record_failure, count_mismatch, claim_word).

When a call cannot complete (a deadline passed, or the ranks' descriptors
differ) a program fills in the status record and returns; it never traps, so
the process's CUDA context stays usable (issue 13 item 5). The record
(STATUS_* below) is one per communicator, first writer wins, with the code
written last. The claim is an atomic max of the record's generation on a word
in device memory (claim_word: the slot after the region table), won when the
word was below it; the host advances the generation whenever it clears the
record, so the word never needs resetting, and no atomic touches the mapped
host memory (that would need the platform's PCIe atomics):
  interpreter  a CPU tensor. The launcher reads it right after the launch,
               which has finished by then: a mismatch raises CallMismatch from
               the call itself, on every rank, and the communicator stays usable.
  GPU          pinned host memory, which the GPU reaches through unified
               addressing, so reading it costs the host one memory read and no
               synchronisation: the cheapest sound choice. (Device memory would
               need a device-to-host copy, i.e. a stream synchronisation, per
               check.) The code is stored with st.release.sys after a CTA
               barrier, and the host reads a nonzero code again with an
               acquire load (pyallreduce._C.load_acquire_u32) before the
               fields. The claim is device scope: only this process's
               kernels write its record. The launcher checks the record before
               every launch (a deadline: launch nothing) and after it; an
               agreement round synchronises its stream first. A mismatch of a
               launch the host has not waited for is raised at a later call
               (ranks may raise it one call apart), once the current stream is
               synchronised (every earlier launch precedes its tail: the
               communicator's launch order), so no kernel still writes the
               record when the host reads and clears it. Every mismatched
               call is counted (count_mismatch), the error names the first and
               how many followed, none of which wrote its output, and the
               communicator stays usable: each rank's kernel left its epochs
               in step, as on the CUDA backend. Inside a CUDA graph capture
               nothing can wait: the record is raised and kept. Not yet run on
               a GPU.
"""
import torch
import triton.language as tl

from pyallreduce import _C
from pyallreduce.engines import relaxed_capture_mode, stream_capturing

# Which barrier a deadline passed in.
START_BARRIER = tl.constexpr(1)
MID_BARRIER = tl.constexpr(2)
BARRIER_NAMES = {1: "start", 2: "mid"}

# The status record, int32 words (see the module docstring). constexpr for the
# kernels; the host reads .value.
STATUS_CODE = tl.constexpr(0)      # CODE_*; written last
STATUS_GENERATION = tl.constexpr(1)  # from 1, advanced by the host each time it clears the record
STATUS_BARRIER = tl.constexpr(2)   # deadline: START_BARRIER or MID_BARRIER
STATUS_PROGRAM = tl.constexpr(3)
STATUS_EPOCH = tl.constexpr(4)     # e of the failed call
STATUS_MISSING = tl.constexpr(5)   # deadline: bit q set = rank q never arrived
STATUS_CALL64 = tl.constexpr(3)    # int64 word 3 (int32 words 6, 7): the user's call number
STATUS_DESCS64 = tl.constexpr(4)   # int64 words 4 + 2q, 5 + 2q: rank q's descriptor as read (mismatch)
STATUS_LAST_CALL64 = tl.constexpr(4 + 2 * _C.MAX_RANKS)  # int64 word: the last mismatched call's number
STATUS_MISMATCHES = tl.constexpr(2 * (5 + 2 * _C.MAX_RANKS))  # mismatched calls since the host cleared the record
# Set to 1 by the host (triton_kernels.interrupt: Communicator.abort(),
# torch.distributed's abort of the group) and never cleared: the last word, so that clearing the
# record (the words before it) cannot race with it. An interpreted wait reads
# it and gives up as at its deadline (wait_peers: not yet a compiled one).
STATUS_ABORTED = tl.constexpr(2 * (5 + 2 * _C.MAX_RANKS) + 1)
STATUS_WORDS = 2 * (6 + 2 * _C.MAX_RANKS)
CODE_OK = 0
CODE_DEADLINE = tl.constexpr(1)  # a rank never arrived: epochs are out of step
CODE_MISMATCH = tl.constexpr(2)  # descriptors differ: nothing written, epochs in step
CODE_ABORTED = tl.constexpr(3)   # a wait gave up because the host set STATUS_ABORTED: out of step too


class CallMismatch(RuntimeError):
    """The ranks' descriptors of one call differ (protocol.h CallDesc). Every
    rank raises the same text, nothing was written, and the epochs are back in
    step: the communicator stays usable."""


def new_generation(status, generation):
    """Clears the status record for its next generation (a failing program
    claims the record when the claim word is below it); an abort
    (STATUS_ABORTED, the last word) stays."""
    status[:STATUS_ABORTED.value].zero_()
    status[STATUS_GENERATION.value] = generation


def raise_recorded(status, record, rank, world_size, timeout_s, device, mismatch_too=True):
    """Raises what a program recorded in the status record, if anything (only
    a deadline or an abort when not mismatch_too).

    A deadline or an abort raises RuntimeError and stays recorded: the ranks' epochs are
    out of step, the communicator is broken. A mismatch raises CallMismatch
    naming the first skipped call and how many followed, once no kernel on
    these regions can still write the record: on a GPU the current stream is
    synchronised first (every earlier launch precedes its tail), under the
    interpreter the launch has finished. The record is then cleared. Inside a
    CUDA graph capture nothing can wait: the record is raised and kept."""
    if int(record[STATUS_CODE.value]) == CODE_OK:
        return
    # Read again with acquire: on a GPU the code was stored with release after
    # the fields, which a plain read of the code does not order the host's
    # later reads after (aarch64 hosts reorder loads).
    code = _C.load_acquire_u32(status.data_ptr() + 4 * STATUS_CODE.value)
    if code == CODE_MISMATCH.value and not mismatch_too:
        return
    on_gpu = device.type == "cuda"
    capturing = stream_capturing(device)
    if code == CODE_MISMATCH.value and on_gpu and not capturing:
        with relaxed_capture_mode(device):
            torch.cuda.current_stream(device).synchronize()
    words = status.tolist()
    longs = status.view(torch.int64).tolist()
    epoch = words[STATUS_EPOCH.value] & 0xFFFFFFFF
    failed_call = longs[STATUS_CALL64.value]
    if code == CODE_MISMATCH.value:
        if not capturing:
            new_generation(status, words[STATUS_GENERATION.value] + 1)
        words64 = longs[STATUS_DESCS64.value:]
        # (bytes, epoch, kind) per rank, from CallDesc's words: bytes, epoch | kind << 32.
        descs = [(words64[2 * q], words64[2 * q + 1] & 0xFFFFFFFF, words64[2 * q + 1] >> 32) for q in range(world_size)]
        raise CallMismatch(_C.mismatch_message(failed_call, epoch, descs, words[STATUS_MISMATCHES.value],
                                               longs[STATUS_LAST_CALL64.value]))
    barrier = BARRIER_NAMES.get(words[STATUS_BARRIER.value], "?")
    missing = " ".join(str(q) for q in missing_ranks(words[STATUS_MISSING.value], world_size))
    if code == CODE_ABORTED.value:
        raise RuntimeError(
            f"pyallreduce: collective call {failed_call} on this communicator was aborted ({_C.ABORTED_BY}) while "
            f"rank {rank}'s Triton program {words[STATUS_PROGRAM.value]} waited in the {barrier} barrier for "
            f"rank(s) {missing}; create a new Communicator (or process group) on the ranks that go on")
    raise RuntimeError(
        f"pyallreduce: rank {rank} waited past its {timeout_s:g} s deadline in the {barrier} barrier of "
        f"collective call {failed_call} on this communicator (Triton program {words[STATUS_PROGRAM.value]}); "
        f"rank(s) {missing} never arrived there. Every rank must make the same collective calls in the same order.")


def missing_ranks(mask, world_size):
    return [q for q in range(world_size) if mask >> q & 1]
