"""One-shot all-reduce: copy in, start barrier, every rank reads all W staging
buffers and writes the whole result. Also holds the chunk helpers the
two-shot kernel shares (chunk width, fp32 conversions, the fixed-order sum).
"""
import triton
import triton.language as tl

from pyallreduce import _C

from .signal import DATA_OFFSET, NUM_WARPS, next_epoch, start_call

# Chunk width in bytes, the same for every dtype, so that an fp32 call and a
# bf16 call give each program the same bytes of the staging buffers (the
# per-program flags rely on it, protocol.h). One ALIGNMENT unit: chunk
# boundaries are slice boundaries, which protocol.h keeps on that grid. On a
# GPU that is 32 bytes (two 16-byte vectors) per thread at 4 warps.
CHUNK_BYTES = _C.ALIGNMENT


# Which program handles chunk c (protocol.h chunk_block): (c // W) % nprog, in
# every phase of both algorithms, so a program touches the same bytes of the
# staging buffers in every call (the per-program flags rely on it). W
# consecutive chunks, one per two-shot owner (c % W, chunk_owner_rank), form a
# group, and groups go round-robin over the programs; program pid's k-th chunk
# (protocol.h block_chunk) is
#     c = (pid + k // W * nprog) * W + k % W,   owned by rank k % W.
# Every loop over chunks runs its full chunks unmasked and then at most one
# masked tail chunk (TAIL). A mask the compiler cannot prove constant over 16
# bytes (n_elements not a multiple of 16) would make every access of a chunk
# scalar; without one, the full chunks get 16-byte vector loads and stores
# (tests/test_triton_targets.py). Helpers are few and coarse on purpose: the
# interpreter pays about 2 ms per call of a @triton.jit function. Numerators
# stay nonnegative (pid < nprog), where Triton's // and % (truncating) and
# Python's (flooring, on the interpreter's plain ints) agree.
@triton.jit
def full_chunks(n_elements, pid, nprog, CHUNK: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """How many of the full chunks below element n_elements (0..n_elements //
    CHUNK - 1) are program pid's (protocol.h block_rounds): its k-th chunks
    for k = 0..this - 1."""
    nfull = n_elements // CHUNK
    groups = nfull // WORLD_SIZE  # whole groups; then a partial one of nfull % W chunks
    # Program pid's whole groups are pid, pid + nprog, ... below `groups`.
    count = (groups + nprog - 1 - pid) // nprog * WORLD_SIZE
    return count + tl.where(groups % nprog == pid, nfull % WORLD_SIZE, 0)


@triton.jit
def tail_chunk(n_elements, pid, nprog, CHUNK: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """The index of the partial last chunk if there is one and it is program
    pid's, else -1."""
    tail = n_elements // CHUNK
    return tl.where((n_elements % CHUNK != 0) & (tail // WORLD_SIZE % nprog == pid), tail, -1)


@triton.jit
def from_f32(acc, T: tl.constexpr):
    """Round-to-nearest-even to T, bit for bit as the C++ CPU backend does."""
    if T == tl.bfloat16:
        # Done on the bits (the interpreter truncates); NaN stays a quiet NaN.
        bits = acc.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(acc != acc, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return acc.to(T)


@triton.jit
def load_f32(regions_ptr, q, staging, c, n_elements, CHUNK: tl.constexpr, T: tl.constexpr, TAIL: tl.constexpr):
    """Chunk c of rank q's staging buffer at byte offset `staging` of its
    region (regions_ptr: *i64 region bases), as fp32. Pointers made from
    integers carry no alignment, so say what protocol.h guarantees (buffers
    and chunks start on ALIGNMENT boundaries); without it a GPU gets one load
    per element instead of 16-byte vectors."""
    idx = tl.cast(c, tl.int64) * CHUNK + tl.arange(0, CHUNK)
    ptrs = tl.multiple_of((tl.load(regions_ptr + q) + staging).to(tl.pointer_type(T)) + idx, [16])
    if TAIL:
        x = tl.load(ptrs, mask=idx < n_elements)
    else:
        x = tl.load(ptrs)
    if T == tl.bfloat16:
        # Exact by construction; the interpreter's bf16 conversion is not.
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def reduce_chunk(regions_ptr, staging, c, n_elements, CHUNK: tl.constexpr, AVERAGE: tl.constexpr,
                 WORLD_SIZE: tl.constexpr, T: tl.constexpr, TAIL: tl.constexpr):
    """cast(sum over q = 0..W-1 of staging[q] chunk c) (/ W), fp32, always in
    rank order, so every rank and every backend gets the same bits. Starts from
    rank 0's value, not from 0.0 (0.0 + -0.0 would lose the sign, as it would
    not in the C++ backend)."""
    acc = load_f32(regions_ptr, 0, staging, c, n_elements, CHUNK, T, TAIL)
    for q in tl.static_range(1, WORLD_SIZE):
        acc += load_f32(regions_ptr, q, staging, c, n_elements, CHUNK, T, TAIL)
    if AVERAGE:
        # Correctly rounded division (a plain `/` may compile to an approximate one).
        acc = tl.math.div_rn(acc, tl.full(acc.shape, WORLD_SIZE, tl.float32))
    return from_f32(acc, T)


@triton.jit
def copy_chunk(src_ptr, dst_ptr, c, n_elements, CHUNK: tl.constexpr, TAIL: tl.constexpr, SRC_ALIGNED: tl.constexpr,
               DST_ALIGNED: tl.constexpr):
    """dst chunk c = src chunk c (*T). *_ALIGNED: a staging buffer (see load_f32)."""
    idx = tl.cast(c, tl.int64) * CHUNK + tl.arange(0, CHUNK)
    src = src_ptr + idx
    dst = dst_ptr + idx
    if SRC_ALIGNED:
        src = tl.multiple_of(src, [16])
    if DST_ALIGNED:
        dst = tl.multiple_of(dst, [16])
    if TAIL:
        tl.store(dst, tl.load(src, mask=idx < n_elements), mask=idx < n_elements)
    else:
        tl.store(dst, tl.load(src))


@triton.jit
def copy_in(in_ptr, own_buf, begin, end, pid, nprog, CHUNK: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """Copies this program's chunks of the input (in_ptr: *T, end - begin
    elements) into elements begin..end - 1 of own_buf (*T, this rank's staging
    buffer; begin a multiple of CHUNK): peers read the copy, so the caller may
    reuse its input as soon as the call returns. All-reduce stages its input
    at 0; reduce-scatter each segment at its own begin. Program pid's chunks
    of the range are its k-th for k from (its chunks below begin) to (its
    full chunks below end), then the partial last one."""
    src = in_ptr - begin  # src + i: the input element for staging element i
    k_begin = full_chunks(begin, pid, nprog, CHUNK, WORLD_SIZE)
    for k in range(k_begin, full_chunks(end, pid, nprog, CHUNK, WORLD_SIZE)):
        c = (pid + k // WORLD_SIZE * nprog) * WORLD_SIZE + k % WORLD_SIZE
        copy_chunk(src, own_buf, c, end, CHUNK, False, False, True)
    tail = tail_chunk(end, pid, nprog, CHUNK, WORLD_SIZE)
    if tail >= 0:
        copy_chunk(src, own_buf, tail, end, CHUNK, True, False, True)


@triton.jit
def store_chunk(ptr, c, values, n_elements, CHUNK: tl.constexpr, TAIL: tl.constexpr, ALIGNED: tl.constexpr):
    """ptr chunk c = values (ptr: *T; ALIGNED: a staging buffer)."""
    idx = tl.cast(c, tl.int64) * CHUNK + tl.arange(0, CHUNK)
    ptrs = ptr + idx
    if ALIGNED:
        ptrs = tl.multiple_of(ptrs, [16])
    if TAIL:
        tl.store(ptrs, values, mask=idx < n_elements)
    else:
        tl.store(ptrs, values)


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
    kind: tl.int32,        # and desc_kind(dtype, ONE_SHOT, MODE_STAGED, average, in place)
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
    copy_in(in_ptr, (own + staging).to(tl.pointer_type(T)), 0, n_elements, pid, nprog, CHUNK, WORLD_SIZE)
    # No mid barrier: start_call also refreshes the mid flags (the wrap fix).
    if start_call(regions_ptr, own, pid, rank, e, desc_bytes, kind, timeout_ns, status_ptr, call, False,
                  WORLD_SIZE):
        # The chunks this program copied in, on every rank (chunk_block).
        for k in range(0, full_chunks(n_elements, pid, nprog, CHUNK, WORLD_SIZE)):
            c = (pid + k // WORLD_SIZE * nprog) * WORLD_SIZE + k % WORLD_SIZE
            store_chunk(out_ptr, c, reduce_chunk(regions_ptr, staging, c, n_elements, CHUNK, AVERAGE, WORLD_SIZE, T,
                                                 False), n_elements, CHUNK, False, False)
        tail = tail_chunk(n_elements, pid, nprog, CHUNK, WORLD_SIZE)
        if tail >= 0:
            store_chunk(out_ptr, tail, reduce_chunk(regions_ptr, staging, tail, n_elements, CHUNK, AVERAGE, WORLD_SIZE,
                                                    T, True), n_elements, CHUNK, True, False)


def launch(input, out, regions, status, rank, world_size, max_bytes, nblocks, average, timeout_ns, desc_bytes,
           kind, call):
    """Launches the one-shot kernel; arguments as checked by all_reduce."""
    _kernel[(nblocks,)](input, out, regions, status, input.numel(), max_bytes, rank, timeout_ns, desc_bytes, kind,
                        call, WORLD_SIZE=world_size, CHUNK=CHUNK_BYTES // input.element_size(),
                        AVERAGE=bool(average), num_warps=NUM_WARPS)
