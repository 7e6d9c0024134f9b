"""Inputs and the reference every correctness test compares against."""
import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Calls the ranks disagree about: what every rank calls, and what the last rank
# calls instead, each (numel, dtype, op, algo, in place). Dtypes the kernels do
# not take (float64, int64) go to torch.distributed after an agreement round;
# numel 0 runs the agreement round alone.
MISMATCHED_CALLS = {
    "size": ((1000, torch.float32, "sum", "one_shot", False), (1001, torch.float32, "sum", "one_shot", False)),
    # the same bytes: only the dtype differs
    "dtype": ((2000, torch.float32, "sum", "two_shot", False), (4000, torch.bfloat16, "sum", "two_shot", False)),
    "op": ((1000, torch.float16, "sum", "one_shot", False), (1000, torch.float16, "avg", "one_shot", False)),
    "algo": ((1000, torch.float32, "sum", "one_shot", False), (1000, torch.float32, "sum", "two_shot", False)),
    "in_place": ((1000, torch.float32, "sum", "two_shot", True), (1000, torch.float32, "sum", "two_shot", False)),
    "fallback_vs_one_shot": ((1000, torch.float32, "sum", "one_shot", False),
                             (1000, torch.float64, "sum", "one_shot", False)),
    "fallback_vs_two_shot": ((1000, torch.float64, "sum", "two_shot", True),
                             (1000, torch.float32, "sum", "two_shot", True)),
    "empty_vs_kernel": ((0, torch.float32, "sum", "one_shot", False), (1000, torch.float32, "sum", "one_shot", False)),
    "fallback_size": ((1000, torch.int64, "sum", "auto", False), (1002, torch.int64, "sum", "auto", False)),
}


def exact_input(numel, rank, dtype, salt=0):
    """Integer-valued and small (|x| <= 32), so any sum over <= 8 ranks is exact in every dtype."""
    i = torch.arange(numel, dtype=torch.int64)
    return ((i * 7 + salt * 13 + rank * 5) % 9 - 4).to(dtype)


def exact_sum(numel, world_size, dtype, salt=0):
    return sum(exact_input(numel, q, torch.float64, salt) for q in range(world_size)).to(dtype)


def fp32_reduction(inputs, average):
    """The product's definition: fp32 sum in rank order, / W, one cast."""
    acc = inputs[0].float()
    for x in inputs[1:]:
        acc = acc + x.float()
    if average:
        acc = acc / len(inputs)
    return acc.to(inputs[0].dtype)


def random_input(numel, rank, dtype, seed):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(numel, generator=g).to(dtype)


def tolerance(dtype, world_size):
    """Against an fp64 reference: one final rounding plus the fp32 sums."""
    eps = {torch.float32: 2 ** -23, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
    return dict(rtol=2 * eps, atol=2 * eps * world_size)


def triton_kernels_unusable(interpret):
    """Why the Triton kernels cannot run here (under TRITON_INTERPRET=1 when
    `interpret`), for a test's skip, or None (pyallreduce/triton_requirements.py)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    from pyallreduce import triton_requirements

    return triton_requirements.triton_too_old() or (triton_requirements.interpreter_unusable() if interpret else None)
