"""signal.wait_peers as a kernel of its own, for tests/test_triton.py. Import
it only where TRITON_INTERPRET is already set (in a rank): Triton reads it
when the kernel is decorated, and the interpreter resolves the kernel's names
in this module's globals."""
import triton
import triton.language as tl

from pyallreduce.triton_kernels import signal, status


@triton.jit
def wait_kernel(regions_ptr, status_ptr, out_ptr, timeout_ns, WORLD_SIZE: tl.constexpr):
    """Program 0 of rank 0 waits at epoch 1 on the start flags of the region
    at regions_ptr[0] (regions_ptr[WORLD_SIZE]: the claim word, as
    triton_kernels.prepare makes the table); out_ptr[0] = whether every peer
    arrived."""
    own = tl.load(regions_ptr)
    pid = tl.program_id(0)
    rank, e, call = tl.full((), 0, tl.int32), tl.full((), 1, tl.int32), tl.full((), 7, tl.int64)
    ok = signal.wait_peers(own, signal.START_FLAGS_OFFSET, pid, rank, e, timeout_ns, status_ptr,
                           signal.claim_word(regions_ptr, WORLD_SIZE), call,
                           status.START_BARRIER, WORLD_SIZE)
    tl.store(out_ptr, ok.to(tl.int32))
