"""pyallreduce.policy's decisions: the grid size bound for ranks sharing a GPU
(issue: MPS, several ranks per GPU), and the crossover row a machine gets:
its kind's own, else one measured on it at first use and cached, never
another machine's counted as measured."""
import json
import os

import pytest
import torch

from launch import run_ranks
from pyallreduce import policy
from pyallreduce.policy import resident_nblocks
from reference import triton_kernels_unusable

pytestmark = pytest.mark.quick

H100 = 132  # SMs; the kernels (512 threads, __launch_bounds__(512, 1)) fit one block per SM


# The Triton engine's tests run its kernels under the interpreter.
_TRITON_UNUSABLE = triton_kernels_unusable(interpret=True)
needs_triton_interpreter = pytest.mark.skipif(_TRITON_UNUSABLE is not None, reason=str(_TRITON_UNUSABLE))


def test_one_rank_per_gpu_keeps_the_requested_grid():
    assert resident_nblocks(32, [(f"gpu{q}", H100, 0) for q in range(8)]) == (32, None)


def test_eight_ranks_on_one_gpu_fit_together():
    nblocks, reason = resident_nblocks(32, [("gpu0", H100, 0)] * 8)
    assert nblocks == H100 // 8 == 16
    assert nblocks * 8 <= H100
    assert "nblocks 32 -> 16" in reason and "'gpu0': 8" in reason


def test_the_most_crowded_gpu_decides_for_every_rank():
    # 3 ranks on gpu0, 1 on gpu1: gpu0 holds 132 // 3 = 44 per rank.
    devices = [("gpu0", H100, 0), ("gpu0", H100, 0), ("gpu1", H100, 0), ("gpu0", H100, 0)]
    assert resident_nblocks(64, devices)[0] == 44
    assert resident_nblocks(40, devices) == (40, None)
    # A smaller GPU with two ranks decides over a bigger one with three.
    assert resident_nblocks(64, [("a", 30, 0), ("a", 30, 0), ("b", H100, 0), ("b", H100, 0), ("b", H100, 0)])[0] == 15


def test_every_rank_gets_the_same_answer_whatever_its_position():
    devices = [("gpu0", H100, 0)] * 5 + [("gpu1", 60, 0)] * 3
    answers = {resident_nblocks(32, devices[q:] + devices[:q]) for q in range(len(devices))}
    assert len(answers) == 1 and next(iter(answers))[0] == 20


def test_a_gpu_too_small_for_one_block_per_rank_is_an_error():
    with pytest.raises(ValueError, match="4 ranks share GPU gpu0, which holds only 3 blocks"):
        resident_nblocks(8, [("gpu0", 3, 0)] * 4)


def test_blocks_of_other_live_communicators_count_on_their_gpu():
    # 2 ranks per GPU; on gpu0 both ranks' DDP-hook communicators hold 32 blocks each.
    devices = [("gpu0", H100, 32), ("gpu0", H100, 32), ("gpu1", H100, 0), ("gpu1", H100, 0)]
    nblocks, reason = resident_nblocks(64, devices)
    assert nblocks == (H100 - 64) // 2 == 34
    assert "other live communicators hold blocks there ({'gpu0': 64})" in reason, reason
    assert resident_nblocks(34, devices) == (34, None)
    # One rank per GPU, each GPU nearly full of another communicator's blocks.
    assert resident_nblocks(32, [(f"gpu{q}", H100, 120) for q in range(4)])[0] == 12


def test_a_gpu_full_of_other_communicators_blocks_is_an_error_that_says_to_close_some():
    with pytest.raises(ValueError, match=r"2 ranks share GPU gpu0, which holds only 132 blocks .* at once, of "
                                         r"which other live communicators of these ranks hold 131 \(close some\)"):
        resident_nblocks(8, [("gpu0", H100, 66), ("gpu0", H100, 65)])


def test_a_smaller_gpu_than_the_grid_explains_the_cut():
    assert resident_nblocks(64, [("gpu0", 60, 0), ("gpu1", 60, 0)]) == \
        (60, "nblocks 64 -> 60: a GPU holds only 60 blocks of these kernels at once, and every rank's blocks of "
             "every live communicator must be resident at once")


def _shared_gpu_rank(rank, world, capacity):
    import torch

    import pyallreduce
    from pyallreduce import logs
    from pyallreduce.engines.triton import TritonEngine

    # The GPU facts this rank would gather (no GPU here): every rank on one GPU.
    TritonEngine.gpu_capacity = classmethod(lambda cls, device, world_size: ("gpu0", capacity))
    logged = []
    logs.log_once = logged.append
    with pyallreduce.Communicator(device="cpu", backend="triton", nblocks=4, max_bytes=64 << 10) as comm:
        x = torch.arange(3000, dtype=torch.float32) + rank
        y = comm.all_reduce(x)
        assert torch.equal(y, sum(torch.arange(3000, dtype=torch.float32) + q for q in range(world)))
        return comm.nblocks, logged


@needs_triton_interpreter
def test_ranks_sharing_a_gpu_launch_the_bounded_grid_on_every_rank():
    from launch import run_ranks

    results = run_ranks(_shared_gpu_rank, 2, 5, env={"TRITON_INTERPRET": "1"}, timeout=180)
    for nblocks, logged in results:
        assert nblocks == 2  # 5 resident blocks, 2 ranks on the GPU
        assert any("nblocks 4 -> 2" in line for line in logged)


def _communicators_sharing_a_gpu_rank(rank, world):
    import torch

    import pyallreduce
    from pyallreduce import logs
    from pyallreduce.engines.triton import TritonEngine

    # Both ranks on one GPU that holds 10 blocks at once (no GPU here: the facts are given).
    TritonEngine.gpu_capacity = classmethod(lambda cls, device, world_size: ("gpu0", 10))
    logged = []
    logs.log_once = logged.append

    def make():
        return pyallreduce.Communicator(device="cpu", backend="triton", nblocks=4, max_bytes=64 << 10)

    def exact(comm):
        x = torch.arange(300, dtype=torch.float32) + rank
        return torch.equal(comm.all_reduce(x), sum(torch.arange(300, dtype=torch.float32) + q for q in range(world)))

    grids = []
    a = make()  # 2 x 4 of 10
    b = make()  # 2 x 4 held by a: 1 each
    grids += [a.nblocks, b.nblocks]
    assert exact(a) and exact(b)
    a.close()
    c = make()  # b holds 2 x 1: 4 each again
    grids.append(c.nblocks)
    assert exact(c)
    d_error = None
    try:
        make()  # b and c hold 2 x 5 of 10: not one block left
    except ValueError as e:
        d_error = str(e)
    b.close()
    c.close()
    return grids, d_error, logged


@needs_triton_interpreter
def test_blocks_of_live_communicators_bound_the_next_ones_grid_and_closing_frees_them():
    from launch import run_ranks

    results = run_ranks(_communicators_sharing_a_gpu_rank, 2, env={"TRITON_INTERPRET": "1"}, timeout=180)
    for grids, d_error, logged in results:
        assert grids == [4, 1, 4]
        assert any("nblocks 4 -> 1" in line and "other live communicators hold blocks there ({'gpu0': 8})" in line
                   for line in logged), logged
        assert d_error is not None and "other live communicators of these ranks hold 10 (close some)" in d_error


def test_crossover_rows_fall_back_from_kind_to_family_to_defaults(tmp_path):
    import json

    from pyallreduce import policy

    def row(two_shot):
        return {"two_shot_min_bytes": two_shot, "reference_min_bytes": None, "measured": True}

    table = tmp_path / "crossovers.json"
    table.write_text(json.dumps({
        "default": row(1),
        "cpu": {"default": row(2), "2": row(3)},
        "cpu:Some CPU:avx2": {"default": row(4), "4": row(5)},
    }))
    policy._table.cache_clear()
    try:
        def two_shot(kind, world):
            return policy.lookup(kind, world, path=table).two_shot_min_bytes

        assert two_shot("cpu:Some CPU:avx2", 4) == 5  # the kind's own row
        assert two_shot("cpu:Some CPU:avx2", 2) == 3  # the family's row for this world size
        assert two_shot("cpu:Some CPU:avx2", 8) == 4  # the kind's default
        assert two_shot("cpu:Other CPU:avx512", 8) == 2  # an unknown kind: the family's default
        assert two_shot("cuda:Some GPU", 8) == 1  # no family row either: the table's default
    finally:
        policy._table.cache_clear()


def test_cpu_device_kind_names_model_and_isa():
    import pyallreduce._C as C
    from pyallreduce import policy

    assert policy.device_kind("cpu") == f"cpu:{policy.cpu_model()}:{C.cpu_isa()}"
    assert C.cpu_isa() in ("generic", "avx2", "avx512")


def _auto_follows_a_new_crossover_row(rank, world):
    import dataclasses
    from unittest import mock

    import torch

    import pyallreduce
    from pyallreduce import reference

    with pyallreduce.Communicator(max_bytes=64 << 10) as comm:
        x = torch.full((64,), float(rank + 1))
        with mock.patch.object(reference, "run", wraps=reference.run) as by_torch:
            assert torch.equal(comm.all_reduce(x), torch.full((64,), 3.0))
            kernels_first = not by_torch.called
            comm.crossover = dataclasses.replace(comm.crossover, reference_min_bytes=0)  # the reference wins at any size
            assert torch.equal(comm.all_reduce(x), torch.full((64,), 3.0))
            assert torch.equal(comm.all_reduce_(x.clone()), torch.full((64,), 3.0))
            return kernels_first, by_torch.call_count


def test_auto_follows_the_crossover_row_set_on_a_communicator():
    """`comm.crossover = row` (the benchmark's --crossovers-file, tests) steers
    "auto" on the eager fast path too, not only on the general path: with a
    row where the reference always wins, eager calls go to torch.distributed."""
    from launch import run_ranks

    for kernels_first, by_torch in run_ranks(_auto_follows_a_new_crossover_row, 2, timeout=120):
        assert kernels_first and by_torch == 2, (kernels_first, by_torch)


# ---- crossovers --------------------------------------------------------------------

TABLE = {
    "default": {"two_shot_min_bytes": 1 << 20, "reference_min_bytes": None},
    "cpu": {"2": {"two_shot_min_bytes": 4096, "reference_min_bytes": None, "measured": True}},
    "cpu:Other CPU:avx2": {"2": {"two_shot_min_bytes": 65536, "reference_min_bytes": None, "measured": True}},
}


def test_only_a_kinds_own_row_or_its_own_measurement_counts_as_measured(tmp_path):
    table, cache = tmp_path / "table.json", tmp_path / "cache.json"
    table.write_text(json.dumps(TABLE))
    assert policy.lookup("cpu:Other CPU:avx2", 2, table, cache) == policy.Crossover(65536, None, True)
    # Another CPU gets the family's numbers as a default to measure over, not as its measurement.
    assert policy.lookup("cpu:This CPU:avx512", 2, table, cache) == policy.Crossover(4096, None, False)
    assert policy.lookup("cpu:This CPU:avx512", 4, table, cache) == policy.Crossover(1 << 20, None, False)
    policy.remember("cpu:This CPU:avx512", 2, policy.Crossover(16384, None, True), cache)
    assert policy.lookup("cpu:This CPU:avx512", 2, table, cache) == policy.Crossover(16384, None, True)
    assert policy.lookup("cpu:This CPU:avx512", 4, table, cache).measured is False
    # The table's own row wins over a measurement at first use (bench/compare_nccl.py's is many runs').
    policy.remember("cpu:Other CPU:avx2", 2, policy.Crossover(1024, None, True), cache)
    assert policy.lookup("cpu:Other CPU:avx2", 2, table, cache).two_shot_min_bytes == 65536
    cache.write_text("{not json")  # a damaged cache is measured again, not an error
    assert policy.lookup("cpu:This CPU:avx512", 2, table, cache).measured is False
    policy.remember("cpu:This CPU:avx512", 2, policy.Crossover(8192, None, True), cache)
    assert policy.lookup("cpu:This CPU:avx512", 2, table, cache).two_shot_min_bytes == 8192
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def test_a_row_measured_by_another_build_or_on_other_cores_is_measured_again(tmp_path, monkeypatch):
    """A row measured before a rebuild (whose kernels or waits may differ: the
    row of 4 ranks on 2 cores measured before their waits yielded said never
    two-shot, where two-shot now wins from 64 KiB) or with the ranks on
    another number of cores is not this setup's: it is measured again."""
    table, cache, kind = tmp_path / "table.json", tmp_path / "cache.json", "cpu:This CPU:avx512"
    table.write_text(json.dumps(TABLE))
    policy.remember(kind, 4, policy.Crossover(65536, None, True), cache)
    assert policy.lookup(kind, 4, table, cache) == policy.Crossover(65536, None, True)
    with monkeypatch.context() as m:
        m.setattr(policy, "build_identity", lambda: "another build")
        assert policy.lookup(kind, 4, table, cache).measured is False
    cores = os.sched_getaffinity(0)
    with monkeypatch.context() as m:
        m.setattr(os, "sched_getaffinity", lambda pid: set(range(len(cores) + 1)))
        assert policy.lookup(kind, 4, table, cache).measured is False
        policy.remember(kind, 4, policy.Crossover(1 << 20, None, True), cache)
        assert policy.lookup(kind, 4, table, cache).two_shot_min_bytes == 1 << 20
    assert policy.lookup(kind, 4, table, cache).two_shot_min_bytes == 65536  # each setup keeps its own row


def test_winning_tail_start_ignores_a_win_below_a_loss():
    wins = {1: True, 2: False, 4: True, 8: True}
    assert policy.winning_tail_start([1, 2, 4, 8], wins.get) == 4
    assert policy.winning_tail_start([1, 2], {1: True, 2: False}.get) is None
    assert policy.winning_tail_start([1, 2], {1: True, 2: True}.get) == 1


def _caches(tmp_path, l2_size):
    """A sysfs cache directory like Linux's, whose L2 is l2_size (None: no L2 listed)."""
    for i, (level, kind, size) in enumerate([(1, "Data", "32K"), (2, "Unified", l2_size), (3, "Unified", "32768K")]):
        if size is not None:
            index = tmp_path / f"index{i}"
            index.mkdir()
            for name, value in (("level", level), ("type", kind), ("size", size)):
                (index / name).write_text(f"{value}\n")
    return tmp_path


@pytest.mark.parametrize("l2, rounds", [("1024K", 512 << 10), ("1280K", 512 << 10), ("2048K", 512 << 10),
                                        ("2M", 512 << 10), ("512K", 256 << 10), ("256K", 256 << 10),
                                        (None, 256 << 10), ("odd", 256 << 10), ("", 256 << 10),
                                        ("1", 256 << 10), ("0K", 256 << 10)])
def test_host_rounds_are_half_the_l2_within_bounds(tmp_path, l2, rounds):
    from pyallreduce import _C

    assert _C.DEFAULT_ROUND_BYTES == 256 << 10 and policy.ROUND_BYTES_MAX == 512 << 10
    assert policy.host_round_bytes(_caches(tmp_path, l2)) == rounds


FAKE_KIND = "cpu:A CPU no table knows:avx512"


def _communicators_of_a_new_machine(rank, world, calibrate_env):
    """Two Communicators in a row on a kind crossovers.json has no row for."""
    import pyallreduce
    from pyallreduce import calibrate

    policy.device_kind = lambda device: FAKE_KIND  # this process only
    if calibrate_env is not None:
        os.environ["PYALLREDUCE_CALIBRATE"] = calibrate_env[rank]
    measured, measure = [], calibrate.measure
    calibrate.measure = lambda *a: measured.append(1) or measure(*a)
    seen = []
    for _ in range(2):
        comm = pyallreduce.Communicator(device="cpu")
        seen.append((comm.crossover, len(measured), comm._calls))
        comm.all_reduce_(torch.ones(8))  # its own calls begin at its first (the measurement had an engine of its own)
        seen[-1] += (comm._calls,)
        comm.close()
    return seen


def test_a_machine_without_a_row_measures_its_crossover_once_and_its_ranks_agree(tmp_path, monkeypatch):
    monkeypatch.setenv("PYALLREDUCE_CACHE_DIR", str(tmp_path))
    seen = run_ranks(_communicators_of_a_new_machine, 2, None, timeout=180)
    (first, measured, calls, calls_after_one), (second, measured_again, _, _) = seen[0]
    assert first.measured and measured == 1 and (calls, calls_after_one) == (0, 1)
    assert second == first and measured_again == 1, "the second Communicator must take the cached row"
    assert all(s == seen[0] for s in seen), f"the ranks disagree: {seen}"
    cached = json.loads((tmp_path / "crossovers.json").read_text())[FAKE_KIND][policy.measured_key(2)]
    assert cached["two_shot_min_bytes"] == first.two_shot_min_bytes and cached["measured"]


def test_ranks_follow_rank_0_on_whether_to_measure(tmp_path, monkeypatch):
    monkeypatch.setenv("PYALLREDUCE_CACHE_DIR", str(tmp_path))
    # Rank 0 says not to measure: nobody does, nothing is cached, the default row serves.
    seen = run_ranks(_communicators_of_a_new_machine, 2, ("0", "1"), timeout=180)
    assert all(crossover == policy.Crossover(4096, None, False) and measured == 0
               for rank_seen in seen for crossover, measured, _, _ in rank_seen), seen
    assert not (tmp_path / "crossovers.json").exists()
    # Rank 0 says to: every rank measures with it (a rank that did not would leave it waiting).
    seen = run_ranks(_communicators_of_a_new_machine, 2, ("1", "0"), timeout=180)
    assert seen[0] == seen[1] and seen[0][0][0].measured


def _sleepers(core_sets):
    """One sleeping process per core set, bound to it."""
    import subprocess
    import sys

    return [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             preexec_fn=lambda cores=cores: os.sched_setaffinity(0, cores))
            for cores in core_sets]


@pytest.mark.quick
def test_ranks_outnumber_cores_counts_the_cores_of_all_their_affinities_together():
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    cases = [([{cores[0]}, {cores[0]}], True),            # two ranks bound to one core
             ([{cores[0]}, {cores[1]}], False),           # one core each
             ([{cores[0]}, {cores[1]}, {cores[1]}], True),
             ([set(cores[:2])] * 3, True),                # three unbound on two cores
             ([set(cores[:2])] * 2, False)]
    for core_sets, expected in cases:
        procs = _sleepers(core_sets)
        try:
            assert policy.ranks_outnumber_cores([p.pid for p in procs]) is expected, core_sets
        finally:
            for p in procs:
                p.kill()
                p.wait()
    # A process that cannot be asked (gone, or in another PID namespace): no claim.
    gone = _sleepers([{cores[0]}])[0]
    gone.kill()
    gone.wait()
    assert policy.ranks_outnumber_cores([gone.pid, os.getpid()]) is False
