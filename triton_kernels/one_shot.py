"""One-shot all-reduce: copy in, start barrier, every rank reads all W staging
buffers and writes the whole result. Also holds the chunk helpers the
two-shot kernel shares (chunk width, fp32 conversions, the fixed-order sum).
"""
import triton
import triton.language as tl

from pyallreduce import _C

from .signal import DATA_OFFSET, START_BARRIER, START_FLAGS_OFFSET, barrier, next_epoch

# Chunk width in bytes, the same for every dtype, so that an fp32 call and a
# bf16 call give each program the same bytes of the staging buffers (the
# per-program flags rely on it, protocol.h). One ALIGNMENT unit: chunk
# boundaries are slice boundaries, which protocol.h keeps on that grid. On a
# GPU that is 32 bytes (two 16-byte vectors) per thread at 4 warps.
CHUNK_BYTES = _C.ALIGNMENT
NUM_WARPS = 4


@triton.jit
def chunk_range(c, n_elements, CHUNK: tl.constexpr):
    """Element indices of chunk c and the mask of those below n_elements."""
    idx = tl.cast(c, tl.int64) * CHUNK + tl.arange(0, CHUNK)
    return idx, idx < n_elements


@triton.jit
def region_ptr(regions_ptr, q, offset, T: tl.constexpr):
    """*T at byte `offset` of rank q's region (regions_ptr: *i64 region bases)."""
    return (tl.load(regions_ptr + q) + offset).to(tl.pointer_type(T))


@triton.jit
def staging_ptrs(buf, idx):
    """buf + idx for a chunk of a staging buffer (buf: *T). Pointers made from
    integers carry no alignment, so say what protocol.h guarantees (buffers
    and chunks start on ALIGNMENT boundaries); without it a GPU gets one load
    per element instead of 16-byte vectors."""
    return tl.multiple_of(buf + idx, [16])


@triton.jit
def to_f32(x):
    if x.dtype == tl.bfloat16:
        # Exact by construction; the interpreter's bf16 conversion is not.
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


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
def reduce_chunk(regions_ptr, staging, idx, mask, AVERAGE: tl.constexpr, WORLD_SIZE: tl.constexpr,
                 T: tl.constexpr):
    """cast(sum over q = 0..W-1 of staging[q][idx]) (/ W), fp32, always in rank
    order, so every rank and every backend gets the same bits. Starts from rank
    0's value, not from 0.0 (0.0 + -0.0 would lose the sign, as it would not
    in the C++ backend)."""
    acc = to_f32(tl.load(staging_ptrs(region_ptr(regions_ptr, 0, staging, T), idx), mask=mask))
    for q in tl.static_range(1, WORLD_SIZE):
        acc += to_f32(tl.load(staging_ptrs(region_ptr(regions_ptr, q, staging, T), idx), mask=mask))
    if AVERAGE:
        # Correctly rounded division (a plain `/` may compile to an approximate one).
        acc = tl.math.div_rn(acc, tl.full(acc.shape, WORLD_SIZE, tl.float32))
    return from_f32(acc, T)


@triton.jit
def copy_in(in_ptr, own_buf, n_elements, pid, nprog, CHUNK: tl.constexpr):
    """Copies this program's chunks of the input (in_ptr: *T) into own_buf (*T,
    this rank's staging buffer): peers read the copy, so the caller may reuse
    its input as soon as the call returns."""
    for c in range(pid, tl.cdiv(n_elements, CHUNK), nprog):
        idx, mask = chunk_range(c, n_elements, CHUNK)
        tl.store(staging_ptrs(own_buf, idx), tl.load(in_ptr + idx, mask=mask), mask=mask)


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
    own = tl.load(regions_ptr + rank)
    e = next_epoch(own, pid)
    staging = DATA_OFFSET + (e & 1).to(tl.int64) * max_bytes  # data[e % 2]
    copy_in(in_ptr, (own + staging).to(tl.pointer_type(T)), n_elements, pid, nprog, CHUNK)
    if barrier(regions_ptr, own, START_FLAGS_OFFSET, pid, rank, e, timeout_ns, status_ptr, START_BARRIER,
               WORLD_SIZE):
        # Chunk c belongs to program c % nprog on every rank and in every call.
        for c in range(pid, tl.cdiv(n_elements, CHUNK), nprog):
            idx, mask = chunk_range(c, n_elements, CHUNK)
            tl.store(out_ptr + idx, reduce_chunk(regions_ptr, staging, idx, mask, AVERAGE, WORLD_SIZE, T),
                     mask=mask)


def launch(input, out, regions, status, rank, world_size, max_bytes, nblocks, average, timeout_ns):
    """Launches the one-shot kernel; arguments as checked by all_reduce."""
    _kernel[(nblocks,)](input, out, regions, status, input.numel(), max_bytes, rank, timeout_ns,
                        WORLD_SIZE=world_size, CHUNK=CHUNK_BYTES // input.element_size(),
                        AVERAGE=bool(average), num_warps=NUM_WARPS)
