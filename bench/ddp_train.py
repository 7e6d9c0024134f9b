"""Train a small transformer LM with DistributedDataParallel twice, with DDP's own
all-reduce and with pyallreduce's communication hook, and compare step time, time spent
in the hook and the final loss.

    python bench/ddp_train.py --nproc 4                          # spawns 4 CPU ranks itself
    torchrun --nproc-per-node=8 bench/ddp_train.py --json out.json   # one GPU per rank

Both runs start from the same weights and see the same synthetic token batches (every
rank a different slice of one global batch), so their losses should agree to rounding.
"""
import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import pyallreduce.ddp

from local_ranks import add_launch_arguments, init_group, spawn_ranks, under_torchrun

MODES = ("default", "pyallreduce")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Step time: median over the timed steps of the slowest rank. Comm time: per step, mean "
               "over timed steps, slowest rank, summed over the step's buckets. For 'default' (torch's "
               "own allreduce_hook, whose collective runs after the hook returns) a bucket counts from "
               "the hook call until its result is ready; for pyallreduce, the host time inside the hook, "
               "which on CPU is the whole reduction and on CUDA only the launch (side stream). Without "
               "torchrun (no RANK in the environment) the script starts --nproc ranks itself, with "
               "OMP_NUM_THREADS = cores/nproc unless set.")
    add_launch_arguments(p, nproc=2)
    p.add_argument("--steps", type=int, default=30, help="timed training steps per mode (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before them (default 5)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step (default 8)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--vocab", type=int, default=2048, help="vocabulary size (default 2048)")
    p.add_argument("--dim", type=int, default=128, help="model width (default 128)")
    p.add_argument("--layers", type=int, default=2, help="transformer layers (default 2)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size in MiB (default 25)")
    p.add_argument("--compression", choices=("none", "bf16", "fp16"), default="none",
                   help="pyallreduce.ddp compression option (default none)")
    p.add_argument("--nblocks", type=int, default=None,
                   help="GPU blocks the pyallreduce kernel may use (default: the Communicator's)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {','.join(MODES)} (default both)")
    p.add_argument("--seed", type=int, default=0, help="weights and data seed (default 0)")
    p.add_argument("--json", type=Path, help="write the configuration and per-mode results here")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        p.error(f"--modes: {bad or args.modes!r}; choose from {', '.join(MODES)}")
    if min(args.steps, args.batch, args.seq, args.vocab, args.dim, args.layers, args.heads, args.nproc) < 1 \
            or args.warmup < 0:
        p.error("--steps, --batch, --seq, --vocab, --dim, --layers, --heads, --nproc must be >= 1, --warmup >= 0")
    if args.dim % args.heads:
        p.error(f"--dim {args.dim} must be a multiple of --heads {args.heads}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible")
    args.compression = None if args.compression == "none" else args.compression
    return args


# ---- model and data ----------------------------------------------------------------

class TinyLM(nn.Module):
    def __init__(self, vocab, dim, layers, heads, seq):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(seq, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens):
        x = self.tokens(tokens) + self.positions.weight[:tokens.shape[1]]
        x = self.blocks(x, mask=self.causal, is_causal=True)
        return self.head(self.norm(x))


class Tokens:
    """Synthetic text with structure a model can learn: each next token is a fixed random
    permutation of the current one, except for 10% random tokens."""

    def __init__(self, args, world_size):
        g = torch.Generator().manual_seed(args.seed + 1)
        self.successor = torch.randperm(args.vocab, generator=g)
        self.args = args
        self.world_size = world_size

    def batch(self, step, rank, device):
        a = self.args
        g = torch.Generator().manual_seed(a.seed * 1_000_003 + step)
        n = a.batch * self.world_size  # one global batch; this rank takes its slice
        seq = torch.empty(n, a.seq + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(a.vocab, (n,), generator=g)
        noise = torch.rand(n, a.seq, generator=g) < 0.1
        random = torch.randint(a.vocab, (n, a.seq), generator=g)
        for t in range(a.seq):
            seq[:, t + 1] = torch.where(noise[:, t], random[:, t], self.successor[seq[:, t]])
        mine = seq[rank * a.batch:(rank + 1) * a.batch].to(device)
        return mine[:, :-1], mine[:, 1:]


# ---- one training run ----------------------------------------------------------------

class TimedDefault:
    """State for torch's own allreduce_hook with the time inside it counted."""

    def __init__(self, group):
        self.group = group
        self.seconds = 0.0


def timed_default_hook(state, bucket):
    """DDP's default all-reduce, timed from the hook call until the bucket's result
    is ready: its work runs asynchronously, so time inside the hook alone would
    count only the enqueue."""
    start = time.perf_counter()

    def ready(fut):
        state.seconds += time.perf_counter() - start
        return fut.value()
    return default_hooks.allreduce_hook(state.group, bucket).then(ready)


def train(mode, args, device, data):
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    model = TinyLM(args.vocab, args.dim, args.layers, args.heads, args.seq).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=args.bucket_cap_mb)
    if mode == "pyallreduce":
        state = pyallreduce.ddp.register(ddp, compression=args.compression, nblocks=args.nblocks)
    else:
        state = TimedDefault(ddp.process_group)
        ddp.register_comm_hook(state, timed_default_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    step_s, comm_s = [], []
    for step in range(args.warmup + args.steps):
        inputs, targets = data.batch(step, rank, device)
        comm_before = state.seconds
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= args.warmup:
            step_s.append(time.perf_counter() - start)
            comm_s.append(state.seconds - comm_before)
    final_loss = loss.detach().float().reshape(1)
    dist.all_reduce(final_loss)  # the global batch's loss: the mean of the ranks' (equal) slices
    result = dict(step_s=statistics.median(step_s), comm_s=statistics.mean(comm_s),
                  final_loss=final_loss.item() / dist.get_world_size())
    if mode == "pyallreduce":
        result.update(hook_calls=state.calls, reference_calls=state.reference_calls,
                      hierarchical=state.hierarchy is not None)
        state.close()
    return result


def run(args):
    device = init_group(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = Tokens(args, world)
    results = {}
    for mode in args.modes:
        mine = train(mode, args, device, data)
        every = [None] * world
        dist.all_gather_object(every, mine)
        results[mode] = dict(every[0], step_s=max(r["step_s"] for r in every),
                             comm_s=max(r["comm_s"] for r in every))
    if rank == 0:
        report(args, world, device, results)
    # The models (reference cycles inside DDP) hold the process group; a gloo group that is
    # only freed at interpreter exit can abort there ("terminate called without an active
    # exception"), so free them while everything is alive.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def report(args, world, device, results):
    print(f"# {world} ranks on {device.type}"
          f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, "
          f"TinyLM dim={args.dim} layers={args.layers} vocab={args.vocab}, batch {args.batch}x{args.seq} per rank, "
          f"{args.steps} timed steps")
    print(f"{'mode':>12} {'step ms':>10} {'comm ms/step':>13} {'final loss':>12}")
    for mode, r in results.items():
        print(f"{mode:>12} {r['step_s'] * 1e3:10.2f} {r['comm_s'] * 1e3:13.2f} {r['final_loss']:12.5f}")
    print("# comm: per bucket, hook call to reduced result, summed over the step's buckets (default: "
          "asynchronous, overlapping backward; pyallreduce: synchronous on CPU, launch only on CUDA)")
    if len(results) == 2:
        a, b = results["default"], results["pyallreduce"]
        print(f"# step time default/pyallreduce: {a['step_s'] / b['step_s']:.2f}x; "
              f"final loss difference {abs(a['final_loss'] - b['final_loss']):.2e}")
    if args.json:
        params = sum(p.numel() for p in TinyLM(args.vocab, args.dim, args.layers, args.heads, args.seq).parameters())
        doc = dict(config={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                   world_size=world, device=str(device), parameters=params,
                   gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                   host=platform.node(), torch=torch.__version__, results=results)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"# wrote {args.json}")


def main():
    args = parse_args()
    if not under_torchrun():
        return spawn_ranks(__file__, args.nproc)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
