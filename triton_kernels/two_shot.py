"""Two-shot all-reduce: copy in, start barrier, each rank reduces the chunks it
owns from every peer into its own staging buffer, mid barrier, every rank
gathers each chunk from its owner. Moves 2(W-1)/W of the bytes per rank
instead of W-1: the bandwidth-bound sizes."""
import triton
import triton.language as tl

from .one_shot import CHUNK_BYTES, NUM_WARPS, chunk_range, copy_in, reduce_chunk, region_ptr, staging_ptrs
from .signal import DATA_OFFSET, MID_BARRIER, MID_FLAGS_OFFSET, START_BARRIER, START_FLAGS_OFFSET, barrier, next_epoch


@triton.jit(do_not_specialize=["rank", "timeout_ns"])
def _kernel(
    in_ptr,       # *T [n_elements]: this rank's input
    out_ptr,      # *T [n_elements]: the result (may be in_ptr: in place)
    regions_ptr,  # *i64 [WORLD_SIZE]: base address of every rank's region, as mapped in this process
    status_ptr,   # *i32 [STATUS_WORDS]: deadline error record (interpreter; a GPU traps instead)
    n_elements,   # elements of the input
    max_bytes,    # bytes of one staging buffer
    rank,         # this rank
    timeout_ns,   # deadline of each barrier wait
    WORLD_SIZE: tl.constexpr,
    CHUNK: tl.constexpr,    # elements per chunk: CHUNK_BYTES // element size
    AVERAGE: tl.constexpr,  # divide the sum by WORLD_SIZE
):
    T: tl.constexpr = in_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    nchunks = tl.cdiv(n_elements, CHUNK)
    own = tl.load(regions_ptr + rank)
    e = next_epoch(own, pid)
    staging = DATA_OFFSET + (e & 1).to(tl.int64) * max_bytes  # data[e % 2]
    own_buf = (own + staging).to(tl.pointer_type(T))
    copy_in(in_ptr, own_buf, n_elements, pid, nprog, CHUNK)
    if barrier(regions_ptr, own, START_FLAGS_OFFSET, pid, rank, e, timeout_ns, status_ptr, START_BARRIER,
               WORLD_SIZE):
        # Chunk c is program c % nprog's and rank (c // nprog) % W's
        # (protocol.h chunk_owner_rank): this program's chunks owned by this
        # rank are pid + nprog * (rank + W * k). The result overwrites this
        # rank's own input copy, which no peer reads before the mid barrier.
        for c in range(pid + nprog * rank, nchunks, nprog * WORLD_SIZE):
            idx, mask = chunk_range(c, n_elements, CHUNK)
            tl.store(staging_ptrs(own_buf, idx), reduce_chunk(regions_ptr, staging, idx, mask, AVERAGE, WORLD_SIZE, T),
                     mask=mask)
        if barrier(regions_ptr, own, MID_FLAGS_OFFSET, pid, rank, e, timeout_ns, status_ptr, MID_BARRIER,
                   WORLD_SIZE):
            for c in range(pid, nchunks, nprog):
                idx, mask = chunk_range(c, n_elements, CHUNK)
                owner_buf = region_ptr(regions_ptr, (c // nprog) % WORLD_SIZE, staging, T)
                tl.store(out_ptr + idx, tl.load(staging_ptrs(owner_buf, idx), mask=mask), mask=mask)


def launch(input, out, regions, status, rank, world_size, max_bytes, nblocks, average, timeout_ns):
    """Launches the two-shot kernel; arguments as checked by all_reduce."""
    _kernel[(nblocks,)](input, out, regions, status, input.numel(), max_bytes, rank, timeout_ns,
                        WORLD_SIZE=world_size, CHUNK=CHUNK_BYTES // input.element_size(),
                        AVERAGE=bool(average), num_warps=NUM_WARPS)
