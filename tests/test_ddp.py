"""The DDP hook on CPU (gloo process group, host shared-memory backend).

A small model with an embedding, a conv and two linear layers, cut into several buckets by
a tiny bucket_cap_mb, is trained for STEPS steps with the hook and compared with DDP's
default all-reduce and with one process training on the whole global batch.
"""
import dataclasses
import functools
import gc
import hashlib
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from launch import run_ranks

STEPS = 50
GLOBAL_BATCH = 16  # every world size tested divides it
SEQ = 6
VOCAB = 40
CLASSES = 7
BUCKET_CAP_MB = 0.001  # ~1 KB: the ~10 KB of gradients form four buckets
LR = 0.2  # plain SGD: momentum and larger steps amplify rounding past RTOL within 50 steps
RTOL = 1e-6
BF16_RTOL = 2e-2
TIMEOUT = 150.0
REFERENCE_MIN_BYTES = 3000  # the "fallback" variant's crossover: between the buckets' sizes


class Net(nn.Module):
    def __init__(self, head_dtype=torch.float32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 12)
        self.conv = nn.Conv1d(12, 20, 3, padding=1)
        self.hidden = nn.Linear(20, 48)
        self.head = nn.Linear(48, CLASSES).to(head_dtype)

    def forward(self, tokens):
        x = self.embed(tokens).transpose(1, 2)  # (batch, channels, seq) for the conv
        x = torch.relu(self.conv(x)).mean(dim=2)
        x = torch.tanh(self.hidden(x))
        return self.head(x.to(self.head.weight.dtype)).float()


def make_net(head_dtype=torch.float32):
    torch.manual_seed(0)  # every rank and the baseline start from the same weights
    return Net(head_dtype)


def global_batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    labels = torch.randint(CLASSES, (GLOBAL_BATCH,), generator=g)
    return tokens, labels


def train(model, rank=0, world_size=1, after_step=None):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    per = GLOBAL_BATCH // world_size
    for step in range(STEPS):
        tokens, labels = global_batch(step)
        tokens, labels = tokens[rank * per:(rank + 1) * per], labels[rank * per:(rank + 1) * per]
        opt.zero_grad()
        F.cross_entropy(model(tokens), labels).backward()
        opt.step()
        if after_step is not None:
            after_step(model)
    # numpy arrays: torch tensors would travel back from the ranks as shared-memory handles
    return [p.detach().numpy().copy() for p in model.parameters()]


def params_digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def rel_diff(a, b):
    """Largest difference relative to the parameter's largest magnitude, over the parameters."""
    assert len(a) == len(b)
    return max(float(abs(x.astype("float64") - y).max() / abs(y.astype("float64")).max()) for x, y in zip(a, b))


# ---- what every rank runs ------------------------------------------------------------

VARIANTS = {
    # name: (DDP keyword arguments, register() options, head dtype)
    "default": (dict(), None, torch.float32),
    "hook": (dict(), dict(), torch.float32),
    "bucket_view": (dict(gradient_as_bucket_view=True), dict(), torch.float32),
    "static_graph": (dict(static_graph=True), dict(), torch.float32),
    "bf16": (dict(), dict(compression="bf16"), torch.float32),
    # Buckets routed to gloo: the float64 head's (pyallreduce does not reduce float64) and,
    # with REFERENCE_MIN_BYTES as the crossover, the 4 KB bucket of the hidden layer.
    "fallback": (dict(), dict(), torch.float64),
}


def _train_variants(rank, world_size, names, hosts):
    import pyallreduce.ddp

    if hosts > 1:
        # Simulated hosts: ranks 0..k-1 on host0, the next k on host1, ...
        os.environ["PYALLREDUCE_HOSTNAME"] = f"host{rank * hosts // world_size}"
    if hosts == 1:
        _check_bad_input(pyallreduce.ddp)
    out = {}
    for name in names:
        ddp_kwargs, options, head_dtype = VARIANTS[name]
        model = DDP(make_net(head_dtype), bucket_cap_mb=BUCKET_CAP_MB, **ddp_kwargs)
        state = pyallreduce.ddp.register(model, **options) if options is not None else None
        if name == "fallback":
            state.comm.crossover = dataclasses.replace(state.comm.crossover, reference_min_bytes=REFERENCE_MIN_BYTES)
        digests = []
        params = train(model, rank, world_size, after_step=lambda m: digests.append(params_digest(m)))
        out[name] = dict(params=params, digests=digests)
        if state is not None:
            out[name].update(calls=state.calls, reference_calls=state.reference_calls,
                             hierarchical=state.hierarchy is not None)
            state.close()
        del model, state
    # DDP's reference cycles hold the gloo group; freed at interpreter exit instead, it can
    # abort the process there.
    gc.collect()
    return out


def _check_bad_input(ddp):
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        ddp.register(make_net())
    model = DDP(make_net())  # collective: every rank runs these checks
    with pytest.raises(ValueError, match="compression"):
        ddp.register(model, compression="int8")
    with pytest.raises(TypeError, match="HookState"):
        ddp.allreduce_hook(None, None)


def run(world_size, names, hosts=1):
    # No leftover segments: conftest's fixture checks that for every test.
    return run_ranks(_train_variants, world_size, names, hosts, timeout=TIMEOUT)


def check_identical_across_ranks(results, name):
    for step in range(STEPS):
        seen = {r[name]["digests"][step] for r in results}
        assert len(seen) == 1, f"{name}: ranks' parameters differ after step {step}"


@functools.lru_cache(maxsize=None)
def baseline(head_dtype=torch.float32):
    """One process, the whole global batch each step."""
    return train(make_net(head_dtype))


# ---- tests ---------------------------------------------------------------------------

def test_hook_matches_default_ddp_and_single_process_2_ranks():
    names = ["default", "hook", "bucket_view", "static_graph", "bf16", "fallback"]
    results = run(2, names)
    ref = baseline()
    default = results[0]["default"]["params"]
    assert rel_diff(default, ref) <= RTOL, "DDP's own result differs from one process: the test is wrong"
    for name in ["hook", "bucket_view", "static_graph"]:
        check_identical_across_ranks(results, name)
        got = results[0][name]
        # Several buckets per step, every one reduced by pyallreduce.
        assert got["calls"] >= 3 * STEPS and got["reference_calls"] == 0, got
        assert rel_diff(got["params"], default) <= RTOL, f"{name} vs default DDP"
        assert rel_diff(got["params"], ref) <= RTOL, f"{name} vs one process"

    check_identical_across_ranks(results, "bf16")
    bf16 = results[0]["bf16"]["params"]
    hook = results[0]["hook"]["params"]
    diff = rel_diff(bf16, hook)
    assert 0 < diff <= BF16_RTOL, f"bf16 compression vs uncompressed: relative difference {diff}"

    check_identical_across_ranks(results, "fallback")
    fallback = results[0]["fallback"]
    # 2 of the 4 buckets per step go to gloo (the first iteration has its own buckets).
    assert 1.5 * STEPS < fallback["reference_calls"] < fallback["calls"] - 1.5 * STEPS, fallback
    assert rel_diff(fallback["params"], baseline(torch.float64)) <= RTOL, "fallback vs one process"


@pytest.fixture(scope="module")
def flat_4_ranks():
    return run(4, ["default", "hook"])


def test_hook_matches_default_ddp_and_single_process_4_ranks(flat_4_ranks):
    check_identical_across_ranks(flat_4_ranks, "hook")
    got = flat_4_ranks[0]["hook"]
    assert got["calls"] >= 3 * STEPS and got["reference_calls"] == 0 and not got["hierarchical"], got
    assert rel_diff(got["params"], flat_4_ranks[0]["default"]["params"]) <= RTOL
    assert rel_diff(got["params"], baseline()) <= RTOL


def test_two_hosts_hierarchical_matches_flat(flat_4_ranks):
    results = run(4, ["hook"], hosts=2)  # DDP's default does not depend on the host names
    check_identical_across_ranks(results, "hook")
    got = results[0]["hook"]
    assert got["hierarchical"] and got["reference_calls"] == 0, got
    assert rel_diff(got["params"], flat_4_ranks[0]["default"]["params"]) <= RTOL
    assert rel_diff(got["params"], baseline()) <= RTOL
    assert rel_diff(got["params"], flat_4_ranks[0]["hook"]["params"]) <= RTOL
