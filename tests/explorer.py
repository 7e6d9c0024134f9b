"""A seeded explorer of the lifecycle and threading state space, on the CPU
engine (CudaExplorer, below, on CUDA communicators): random sequences of what users do to communicators and to a
"pyallreduce" process group, in orders nobody wrote a test for, with the
invariants checked after every step.

Every rank draws its steps from random.Random(seed), so all ranks take the
same steps (collective ones pair up); a step's choice of one rank (the one
that aborts) is drawn too. The steps:

  construct      a Communicator in one of two slots, over the gloo world group
                 or the "pyallreduce" group, with a random staging size
  call           an eager all_reduce / all_reduce_ / reduce_scatter /
                 all_gather on a slot: every kernel dtype and the fallback
                 ones (int64: the agreement round, then torch.distributed),
                 sum and avg, sizes from one element to several staging buffers
  backend        a dist.* collective on the "pyallreduce" group: the C++ fast
                 path and the Python path, sync and async; every async Work
                 must keep the Work contract (tests/work_contract.py)
  threads        both slots' communicators used at once by two threads per rank
  close          a slot's communicator closed (collectively)
  close racing   a communicator's close() on the main thread while another
                 thread's call on it runs or is about to: the call ends exact
                 or raises a named error (closed; a peer that closed first
                 never arrived, within the communicator's short deadline),
                 and close() returns after it
  abort          one rank's call waits for peers that never make it, and a
                 watchdog thread aborts it: the call raises a named error, the
                 other ranks abort theirs without it
  regroup        the "pyallreduce" group destroyed and a new one made (its
                 communicators closed first, as a program must)

and, where asked (explore(..., victim=R)), an ending in which rank R is
killed (SIGKILL: no close, no finalizer), in the state the steps left: every
survivor's next call on each communicator it holds, and on the "pyallreduce"
group, raises "rank R's process has exited" within seconds, and it closes
them and leaves nothing mapped.

Invariants: every call returns the exact result (integer-valued inputs) or
the step's expected named error; every thread and Work ends within its bound;
at the end nothing of ours is mapped or left in /dev/shm (the caller checks
the latter). A failure names the seed and the steps that led to it:
`python tests/explorer.py --seed N --steps K --world W [--device cuda]`
replays it.
"""
import argparse
import contextlib
import os
import random
import re
import signal
import threading
import time

import torch
import torch.distributed as dist

import pyallreduce  # registers the "pyallreduce" backend
from reference import exact_input, fp32_reduction
from work_contract import assert_succeeded, observe

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FALLBACK_DTYPES = (torch.int64, torch.float64)
NUMELS = (1, 7, 257, 4099, 70_001)  # 70_001 fp32 elements pass the largest staging size below
MAX_BYTES = (4 << 10, 64 << 10, 256 << 10)
JOIN_S = 60.0  # bound on every thread a step starts; far above any step on a loaded 2-core VM
# A dead peer's pid is checked while a call waits: far sooner than the communicators' 60 s deadline.
DEATH_SEEN_S = 30.0
# The deadline of the communicator whose close races a call: a rank whose peer
# closed before calling waits this long, then raises naming that peer.
RACING_TIMEOUT_S = 3.0
# What a call raises when a close() on another thread ended it or came first.
CLOSED_PATTERN = (r"this communicator is closed|closed or aborted on another thread during this call|"
                      r"was closed \(before this call, or by another thread during it\)")


def expected_reduction(inputs, average):
    """What every rank must get: the product's fp32 rule for kernel dtypes;
    the exact sum (ncclAvg's truncation for integers) for fallback ones."""
    if inputs[0].dtype in KERNEL_DTYPES:
        return fp32_reduction(inputs, average)
    total = sum(inputs[1:], inputs[0].clone())
    if not average:
        return total
    return total.div(len(inputs), rounding_mode="trunc") if not total.dtype.is_floating_point \
        else total / len(inputs)


class Explorer:
    STEP_KINDS = ("construct", "call", "call", "backend", "backend", "threads", "close", "close_racing", "abort",
                  "regroup")

    def __init__(self, rank, world, seed):
        self.rank, self.world, self.rng = rank, world, random.Random(seed)
        self.slots = [None, None]  # Communicators
        self.made = []  # the constructions a step needed first, for its description
        self.group = dist.new_group(backend="pyallreduce")
        self.salt = 0

    # ---- helpers ---------------------------------------------------------------

    def inputs(self, numel, dtype):
        """This rank's input and every rank's (the same salt on every rank)."""
        self.salt += 1
        every = [exact_input(numel, q, dtype, self.salt) for q in range(self.world)]
        return every[self.rank].clone(), every

    def comm(self, slot):
        if self.slots[slot] is None:
            self.made.append(self.construct(slot))
        return self.slots[slot]

    def drawn_call(self, kernels_only=False):
        """(collective, dtype, numel, op, algo), the same on every rank.
        kernels_only: no dtype whose call goes to torch.distributed, which two
        threads may not use at once on one group (its collectives would pair
        across ranks in whichever order the threads came)."""
        rng = self.rng
        collective = rng.choice(("all_reduce", "all_reduce_", "reduce_scatter", "all_gather"))
        dtype = rng.choice(KERNEL_DTYPES + FALLBACK_DTYPES if collective.startswith("all_reduce") and not kernels_only
                           else KERNEL_DTYPES)
        numel = rng.choice(NUMELS) * (self.world if collective == "reduce_scatter" else 1)
        op = "sum" if collective == "all_gather" else rng.choice(("sum", "avg"))
        algo = rng.choice(("auto", "one_shot", "two_shot"))
        return collective, dtype, numel, op, algo

    def run_call(self, comm, drawn):
        collective, dtype, numel, op, algo = drawn
        x, every = self.inputs(numel, dtype)
        x = x.to(comm.device)
        if collective == "all_gather":
            got, want = comm.all_gather(x), torch.cat(every)
        elif collective == "reduce_scatter":
            seg = numel // self.world
            got = comm.reduce_scatter(x, op=op)
            want = expected_reduction(every, op == "avg")[self.rank * seg:(self.rank + 1) * seg]
        elif collective == "all_reduce_":
            comm.all_reduce_(x, op=op, algo=algo)
            got, want = x, expected_reduction(every, op == "avg")
        else:
            got, want = comm.all_reduce(x, op=op, algo=algo), expected_reduction(every, op == "avg")
        got = got.cpu()
        assert got.dtype == want.dtype and torch.equal(got, want), \
            f"{drawn}: wrong result, first differences at {(got != want).nonzero()[:5].flatten().tolist()}"

    def joined(self, threads, errors=()):
        """Waits for `threads`; a thread's error (collected in `errors`) is the
        one to report, before a peer thread that waited for it in vain."""
        for t in threads:
            t.join(JOIN_S)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads), f"a thread did not end within {JOIN_S:.0f} s"

    # ---- steps -------------------------------------------------------------------

    def construct(self, slot=None):
        slot = self.rng.randrange(2) if slot is None else slot
        on_backend_group = self.rng.random() < 0.5
        max_bytes = self.rng.choice(MAX_BYTES)
        self.close(slot)
        self.slots[slot] = pyallreduce.Communicator(self.group if on_backend_group else None, device="cpu",
                                                    max_bytes=max_bytes, timeout=60)
        return f"construct slot {slot} on the {'pyallreduce' if on_backend_group else 'gloo'} group, " \
               f"max_bytes {max_bytes}"

    def call(self):
        slot, drawn = self.rng.randrange(2), self.drawn_call()
        self.run_call(self.comm(slot), drawn)
        return f"call {drawn} on slot {slot}"

    def backend(self):
        rng = self.rng
        kind = rng.choice(("all_reduce", "all_reduce strided", "all_gather list", "reduce_scatter_tensor",
                           "all_gather_into_tensor", "broadcast"))
        dtype = rng.choice(KERNEL_DTYPES + (torch.int64,))
        numel = rng.choice(NUMELS[:4]) * self.world
        async_op = rng.random() < 0.5
        x, every = self.inputs(numel, dtype)
        outputs, want, work = self.issue_backend(kind, x, every, async_op)
        what = f"backend {kind} {dtype} x{numel}{' async' if async_op else ''}"
        self.check_backend(what, work, outputs, want, async_op, contract=kind != "broadcast")  # gloo's own Work
        return what

    def issue_backend(self, kind, x, every, async_op):
        """Collective `kind` on the pyallreduce group, this rank's input x
        (every rank's: every): (its outputs, the results due in them, its Work)."""
        g, numel, dtype = self.group, x.numel(), x.dtype
        if kind in ("all_reduce", "all_reduce avg"):
            avg = kind == "all_reduce avg"
            op = dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM
            return [x], [expected_reduction(every, avg)], dist.all_reduce(x, op=op, group=g, async_op=async_op)
        if kind == "all_reduce strided":
            x = x.view(self.world, -1).t()  # not contiguous: the Python path
            want = [expected_reduction([e.view(self.world, -1).t() for e in every], False)]
            return [x], want, dist.all_reduce(x, group=g, async_op=async_op)
        if kind == "all_gather list":
            outputs = [torch.empty_like(x) for _ in range(self.world)]
            return outputs, every, dist.all_gather(outputs, x, group=g, async_op=async_op)
        if kind == "reduce_scatter_tensor":
            seg = numel // self.world
            outputs = [torch.empty(seg, dtype=dtype, device=x.device)]
            want = [expected_reduction(every, False)[self.rank * seg:(self.rank + 1) * seg]]
            return outputs, want, dist.reduce_scatter_tensor(outputs[0], x, group=g, async_op=async_op)
        if kind == "all_gather_into_tensor":
            outputs = [torch.empty(numel * self.world, dtype=dtype, device=x.device)]
            return outputs, [torch.cat(every)], dist.all_gather_into_tensor(outputs[0], x, group=g, async_op=async_op)
        assert kind == "broadcast", kind
        return [x], [every[0]], dist.broadcast(x, 0, group=g, async_op=async_op)

    @staticmethod
    def check_backend(what, work, outputs, want, async_op, contract=True):
        """An async Work answers as the Work contract says (contract: one of
        ours), then every output holds its result."""
        if async_op and contract:
            assert_succeeded(observe(work, what), want, what)
        elif async_op:
            work.wait()
        for got, w in zip(outputs, want, strict=True):
            assert torch.equal(got.cpu(), w), f"{what}: wrong result"

    def threads(self):
        drawn = [[self.drawn_call(kernels_only=True) for _ in range(self.rng.randint(1, 4))] for _ in range(2)]
        comms = [self.comm(0), self.comm(1)]
        if comms[0] is not self.slots[0]:  # making slot 1 took slot 0's GPUs (CudaExplorer): one thread
            comms, drawn = comms[1:], drawn[1:]
        saved_salt, errors = self.salt, []

        def run(slot):
            try:
                worker = Explorer.__new__(Explorer)  # its own salts: both threads draw the same inputs
                worker.rank, worker.world, worker.salt = self.rank, self.world, saved_salt + 1000 * (slot + 1)
                with self.thread_stream(comms[slot]):
                    for d in drawn[slot]:
                        worker.run_call(comms[slot], d)
            except BaseException as e:  # noqa: BLE001  (reported below, with the step)
                import traceback; errors.append(f"slot {slot}: {e!r}" + traceback.format_exc())

        threads = [threading.Thread(target=run, args=(s,)) for s in range(len(comms))]
        for t in threads:
            t.start()
        self.joined(threads, errors)
        return f"threads {drawn}"

    def thread_stream(self, comm):
        """Where a thread of the threads step enqueues its calls: nothing on CPU."""
        return contextlib.nullcontext()

    def close(self, slot=None):
        slot = self.rng.randrange(2) if slot is None else slot
        if self.slots[slot] is not None:
            self.slots[slot].close()
            self.slots[slot] = None
        return f"close slot {slot}"

    def close_racing(self):
        numel, delay = self.rng.choice(NUMELS), self.rng.choice((0.0, 0.0005, 0.005, 0.05))
        comm = pyallreduce.Communicator(device="cpu", max_bytes=4 << 10, timeout=RACING_TIMEOUT_S)
        x, every = self.inputs(numel, torch.float32)
        out = torch.full_like(x, float("nan"))
        (how, value), out_when_closed = self.race_close(comm, delay, lambda: comm.all_reduce(x, out=out),
                                                        when_closed=out.clone)
        if how == "returned":  # then close() waited for it: its out was written before close() returned
            assert torch.equal(out, expected_reduction(every, False)), "close racing a call: wrong result"
            assert torch.equal(out_when_closed, out), "close() returned before the call on another thread ended"
        else:
            assert re.search(CLOSED_PATTERN + r"|rank\(s\) \d.* never arrived", value), \
                f"close racing a call raised: {value}"
        dist.barrier()  # every rank is past its peers' short deadlines before the next step
        return f"close racing a call of {numel} after {delay * 1e3:g} ms"  # its end may differ between ranks

    def race_close(self, comm, delay, call, when_closed=lambda: None):
        """call() on another thread, comm.close() on this one `delay` seconds
        after it starts: (("returned", None) or ("raised", its message), what
        when_closed() gave right after close() returned)."""
        ended = []

        def run():
            try:
                call()
                ended.append(("returned", None))
            except RuntimeError as e:
                ended.append(("raised", str(e)))

        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(delay)
        comm.close()
        seen = when_closed()
        self.joined([thread])
        return ended[0], seen

    def abort(self):
        slot, victim = self.rng.randrange(2), self.rng.randrange(self.world)
        comm = self.comm(slot)
        if self.rank == victim:
            raised = []

            def waiting_call():
                try:
                    comm.all_reduce(torch.ones(64))
                except RuntimeError as e:
                    raised.append(str(e))

            call = threading.Thread(target=waiting_call)
            call.start()
            time.sleep(0.3)
            comm.abort()
            self.joined([call])
            assert raised and re.search(r"aborted", raised[0]), f"the waiting call ended with {raised}"
        else:
            comm.abort()  # without the peers: none of them calls
        self.slots[slot] = None
        dist.barrier()  # the gloo world group: every rank has left the aborted communicator
        return f"abort slot {slot}, rank {victim}'s call waiting"

    def regroup(self):
        for slot, comm in enumerate(self.slots):
            if comm is not None and comm.group is self.group:
                self.close(slot)
        dist.destroy_process_group(self.group)
        self.group = dist.new_group(backend="pyallreduce")
        return "regroup"

    def end(self):
        for slot in (0, 1):
            self.close(slot)
        dist.destroy_process_group(self.group)

    def die(self, victim):
        """The victim is killed; each survivor's calls raise that it exited."""
        if self.rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        dead = rf"rank {victim}'s process has exited"
        calls = [(f"slot {slot}", dead, lambda comm=comm: comm.all_reduce(torch.ones(64)))
                 for slot, comm in enumerate(self.slots) if comm is not None]
        # The group's first call on a device makes its communicator over the
        # inner gloo group: then gloo's own error, which names the cause too.
        calls.append(("the pyallreduce group", rf"{dead}|gloo.*Connection (closed|reset) by peer.*remote worker",
                      lambda: dist.all_reduce(torch.ones(64), group=self.group)))
        for what, expected, call in calls:
            start = time.monotonic()
            try:
                call()
                raise AssertionError(f"a call on {what} returned although rank {victim} is dead")
            except RuntimeError as e:
                assert re.search(expected, str(e)), f"a call on {what}: {expected!r} not in: {e}"
            took = time.monotonic() - start
            assert took < DEATH_SEEN_S, f"a call on {what} took {took:.0f} s to see that rank {victim} died"
        self.end()
        return f"rank {victim} killed; {len(calls)} calls raised"


def explore(rank, world, seed, steps, device_type="cpu", victim=None):
    """Runs `steps` random steps of `seed`, then ends (victim: killing that
    rank); returns the steps taken (a survivor's, where one was killed)."""
    from launch import own_segments_mapped

    explorer, taken = (CudaExplorer if device_type == "cuda" else Explorer)(rank, world, seed), []
    try:
        for _ in range(steps):
            kind = explorer.rng.choice(explorer.STEP_KINDS)
            taken.append(kind)
            explorer.made.clear()
            done = getattr(explorer, kind)()
            taken[-1] = "; ".join([*explorer.made, done])
        if victim is not None:
            taken.append(f"kill rank {victim}")
            taken[-1] = explorer.die(victim)
        else:
            explorer.end()
            taken.append("end")
        mapped = own_segments_mapped()
        assert not mapped, f"still mapped after every communicator closed: {mapped}"
    except BaseException as e:
        history = "\n".join(f"  {i}: {s}" for i, s in enumerate(taken))
        raise AssertionError(f"explorer seed {seed} (world {world}) failed at step {len(taken) - 1}: {e!r}\n"
                             f"steps:\n{history}\nreplay: python tests/explorer.py --seed {seed} "
                             f"--steps {steps} --world {world} --device {device_type}"
                             f"{'' if victim is None else f' --kill {victim}'}") from e
    return taken


if __name__ == "__main__":
    from launch import run_ranks

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--kill", type=int, default=None, metavar="RANK", help="end by killing this rank")
    args = p.parse_args()
    survivor = 1 if args.kill == 0 else 0
    for step in run_ranks(explore, args.world, args.seed, args.steps, args.device, args.kill, timeout=600,
                          expect_exit={} if args.kill is None else {args.kill: -signal.SIGKILL})[survivor]:
        print(step)


class CudaExplorer(Explorer):
    """The explorer on CUDA communicators (`--device cuda`; in CI on the
    emulated CUDA runtime, whose two devices let ranks pick different GPUs
    and change them between communicators: tests/test_explorer.py). With
    kernel dtypes only (torch's own CUDA kernels do not run there), and the
    torch.distributed backend's steps only for what it serves (its CUDA inner
    backend is NCCL, which the emulation lacks); with registered buffers,
    graph capture and replay, calls beside another thread's capture, a close
    racing another thread's call, and an ending in a killed rank."""

    STEP_KINDS = ("construct", "call", "call", "register", "capture", "beside_capture", "threads", "close",
                  "close_racing", "abort", "backend", "regroup")
    # Not 4 KiB: a CUDA reduce-scatter's segments need more staging, or it goes to
    # torch.distributed, whose own CUDA kernels the emulation does not run.
    MAX_BYTES = MAX_BYTES[1:]

    def __init__(self, rank, world, seed):
        self.rank, self.world, self.rng = rank, world, random.Random(seed)
        self.slots, self.made, self.salt, self.group = [None, None], [], 0, None
        # CUDA lets one device per process open a given peer GPU's IPC handles
        # (cudaIpcOpenMemHandle), for the life of the process here (the
        # emulation's reading): per rank, (peer, its GPU) -> the GPU that did.
        self.importing = [{} for _ in range(world)]
        self.home = None  # the GPUs of the first construction that served
        self.kept_mapped = False  # an abort after captures kept its mappings (until the process exits)
        self.group_served = False  # the pyallreduce group has made its communicator (on the home GPUs)

    def drawn_call(self, kernels_only=True):
        """Kernel dtypes only, and no reduce-scatter or all-gather past one
        run of the staging buffer: its pieces are put together by a strided
        torch copy, which the emulation does not run."""
        collective, dtype, numel, op, algo = super().drawn_call(kernels_only=True)
        if collective in ("reduce_scatter", "all_gather"):
            # Every rank's segment, in fp32, within the smallest staging buffer.
            segment = max(n for n in NUMELS if n * self.world * 4 <= self.MAX_BYTES[0])
            numel = min(numel, segment * (self.world if collective == "reduce_scatter" else 1))
        return collective, dtype, numel, op, algo

    def construct(self, slot=None, timeout=60):
        import pyallreduce

        slot = self.rng.randrange(2) if slot is None else slot
        self.close(slot)
        for tries in range(100):  # until the GPUs drawn can all import from each other (below)
            if tries == 20 and self.slots[1 - slot] is not None:
                # The other slot's communicator may hold the only GPUs whose
                # imports CUDA still allows, or the blocks: as a user would, close it.
                self.made.append(self.close(1 - slot))
            if tries == 30 and self.group is not None:
                # So may the pyallreduce group's communicator: destroy the group.
                self.made.append(self.end_group())
            devices = [self.rng.randrange(torch.cuda.device_count()) for _ in range(self.world)]
            if tries >= 40 and self.home is not None:
                # At 4 ranks on two GPUs few draws stay that the imports allow:
                # the GPUs of the first construction always do.
                devices = self.home
            max_bytes = self.rng.choice(self.MAX_BYTES)
            refused, opened = self.imports(devices)
            try:
                comm = pyallreduce.Communicator(device=torch.device("cuda", devices[self.rank]), backend="cuda",
                                                max_bytes=max_bytes, timeout=timeout, nblocks=4)
            except ValueError as e:
                # Ranks sharing a GPU whose blocks the live communicators hold:
                # refused on every rank, before any probe (the emulated GPU holds 8).
                assert re.search(r"share GPU .* holds only \d+ blocks", str(e)), e
                self.made.append(f"construct on GPUs {devices}: refused, the GPU's blocks are taken")
                continue
            for r, peer_gpu, gpu in opened:
                self.importing[r][peer_gpu] = gpu
            if not refused:
                assert comm.fallback_reason is None, comm.fallback_reason
                self.home = self.home or devices
                self.slots[slot] = comm
                return f"construct slot {slot} on GPUs {devices}, max_bytes {max_bytes}"
            # A rank's GPU may not import a peer GPU's handles that another GPU
            # of the same process imported: every rank falls back, saying so.
            assert comm.fallback_reason is not None and "open them on another of its GPUs" in \
                comm.fallback_reason, f"GPUs {devices}: {comm.fallback_reason}"
            comm.close()
            self.made.append(f"construct on GPUs {devices}: falls back (rank {refused[0]} imported GPU "
                             f"{refused[1]}'s handles on another of its GPUs)")
        raise AssertionError(f"no GPUs drawn in 100 tries could serve: the last tries {self.made[-4:]}")

    def imports(self, devices):
        """What the topology probe of ranks on `devices` will open: (None, or
        (rank, peer GPU) of the first rank whose GPU may not open a peer's
        handles; the opens that succeed, to record once the probe ran), in
        the order it opens (peers by rank, a rank stopping at its first
        refusal)."""
        refused, opened = None, []
        for r in range(self.world):
            for q in range(self.world):
                if q == r:
                    continue
                if self.importing[r].get((q, devices[q]), devices[r]) != devices[r]:
                    refused = refused or (r, devices[q])
                    break
                opened.append((r, (q, devices[q]), devices[r]))
        return refused, opened

    def thread_stream(self, comm):
        """A stream of its own, as threads calling collectives at once must
        have (README): on one stream the kernels would run in the order the
        threads came, which differs between ranks, each waiting for a peer
        kernel queued behind the other until the deadline, as NCCL's would."""
        return torch.cuda.stream(torch.cuda.Stream(comm.device))

    def register(self):
        slot, numel, calls = self.rng.randrange(2), self.rng.choice(NUMELS), self.rng.randint(1, 3)
        comm = self.comm(slot)
        buf = torch.empty(numel, device=comm.device)
        comm.register(buf)
        for _ in range(calls):
            x, every = self.inputs(numel, torch.float32)
            buf.copy_(x)
            comm.all_reduce_(buf)
            assert torch.equal(buf.cpu(), expected_reduction(every, False)), "registered in place: wrong result"
        comm.unregister(buf)
        return f"register a buffer of {numel} on slot {slot}, {calls} calls"

    def capture(self):
        slot, (_, dtype, numel, op, algo), replays = self.rng.randrange(2), self.drawn_call(), self.rng.randint(1, 3)
        comm = self.comm(slot)
        x, _ = self.inputs(numel, dtype)
        static = x.to(comm.device)
        comm.all_reduce(static)  # warm-up outside the capture
        torch.cuda.synchronize(comm.device)
        graph = torch.cuda.CUDAGraph()
        # A capture stream of the communicator's GPU: torch.cuda.graph's default one is
        # made once per process, on whichever GPU was current at its first capture.
        with torch.cuda.device(comm.device), comm.capture():
            with torch.cuda.graph(graph, stream=torch.cuda.Stream(comm.device)):
                out = comm.all_reduce(static, op=op, algo=algo)
        for _ in range(replays):
            x, every = self.inputs(numel, dtype)
            static.copy_(x)
            with torch.cuda.device(comm.device):
                graph.replay()
            torch.cuda.synchronize(comm.device)
            assert torch.equal(out.cpu(), expected_reduction(every, op == "avg")), \
                f"replay of {dtype} x{numel} {op} {algo}: wrong result"
        return f"capture {dtype} x{numel} {op} {algo} on slot {slot}, {replays} replays"

    def close_racing(self):
        """A slot's close() racing a call of another thread on it. The call
        raises that the communicator closed, or it launched its kernel before
        close() sealed the communicator; then close() waits for that kernel
        before it frees what the kernel uses (the status record, the peers'
        mappings): on every rank whose call launched, a result exact where
        every rank's did. A kernel whose peer closed first gives up at the
        short deadline, and close() drops what it recorded: comm.check()
        before close() is how a program learns of it (README)."""
        slot, numel = self.rng.randrange(2), self.rng.choice(NUMELS)
        delay = self.rng.choice((0.0, 0.0005, 0.005, 0.05))
        self.made.append(self.construct(slot, timeout=RACING_TIMEOUT_S))
        comm = self.slots[slot]
        x, every = self.inputs(numel, torch.float32)
        # Copies, not torch kernels: the emulation runs none.
        x, out = x.to(comm.device), torch.full_like(x, float("nan")).to(comm.device)

        def call():
            with self.thread_stream(comm):
                comm.all_reduce(x, out=out)  # returns once its kernel is launched

        (how, value), _ = self.race_close(comm, delay, call)
        self.slots[slot] = None
        if how == "raised":
            assert re.search(CLOSED_PATTERN, value), f"close racing a call raised: {value}"
        everyone = [None] * self.world
        dist.all_gather_object(everyone, how)
        if all(h == "returned" for h in everyone):  # close() returned after the kernels: out is final
            assert torch.equal(out.cpu(), expected_reduction(every, False)), "close racing a call: wrong result"
        return f"close racing a call of {numel} on slot {slot} after {delay * 1e3:g} ms"  # ends may differ

    def beside_capture(self):
        """In-place calls and a check() on a slot while another thread of every
        rank captures a CUDA graph in global mode: none of our calls may be one
        that global mode prohibits (it would invalidate that capture), in
        whatever state the steps left the communicator (its first call, after
        captures, registrations or another slot's abort). The tensors are made
        and read outside: torch's own allocations and copies would be such calls."""
        from other_capture import another_threads_capture

        slot, calls = self.rng.randrange(2), self.rng.randint(1, 3)
        comm = self.comm(slot)
        drawn = [self.drawn_call() for _ in range(calls)]
        inputs = [self.inputs(numel, dtype) for _, dtype, numel, _, _ in drawn]
        on_gpu = [x.to(comm.device) for x, _ in inputs]
        torch.cuda.synchronize(comm.device)
        with another_threads_capture(JOIN_S, comm.device) as errors:
            for x, (_, _, _, op, algo) in zip(on_gpu, drawn):
                comm.all_reduce_(x, op=op, algo=algo)
            comm.check()
        assert not errors, f"the other thread's capture failed: {errors[0]!r}"
        for x, (_, every), (_, _, _, op, _) in zip(on_gpu, inputs, drawn):
            assert torch.equal(x.cpu(), expected_reduction(every, op == "avg")), "beside a capture: wrong result"
        return f"beside another thread's capture, {[d[1:] for d in drawn]} in place on slot {slot}"

    def abort(self):
        """A CUDA call returns once its kernel is launched: the victim's kernel
        waits on the device for peers that never launch, and the abort ends
        that wait (abort() returns once it did)."""
        slot, victim = self.rng.randrange(2), self.rng.randrange(self.world)
        comm = self.comm(slot)
        if self.rank == victim:
            comm.all_reduce(torch.ones(64).to(comm.device))
            time.sleep(0.3)
        engine = comm._engine
        comm.abort()
        # After captures an abort keeps what a replay may use, peer mappings
        # included, until the process exits (CudaEngine.close): it says so.
        self.kept_mapped |= bool(engine._captured)
        self.slots[slot] = None
        dist.barrier()
        return f"abort slot {slot}, rank {victim}'s kernel waiting"

    def backend(self):
        """dist.* collectives on CUDA tensors on a "pyallreduce" group (made
        at its first step), on this rank's GPU of the first construction that
        served: those it serves, sync and async (each async Work checked
        against the Work contract). Not those it leaves to its inner NCCL
        backend, which the emulation lacks, nor non-contiguous inputs (their
        strided copies are torch kernels, which it does not run either)."""
        rng = self.rng
        if self.home is None:
            self.made.append(self.construct())
        if self.group is None:
            self.group, self.group_served = dist.new_group(backend="pyallreduce"), False
            self.made.append("new pyallreduce group")
        device = torch.device("cuda", self.home[self.rank])
        kind = rng.choice(("all_reduce", "all_reduce avg", "all_gather list", "reduce_scatter_tensor",
                           "all_gather_into_tensor"))
        dtype, numel = rng.choice(KERNEL_DTYPES), rng.choice(NUMELS[:4]) * self.world
        # The group's first call makes its communicator; a refusal (below) comes
        # out of a synchronous call, where an async one would hand it to its Work.
        async_op = rng.random() < 0.5 and self.group_served
        x, every = self.inputs(numel, dtype)
        x = x.to(device)
        try:
            outputs, want, work = self.issue_backend(kind, x.clone(), every, async_op)
        except ValueError as e:
            # The group's first call on the GPU makes its communicator, which the
            # slots' communicators may leave no blocks: refused on every rank
            # (as a construction is); as a user would, close them and call again.
            assert re.search(r"share GPU .* holds only \d+ blocks", str(e)), e
            self.made.append(f"backend {kind}: refused, the GPU's blocks are taken; "
                             f"{self.close(0)}; {self.close(1)}")
            outputs, want, work = self.issue_backend(kind, x.clone(), every, async_op)
        self.group_served = True
        what = f"backend {kind} {dtype} x{numel} on GPUs {self.home}{' async' if async_op else ''}"
        torch.cuda.synchronize(device)
        self.check_backend(what, work, outputs, want, async_op)
        return what

    def end_group(self):
        """destroy_process_group of the pyallreduce group: it closes its CUDA
        communicator, collectively."""
        dist.destroy_process_group(self.group)
        self.group = None
        return "destroy the pyallreduce group"

    def regroup(self):
        if self.group is None:
            return "regroup: no pyallreduce group"
        return self.end_group() + "; the next backend step makes a new one"

    def die(self, victim):
        """The victim is killed. A kernel cannot see a process exit: each
        survivor's call on each open slot launches, and its kernel waits on
        the device for the victim, as an NCCL kernel would. A program learns
        of it by waiting (comm.check()) and ends the wait with abort() from a
        watchdog, as with ncclCommAbort: the wait raises that the
        communicator was aborted, within the watchdog's bound, and the
        abort frees what it may (end(): nothing stays mapped where no
        kernel was captured)."""
        from launch import raises_when_a_watchdog_aborts

        if self.rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        open_slots = [slot for slot, comm in enumerate(self.slots) if comm is not None]
        for slot in open_slots:
            comm = self.slots[slot]
            engine = comm._engine
            comm.all_reduce_(torch.ones(64).to(comm.device))
            raises_when_a_watchdog_aborts(comm, comm.check, r"aborted", after_s=1.0, bound_s=DEATH_SEEN_S)
            self.kept_mapped |= bool(engine._captured)
            self.slots[slot] = None
        self.end()
        return f"rank {victim} killed; {len(open_slots)} slots' waits ended by abort()"

    def end(self):
        for slot in (0, 1):
            self.close(slot)
        if self.group is not None:
            self.end_group()
        if torch.cuda.get_device_name(0).startswith("Emulated"):  # counts the IPC handles still open
            import ctypes

            mapped = ctypes.CDLL(None).pyallreduce_emulated_peer_mappings()
            assert mapped == 0 or self.kept_mapped, \
                f"{mapped} peer allocations still mapped after every communicator closed"
