"""Reduce-scatter and all-gather: the two halves of two-shot as collectives of
their own (protocol.h kReduceScatter, kAllGather). S is the per-rank segment
(reduce-scatter's output, all-gather's input).

  reduce-scatter  copy the W input segments into staging, segment q at
                  q * segment_stride(S); start barrier; out = the rank-order
                  fp32 sum of segment `rank` of every rank's staging buffer.
  all-gather      copy the input into staging at 0; start barrier; out
                  segment q = rank q's staging buffer.

One epoch per call and no mid barrier (start_call also stores the mid flags),
so the one-shot argument for the alternating staging buffers holds as is.
That argument is per program: staging chunk c (CHUNK_BYTES, as one_shot.py)
is copied in and read on every peer by program chunk_block(c) = (c // W) %
nprog, the same program as in the all-reduce kernels, whatever the call's
kind. Segments start on a SEGMENT_UNIT boundary (two chunks), so every
staging chunk lies inside one segment and starts 16-byte aligned.
"""
import torch
import triton
import triton.language as tl

from pyallreduce import _C

from .one_shot import CHUNK_BYTES, NUM_WARPS, copy_chunk, copy_in, full_chunks, reduce_chunk, store_chunk, tail_chunk
from .signal import DATA_OFFSET, next_epoch, start_call


@triton.jit(do_not_specialize=["rank", "timeout_ns", "desc_bytes", "kind", "call"])
def _reduce_scatter_kernel(
    in_ptr,       # *T [WORLD_SIZE * n_elements]: this rank's input, W segments
    out_ptr,      # *T [n_elements]: the sum of segment `rank` (may be that segment of in_ptr: in place)
    regions_ptr,  # *i64 [WORLD_SIZE]: base address of every rank's region, as mapped in this process
    status_ptr,   # *i32 [STATUS_WORDS]: the status record (status.py)
    n_elements,   # elements of one segment (S bytes)
    max_bytes,    # bytes of one staging buffer (>= W * segment_stride(S), checked by the launcher's caller)
    rank,         # this rank
    timeout_ns,   # deadline of the start barrier
    desc_bytes: tl.int64,  # the call's descriptor (protocol.h CallDesc): W * S
    kind: tl.int32,        # and desc_kind(dtype, REDUCE_SCATTER, MODE_STAGED, average, in place)
    call: tl.int64,        # the user's call number, for the status record
    WORLD_SIZE: tl.constexpr,
    CHUNK: tl.constexpr,    # elements per chunk: CHUNK_BYTES // element size
    SEGMENT: tl.constexpr,  # elements per SEGMENT_UNIT
    AVERAGE: tl.constexpr,  # divide the sum by WORLD_SIZE
):
    T: tl.constexpr = in_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    own = tl.load(regions_ptr + rank)
    e = next_epoch(own, pid)
    staging = DATA_OFFSET + (e & 1).to(tl.int64) * max_bytes  # data[e % 2]
    # Elements from one segment's start in staging to the next's (protocol.h
    # segment_stride). Offsets of segments in int64: W of them may pass 2^31
    # elements where one does not.
    stride = tl.cast((n_elements + SEGMENT - 1) // SEGMENT * SEGMENT, tl.int64)
    own_buf = (own + staging).to(tl.pointer_type(T))
    for q in range(0, WORLD_SIZE):
        begin = q * stride
        copy_in(in_ptr + tl.cast(q, tl.int64) * n_elements, own_buf, begin, begin + n_elements, pid, nprog, CHUNK,
                WORLD_SIZE)
    if start_call(regions_ptr, own, pid, rank, e, desc_bytes, kind, timeout_ns, status_ptr, call, False,
                  WORLD_SIZE):
        # Segment `rank` of every staging buffer: this program's chunks of it,
        # as copy_in walks them; out element i is staging element begin + i.
        begin = rank * stride
        end = begin + n_elements
        first = begin // CHUNK
        k_begin = full_chunks(begin, pid, nprog, CHUNK, WORLD_SIZE)
        for k in range(k_begin, full_chunks(end, pid, nprog, CHUNK, WORLD_SIZE)):
            c = (pid + k // WORLD_SIZE * nprog) * WORLD_SIZE + k % WORLD_SIZE
            store_chunk(out_ptr, c - first, reduce_chunk(regions_ptr, staging, c, end, CHUNK, AVERAGE, WORLD_SIZE, T,
                                                         False), n_elements, CHUNK, False, False)
        tail = tail_chunk(end, pid, nprog, CHUNK, WORLD_SIZE)
        if tail >= 0:
            store_chunk(out_ptr, tail - first, reduce_chunk(regions_ptr, staging, tail, end, CHUNK, AVERAGE,
                                                            WORLD_SIZE, T, True), n_elements, CHUNK, True, False)


@triton.jit(do_not_specialize=["rank", "timeout_ns", "desc_bytes", "kind", "call"])
def _all_gather_kernel(
    in_ptr,       # *word [n_elements]: this rank's input as words of 1, 2, 4 or 8 bytes (any dtype's bytes)
    out_ptr,      # *word [WORLD_SIZE * n_elements]: segment q = rank q's input (segment `rank` may be in_ptr)
    regions_ptr,  # *i64 [WORLD_SIZE]: base address of every rank's region, as mapped in this process
    status_ptr,   # *i32 [STATUS_WORDS]: the status record (status.py)
    n_elements,   # words of the input (S bytes)
    max_bytes,    # bytes of one staging buffer (>= S)
    rank,         # this rank
    timeout_ns,   # deadline of the start barrier
    desc_bytes: tl.int64,  # the call's descriptor (protocol.h CallDesc): W * S
    kind: tl.int32,        # and desc_kind(input's dtype, ALL_GATHER, MODE_STAGED, False, in place)
    call: tl.int64,        # the user's call number, for the status record
    WORLD_SIZE: tl.constexpr,
    CHUNK: tl.constexpr,   # CHUNK_BYTES in words
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    own = tl.load(regions_ptr + rank)
    e = next_epoch(own, pid)
    staging = DATA_OFFSET + (e & 1).to(tl.int64) * max_bytes  # data[e % 2]
    word = tl.pointer_type(in_ptr.dtype.element_ty)
    copy_in(in_ptr, (own + staging).to(word), 0, n_elements, pid, nprog, CHUNK, WORLD_SIZE)
    if start_call(regions_ptr, own, pid, rank, e, desc_bytes, kind, timeout_ns, status_ptr, call, False,
                  WORLD_SIZE):
        nfull = full_chunks(n_elements, pid, nprog, CHUNK, WORLD_SIZE)
        tail = tail_chunk(n_elements, pid, nprog, CHUNK, WORLD_SIZE)
        for i in range(0, WORLD_SIZE):
            # Rank r reads peer r first, then r + 1, ...: at any moment the
            # ranks read different peers' memory, not all rank 0's.
            q = (rank + i) % WORLD_SIZE
            src = (tl.load(regions_ptr + q) + staging).to(word)
            dst = out_ptr + tl.cast(q, tl.int64) * n_elements  # W * S may pass 2^31
            for k in range(0, nfull):
                c = (pid + k // WORLD_SIZE * nprog) * WORLD_SIZE + k % WORLD_SIZE
                copy_chunk(src, dst, c, n_elements, CHUNK, False, True, False)
            if tail >= 0:
                copy_chunk(src, dst, tail, n_elements, CHUNK, True, True, False)


def launch_reduce_scatter(input, out, regions, status, rank, world_size, max_bytes, nblocks, average, timeout_ns,
                          desc_bytes, kind, call):
    """Launches the reduce-scatter kernel; arguments as checked by triton_kernels.reduce_scatter."""
    size = input.element_size()
    _reduce_scatter_kernel[(nblocks,)](input, out, regions, status, out.numel(), max_bytes, rank, timeout_ns,
                                       desc_bytes, kind, call, WORLD_SIZE=world_size, CHUNK=CHUNK_BYTES // size,
                                       SEGMENT=_C.SEGMENT_UNIT // size, AVERAGE=bool(average), num_warps=NUM_WARPS)


def launch_all_gather(input, out, regions, status, rank, world_size, max_bytes, nblocks, timeout_ns, desc_bytes, kind,
                      call):
    """Launches the all-gather kernel on views of input and out (contiguous:
    checked by triton_kernels.all_gather) as the widest words of 8, 4, 2 or 1
    bytes that the segment's size and both tensors' addresses allow, as the
    CUDA kernel picks its word: any dtype's bytes, bool included, and a
    segment that is not a multiple of 16 bytes is still copied a word, not a
    byte, at a time."""
    nbytes = input.nbytes
    word = next(dt for dt in _WORDS if nbytes % dt.itemsize == 0 and input.data_ptr() % dt.itemsize == 0
                and out.data_ptr() % dt.itemsize == 0)
    src, dst = input.reshape(-1).view(torch.uint8).view(word), out.reshape(-1).view(torch.uint8).view(word)
    _all_gather_kernel[(nblocks,)](src, dst, regions, status, src.numel(), max_bytes, rank, timeout_ns, desc_bytes,
                                   kind, call, WORLD_SIZE=world_size, CHUNK=CHUNK_BYTES // word.itemsize,
                                   num_warps=NUM_WARPS)


_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)  # all-gather's word, widest first
