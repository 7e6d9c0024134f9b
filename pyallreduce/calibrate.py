"""The two-shot crossover measured on the machine itself, at the first
Communicator of a (device kind, world size) that crossovers.json has no row
for, and kept in the cache file (policy.cache_file()): measured once per
machine, not one machine's crossover applied to every other.

Collective, on an engine of its own (the Communicator's calls, counters and
error messages start untouched): every rank times one-shot and two-shot at
the same sizes, the engine sums the times over the ranks (its result has the
same bits on every rank), and every rank reads the crossover off those same
numbers, so the ranks cannot disagree. The CPU backend only: a GPU's row
comes from bench/compare_nccl.py on that GPU. About 10 ms on an idle 2-core
machine; PYALLREDUCE_CALIBRATE=0 keeps the family's default row instead.
"""
from __future__ import annotations

import math
import os
import time

import torch

from . import _C, logs, policy

ENV = "PYALLREDUCE_CALIBRATE"
SIZES = tuple(1 << s for s in range(10, 21, 2))  # 1 KiB to 1 MiB, by 4x
ROUNDS = 3  # the best of these per size and algorithm: a round the scheduler interrupted does not decide


def wanted(device, backend, crossover):
    """Whether this rank would measure; rank 0's answer decides (group.agree_on_group)."""
    return (device.type == "cpu" and backend == "cpu" and not crossover.measured
            and os.environ.get(ENV, "1") != "0")


def measure(engine_class, group, rank, world_size, device, nblocks, timeout_s, kind, default, round_bytes):
    """Collective: the crossover for this machine (default: the row it
    replaces, whose reference crossover it keeps), timed in the rounds the
    Communicator will run (round_bytes: group.GroupSetup's); rank 0 writes it to the cache file."""
    engine = engine_class(group, rank, device, max(SIZES), nblocks, timeout_s)
    try:
        _C.set_round_bytes(engine.handle, round_bytes)
        def all_reduce_(tensor, kernel):
            if not _C.try_collective_eager(tensor, tensor, engine.handle, kernel, False):
                raise RuntimeError("pyallreduce: the crossover measurement's call was declined")

        best = torch.full((len(SIZES), 2), math.inf)
        for i, nbytes in enumerate(SIZES):
            tensor = torch.zeros(nbytes // 4)  # zeros stay zeros however often summed
            calls = max(4, min(64, (1 << 20) // nbytes))
            for _ in range(ROUNDS):
                for a, kernel in enumerate((_C.ONE_SHOT, _C.TWO_SHOT)):
                    start = time.perf_counter()
                    for _ in range(calls):
                        all_reduce_(tensor, kernel)
                    best[i, a] = min(best[i, a].item(), (time.perf_counter() - start) / calls * 1e6)
        all_reduce_(best, _C.ONE_SHOT)
    except BaseException:
        engine.close(sync=False)  # as after any failed call: the peers may be gone
        raise
    engine.close(sync=True)
    per_size = dict(zip(SIZES, best.tolist()))
    start = policy.winning_tail_start(SIZES, lambda s: per_size[s][0] / per_size[s][1] > policy.TWO_SHOT_MARGIN)
    measured = policy.Crossover(policy.NEVER if start is None else start, default.reference_min_bytes, True)
    if rank == 0:
        ratios = ", ".join(f"{size >> 10} KiB {one / two:.2f}" for size, (one, two) in per_size.items())
        try:
            policy.remember(kind, world_size, measured)
            # Information, not a warning (log_once warns): at INFO, once per kind and world size.
            logs.logger.info("pyallreduce: measured the two-shot crossover on this machine (%s, %d ranks): %s "
                             "(one-shot time / two-shot time: %s); kept in %s", kind, world_size,
                             "never" if start is None else f"{start} bytes", ratios, policy.cache_file())
        except OSError as e:
            logs.log_once(f"could not keep the measured crossover in {policy.cache_file()} ({e}); "
                          f"it will be measured again (set {policy.CACHE_DIR_ENV} to a writable directory)")
    return measured
