"""How a call the kernels cannot take in one run is cut: an all-reduce into
chunks of the staging size, a reduce-scatter or all-gather into pieces of
every segment, through contiguous copies where the tensors are not. The
Communicator decides that a call runs on the kernels and how large a run may
be; these only cut, and hand each flat contiguous pair to run(src, dst)."""
import torch

from .protocol import is_own_segment, overlaps


def _contiguous_out(dst):
    return dst if dst.is_contiguous() else torch.empty(dst.shape, dtype=dst.dtype, device=dst.device)


def reduce_in_chunks(run, src, dst, per_call):
    """All-reduce src into dst (dst may be src) in chunks of at most per_call elements."""
    if torch.compiler.is_compiling():
        # Traced, each chunk goes into a tensor of its own and one copy joins
        # them: given chunks written into slices of one buffer, torch 2.4's
        # inductor made a kernel that read the whole tensor's length from the
        # last chunk's buffer (a segfault now and then; seen in CI's 2.4.1 row).
        flat_src = src.contiguous().view(-1)
        chunks = [flat_src[start:start + per_call] for start in range(0, flat_src.numel(), per_call)]
        outs = [torch.empty_like(chunk) for chunk in chunks]
        for chunk, out in zip(chunks, outs):
            run(chunk, out)
        dst.copy_(torch.cat(outs).view(dst.shape))
        return
    dst_c = _contiguous_out(dst)
    flat_src, flat_dst = src.contiguous().view(-1), dst_c.view(-1)
    for start in range(0, flat_src.numel(), per_call):
        run(flat_src[start:start + per_call], flat_dst[start:start + per_call])
    if dst_c is not dst:
        dst.copy_(dst_c)


def scatter_or_gather_in_pieces(run, scatters, src, dst, rank, world_size, per):
    """Reduce-scatter (scatters) or all-gather src into dst, `per` elements of
    every segment at a time (None: whole segments). src and dst may overlap only
    as protocol.h allows (this rank's segment of the larger tensor); anything
    else goes through a copy of src. Under torch.compile addresses are not
    known when tracing: the op itself refuses any other overlap, saying what
    to pass (csrc/module.cpp)."""
    src_c, dst_c = src.contiguous(), _contiguous_out(dst)
    whole, part = (src_c, dst_c) if scatters else (dst_c, src_c)
    if not torch.compiler.is_compiling() and overlaps(src_c, dst_c) and not is_own_segment(part, whole, rank):
        src_c = src_c.clone()
    src_c, flat_dst = src_c.view(-1), dst_c.view(-1)
    n = flat_dst.numel() if scatters else src_c.numel()  # elements per segment
    if per is None or per >= n:  # one piece: no loop over n, on which torch.compile would specialise
        run(src_c, flat_dst)
    else:
        for start in range(0, n, per):
            stop = min(n, start + per)
            if scatters:
                run(src_c.view(world_size, n)[:, start:stop].contiguous().view(-1), flat_dst[start:stop])
            else:
                d = torch.empty(world_size * (stop - start), dtype=dst.dtype, device=dst.device)
                run(src_c[start:stop], d)
                flat_dst.view(world_size, n)[:, start:stop].copy_(d.view(world_size, -1))
    if dst_c is not dst:
        dst.copy_(dst_c)
