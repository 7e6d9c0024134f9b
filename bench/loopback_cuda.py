"""Memory efficiency of the CUDA kernels, with W ranks inside ONE process on one GPU.

Every rank gets its own region (allocated with the CUDA transport's binding),
its own Context over all W regions (peer pointers into this process's own
memory) and its own stream; each rank launches few enough blocks that all W
grids are resident at once, which the barriers between them need. All traffic
then stays in this GPU's memory, so the kernels' bytes moved per second are
compared with a device-to-device copy measured in the same run: how close the
kernels come to the memory system's copy rate, apart from NVLink.

    python bench/loopback_cuda.py --world-sizes 2,4,8 --sizes 256,4K,64K,1M,16M --dtype bfloat16

Every size is timed twice: "graph", --iters calls captured in one CUDA graph and
replayed (what a captured decode step pays), and "eager", the same calls
launched one by one from Python (launch latency included). Beside them, per
world size, the floors of a small call in the same run: an empty kernel launch
(eager, and replayed in a graph) and a 16-byte all-reduce (one start barrier
and one 16-byte read of every peer: a flag round trip between the ranks'
kernels, and the least any all-reduce can take).

On the emulated CUDA runtime (tests/emulated) the script runs the same code
path for correctness (inputs are made on the host, results checked there) and
prints its times labelled as host threads', not a GPU's; the empty kernel (a
torch kernel, which the emulation does not run), the copy rate and the graph
mode (the emulation captures no graph forked across streams) are skipped.

Bytes moved per call (all W ranks, reads + writes, staged path):
  one-shot  W * (W + 3) * S   (copy-in S read + S written, W*S read, S written)
  two-shot  W * 5 * S         (copy-in 2S, reduce-scatter S + 2S/W, gather 2(W-1)S/W)
Small sizes partly hit L2, so their rate can exceed the copy's.
"""
import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ALGOS = ("one_shot", "two_shot")
COPY_BYTES = 256 << 20  # large enough to stream from HBM, not L2


def parse_bytes(text):
    text = text.strip().upper().removesuffix("B")
    scale = SUFFIXES.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in SUFFIXES else text) * scale)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", default="2,4,8", help="comma-separated rank counts (default 2,4,8)")
    p.add_argument("--sizes", default="256,4K,64K,256K,1M,4M,16M,32M",
                   help="bytes per rank per call, comma-separated, K/M/G suffixes")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--algos", default=",".join(ALGOS), help="one_shot,two_shot")
    p.add_argument("--nblocks", type=int, default=None,
                   help="blocks per rank (default: SMs // world size, at most MAX_BLOCKS)")
    p.add_argument("--iters", type=int, default=20, help="calls per captured graph (default 20)")
    p.add_argument("--reps", type=int, default=10, help="timed graph replays (default 10)")
    p.add_argument("--timeout", type=float, default=30.0, help="kernel deadline in seconds")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"), help="folder for the JSON")
    args = p.parse_args(argv)
    args.world_sizes = [int(w) for w in args.world_sizes.split(",")]
    args.sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    args.algos = [a for a in args.algos.split(",") if a]
    bad = [a for a in args.algos if a not in ALGOS]
    if bad:
        p.error(f"unknown algorithm(s) {bad}; choose from {ALGOS}")
    return args


def bytes_moved(algo, world, nbytes):
    per_rank = (world + 3) * nbytes if algo == "one_shot" else 5 * nbytes
    return world * per_rank


def emulated():
    return torch.cuda.get_device_name(0).startswith("Emulated")


def timed_eager(launch, iters, reps):
    """Seconds per launch() call: `iters` calls launched one by one, `reps` times."""
    launch()  # warm-up
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps * iters):
        launch()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (reps * iters)


def timed_graph(launch, iters, reps):
    """Seconds per launch() call: `iters` calls captured in one graph, replayed."""
    launch()  # warm-up, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            launch()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    del graph
    return start.elapsed_time(end) / 1e3 / (reps * iters)


def copy_rate(device, iters, reps):
    """Bytes read + written per second by a device-to-device copy of COPY_BYTES."""
    src = torch.randint(0, 256, (COPY_BYTES,), dtype=torch.uint8).to(device)
    dst = torch.empty_like(src)
    seconds = timed_graph(lambda: dst.copy_(src), iters, reps)
    return 2 * COPY_BYTES / seconds


class LoopbackGroup:
    """W ranks of one process: regions, contexts and streams."""

    def __init__(self, _C, world, max_bytes, nblocks, timeout, device):
        self._C, self.device = _C, device
        self.regions, self.handles = [], []
        try:
            for _ in range(world):
                self.regions.append(_C.cuda_alloc_region(device, _C.region_bytes(max_bytes)))
            for r in range(world):
                self.handles.append(_C.create_context(self.regions, r, max_bytes, nblocks, timeout, device, []))
                _C.cuda_prepare(self.handles[-1])
        except BaseException:
            self.close()
            raise
        self.streams = [torch.cuda.Stream(device) for _ in range(world)]

    def launcher(self, inputs, outs, algo_id):
        """All W ranks' calls, each on its own stream, forked from and joined
        to the current stream (so a graph capture sees one fork/join)."""
        def launch():
            main = torch.cuda.current_stream()
            for r, stream in enumerate(self.streams):
                stream.wait_stream(main)
                with torch.cuda.stream(stream):
                    torch.ops.pyallreduce.all_reduce_out(inputs[r], outs[r], self.handles[r], algo_id, False)
            for stream in self.streams:
                main.wait_stream(stream)
        return launch

    def close(self):
        torch.cuda.synchronize(self.device)
        for h in self.handles:
            self._C.destroy_context(h)
        for addr in self.regions:
            self._C.cuda_free_region(self.device, addr)
        self.handles, self.regions = [], []


FLOOR_BYTES = 16  # the floor's all-reduce: one start barrier and one 16-byte read of every peer


def run(args):
    import pyallreduce  # noqa: F401  (registers torch.ops.pyallreduce)
    from pyallreduce import _C

    if not _C.WITH_CUDA:
        print("skipped: pyallreduce was built without its CUDA kernels", file=sys.stderr)
        return 0
    torch.cuda.set_device(args.device)
    device = torch.device("cuda", args.device)
    props = torch.cuda.get_device_properties(args.device)
    on_emulation = emulated()
    dtype = DTYPES[args.dtype]
    elem = torch.empty((), dtype=dtype).element_size()
    max_bytes = -(-max(args.sizes) // _C.ALIGNMENT) * _C.ALIGNMENT
    algo_ids = {"one_shot": _C.ONE_SHOT, "two_shot": _C.TWO_SHOT}
    timers = {"graph": timed_graph, "eager": timed_eager}
    if on_emulation:
        # The emulation captures no graph forked across streams (the launcher's fork and join).
        timers = {"eager": timed_eager}
        print("# EMULATED CUDA runtime (tests/emulated): the code path checked for correctness; the times are host "
              "threads', not a GPU's; eager calls only (no capture forked across streams there), no empty-kernel "
              "floor and no copy rate (torch kernels do not run there)")
    copy = None if on_emulation else copy_rate(args.device, args.iters, args.reps)
    print(f"# {props.name}, {props.multi_processor_count} SMs, dtype {args.dtype}; device-to-device copy: "
          + (f"{copy / 1e9:.1f} GB/s (read + write)" if copy else "not measured"))
    floors = {}
    if not on_emulation:
        for mode, timer in timers.items():
            floors[f"empty kernel, {mode}"] = timer(lambda: torch.cuda._sleep(0), args.iters, args.reps) * 1e6
    header = (f"{'W':>2} {'blocks':>6} {'bytes':>10} {'algo':>8} {'mode':>6} {'time_us':>9} {'algbw':>7} "
              f"{'busbw':>7} {'moved GB/s':>10} {'of copy':>7} {'#wrong':>6}")
    rows = []
    for world in args.world_sizes:
        if not 1 <= world <= _C.MAX_RANKS:
            print(f"skipping world size {world}: outside 1..{_C.MAX_RANKS}", file=sys.stderr)
            continue
        nblocks = args.nblocks or max(1, min(_C.MAX_BLOCKS, props.multi_processor_count // world))
        group = LoopbackGroup(_C, world, max_bytes, nblocks, args.timeout, args.device)
        floor_text = ", ".join(f"{name} {us:.2f} us" for name, us in floors.items()) or "no empty-kernel floor here"
        print(f"# W={world}: {floor_text}; the {FLOOR_BYTES}-byte rows are the flag round trip's floor")
        print(header)
        try:
            for nbytes in [FLOOR_BYTES, *args.sizes]:
                numel = max(1, nbytes // elem)
                # Small integers: every sum over <= 8 ranks is exact in every dtype. Made and
                # checked on the host (the emulated runtime runs no torch kernel).
                host = [((torch.arange(numel) * 7 + r * 5) % 9 - 4).to(dtype) for r in range(world)]
                want = sum(x.double() for x in host).to(dtype)
                inputs = [x.to(device) for x in host]
                algos = ["one_shot"] if nbytes == FLOOR_BYTES else args.algos
                for algo in algos:
                    for mode, timer in timers.items():
                        outs = [torch.full((numel,), 123, dtype=dtype).to(device) for _ in range(world)]
                        seconds = timer(group.launcher(inputs, outs, algo_ids[algo]), args.iters, args.reps)
                        wrong = sum(int((o.cpu() != want).sum().item()) for o in outs)
                        moved = bytes_moved(algo, world, numel * elem) / seconds
                        algbw = numel * elem / seconds
                        row = dict(world_size=world, nblocks=nblocks, bytes=numel * elem, dtype=args.dtype,
                                   algo=algo, mode=mode, floor=nbytes == FLOOR_BYTES, time_us=seconds * 1e6,
                                   algbw_GBps=algbw / 1e9, busbw_GBps=algbw * 2 * (world - 1) / world / 1e9,
                                   moved_GBps=moved / 1e9, fraction_of_copy=moved / copy if copy else None,
                                   wrong=wrong)
                        rows.append(row)
                        of_copy = f"{row['fraction_of_copy']:>7.1%}" if copy else f"{'':>7}"
                        print(f"{world:>2} {nblocks:>6} {row['bytes']:>10} {algo:>8} {mode:>6} "
                              f"{row['time_us']:>9.2f} {row['algbw_GBps']:>7.1f} {row['busbw_GBps']:>7.1f} "
                              f"{row['moved_GBps']:>10.1f} {of_copy} {wrong:>6}")
        finally:
            group.close()

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"loopback_cuda-{props.name.replace(' ', '_')}-{stamp}.json"
    path.write_text(json.dumps(dict(
        benchmark="loopback_cuda", device=props.name, sms=props.multi_processor_count, emulated=on_emulation,
        torch=torch.__version__, cuda=torch.version.cuda, host=platform.node(),
        copy_GBps=copy / 1e9 if copy else None, floors_us=floors, iters=args.iters, reps=args.reps, rows=rows),
        indent=2))
    print(f"# wrote {path}")
    return 1 if any(r["wrong"] for r in rows) else 0


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("skipped: no CUDA device", file=sys.stderr)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
