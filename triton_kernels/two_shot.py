"""Two-shot all-reduce: copy in, start barrier, each rank reduces the chunks it
owns from every peer into its own staging buffer, mid barrier, every rank
gathers each chunk from its owner. Moves 2(W-1)/W of the bytes per rank
instead of W-1: the bandwidth-bound sizes."""
import triton
import triton.language as tl

from .one_shot import (CHUNK_BYTES, NUM_WARPS, copy_chunk, copy_in, full_chunks, reduce_chunk, store_chunk,
                       tail_chunk)
from .signal import DATA_OFFSET, MID_FLAGS_OFFSET, barrier, next_epoch, start_call
from .status import MID_BARRIER


@triton.jit(do_not_specialize=["rank", "timeout_ns", "desc_bytes", "kind", "call"])
def _kernel(
    in_ptr,       # *T [n_elements]: this rank's input
    out_ptr,      # *T [n_elements]: the result (may be in_ptr: in place)
    regions_ptr,  # *i64 [WORLD_SIZE]: base address of every rank's region, as mapped in this process
    status_ptr,   # *i32 [STATUS_WORDS]: the status record (status.py)
    n_elements,   # elements of the input
    max_bytes,    # bytes of one staging buffer
    rank,         # this rank
    timeout_ns,   # deadline of each barrier wait
    desc_bytes: tl.int64,  # the call's descriptor (protocol.h CallDesc): payload bytes
    kind: tl.int32,        # and desc_kind(dtype, TWO_SHOT, MODE_STAGED, average, in place)
    call: tl.int64,        # the user's call number, for the status record
    WORLD_SIZE: tl.constexpr,
    CHUNK: tl.constexpr,    # elements per chunk: CHUNK_BYTES // element size
    AVERAGE: tl.constexpr,  # divide the sum by WORLD_SIZE
):
    T: tl.constexpr = in_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    own = tl.load(regions_ptr + rank)
    e = next_epoch(own, pid)
    staging = DATA_OFFSET + (e & 1).to(tl.int64) * max_bytes  # data[e % 2]
    own_buf = (own + staging).to(tl.pointer_type(T))
    copy_in(in_ptr, own_buf, 0, n_elements, pid, nprog, CHUNK, WORLD_SIZE)
    if start_call(regions_ptr, own, pid, rank, e, desc_bytes, kind, timeout_ns, status_ptr, call, True,
                  WORLD_SIZE):
        # Chunk c is program (c // W) % nprog's and rank c % W's (protocol.h
        # chunk_block, chunk_owner_rank; one_shot.py): this program's chunks
        # owned by this rank are (pid + nprog * j) * W + rank, one per group.
        nfull = n_elements // CHUNK
        tail = tail_chunk(n_elements, pid, nprog, CHUNK, WORLD_SIZE)
        # The result overwrites this rank's own input copy, which no peer reads
        # before the mid barrier.
        for c in range(pid * WORLD_SIZE + rank, nfull, nprog * WORLD_SIZE):
            store_chunk(own_buf, c, reduce_chunk(regions_ptr, staging, c, n_elements, CHUNK, AVERAGE, WORLD_SIZE, T,
                                                 False), n_elements, CHUNK, False, True)
        if (tail >= 0) & (tail % WORLD_SIZE == rank):
            store_chunk(own_buf, tail, reduce_chunk(regions_ptr, staging, tail, n_elements, CHUNK, AVERAGE, WORLD_SIZE,
                                                    T, True), n_elements, CHUNK, True, True)
        if barrier(regions_ptr, own, MID_FLAGS_OFFSET, pid, rank, e, timeout_ns, status_ptr, call, MID_BARRIER,
                   WORLD_SIZE):
            # Every chunk of this program from its owner's staging buffer.
            for k in range(0, full_chunks(n_elements, pid, nprog, CHUNK, WORLD_SIZE)):
                c = (pid + k // WORLD_SIZE * nprog) * WORLD_SIZE + k % WORLD_SIZE
                owner_buf = (tl.load(regions_ptr + k % WORLD_SIZE) + staging).to(tl.pointer_type(T))
                copy_chunk(owner_buf, out_ptr, c, n_elements, CHUNK, False, True, False)
            if tail >= 0:
                owner_buf = (tl.load(regions_ptr + tail % WORLD_SIZE) + staging).to(tl.pointer_type(T))
                copy_chunk(owner_buf, out_ptr, tail, n_elements, CHUNK, True, True, False)


def launch(input, out, regions, status, rank, world_size, max_bytes, nblocks, average, timeout_ns, desc_bytes,
           kind, call):
    """Launches the two-shot kernel; arguments as checked by all_reduce."""
    _kernel[(nblocks,)](input, out, regions, status, input.numel(), max_bytes, rank, timeout_ns, desc_bytes, kind,
                        call, WORLD_SIZE=world_size, CHUNK=CHUNK_BYTES // input.element_size(),
                        AVERAGE=bool(average), num_warps=NUM_WARPS)
