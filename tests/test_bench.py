"""bench/compare_nccl.py on CPU: a short real run (2 spawned ranks, a few small
sizes) must pass its own correctness round, write the documented JSON and a
crossover table the policy reads; a wrong result must fail the run."""
import json
import shutil
import socket
import subprocess
import sys

import pytest

import pyallreduce
from pyallreduce import policy

import bench_scripts
from bench_scripts import clean_env

BENCH = bench_scripts.BENCH_DIR / "compare_nccl.py"
TIMEOUT_S = 120  # a loaded 2-core CI box; the run itself takes ~20 s
SIZES = [4 << 10, 32 << 10, 256 << 10]
STATS = {"time_us", "p10_us", "p90_us", "algbw", "busbw"}
ROW = {"backend", "size", "count", "type", "redop", "algo", "out_of_place", "in_place", "reference",
       "speedup", "wrong", "deepspeed", "mpi", "bound", "pct_of_bound", "run"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def test_cpu_run_json_and_crossovers(tmp_path):
    table = tmp_path / "crossovers.json"
    shutil.copy(policy.CROSSOVERS_FILE, table)
    real_table = policy.CROSSOVERS_FILE.read_bytes()
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(BENCH), "--device", "cpu", "--nproc", "2", "--sizes", "4K:256K", "--factor", "8",
           "--dtypes", "float32,bfloat16", "--ops", "sum,avg", "--iters", "3", "--warmup", "1", "--repeat", "2",
           "--json", str(out), "--write-crossovers", "--crossovers-file", str(table)]
    proc = bench_scripts.run_script(cmd, TIMEOUT_S)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "#wrong" in proc.stdout and "memcpy" in proc.stdout

    report = json.loads(out.read_text())
    machine = report["machine"]
    kind = policy.device_kind("cpu")
    assert machine["world_size"] == 2 and machine["device_kind"] == kind
    assert kind == f"cpu:{policy.cpu_model()}:{pyallreduce._C.cpu_isa()}"
    assert machine["cpu"] and machine["cores"] >= 1 and machine["torch"] and machine["date"]
    assert report["memcpy"]["bytes"] == max(SIZES) and report["memcpy"]["gbps"] > 0

    rows = report["rows"]
    combos = {(r["run"], r["size"], r["type"], r["redop"], r["algo"]) for r in rows}
    assert len(rows) == len(combos) == 2 * len(SIZES) * 2 * 2 * 3  # runs x sizes x dtypes x ops x algos
    assert {r["run"] for r in rows} == {0, 1}
    assert {r["size"] for r in rows} == set(SIZES)
    for r in rows:
        assert set(r) == ROW, r
        assert r["wrong"] == 0 and r["reference"]["wrong"] == 0, r
        assert r["count"] * DTYPE_BYTES[r["type"]] == r["size"]
        for part in ("out_of_place", "in_place", "reference"):
            stats = r[part]
            assert STATS <= set(stats), (part, stats)
            assert 0 < stats["p10_us"] <= stats["time_us"] <= stats["p90_us"], (part, stats)
            assert stats["busbw"] == pytest.approx(stats["algbw"])  # 2(W-1)/W == 1 for W = 2
        assert r["speedup"] == pytest.approx(r["reference"]["time_us"] / r["in_place"]["time_us"])
        # The bound: a copy of twice the size at 2 ranks (bench.bound_copy_bytes), timed in the same run.
        assert r["bound"]["copy_bytes"] == 2 * r["size"] and r["bound"]["time_us"] > 0
        assert r["pct_of_bound"] == pytest.approx(100 * r["bound"]["time_us"] / r["in_place"]["time_us"])

    written = json.loads(table.read_text())
    original = json.loads(real_table)
    assert policy.CROSSOVERS_FILE.read_bytes() == real_table, "the real table must not be touched"
    others = {k: v for k, v in original.items() if k != kind}
    assert {k: v for k, v in written.items() if k != kind} == others  # other kinds kept
    assert {k: v for k, v in written[kind].items() if k != "2"} == {k: v for k, v in original.get(kind, {}).items()
                                                                     if k != "2"}
    crossover = policy.lookup(kind, 2, path=table)
    assert crossover.measured
    assert crossover.two_shot_min_bytes in SIZES + [policy.NEVER]
    assert crossover.reference_min_bytes is None or crossover.reference_min_bytes in SIZES


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


WRONG_EXPECTATION = """
import importlib.util, os, sys
sys.path.insert(0, os.path.dirname({bench!r}))
spec = importlib.util.spec_from_file_location("compare_nccl", {bench!r})
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
exact = bench.expected_output

def off_by_one(*args):
    want = exact(*args)
    want[0] += 1  # one element that no correct all-reduce produces
    return want

bench.expected_output = off_by_one
sys.exit(bench.run(bench.parse_args()))
"""


@pytest.mark.quick
def test_wrong_result_fails_the_run(tmp_path):
    """Rank processes started by hand (as torchrun would) with an expectation
    one element off: the run must report it and exit non-zero."""
    script = tmp_path / "wrong.py"
    script.write_text(WRONG_EXPECTATION.format(bench=str(BENCH)))
    table = tmp_path / "crossovers.json"
    shutil.copy(policy.CROSSOVERS_FILE, table)
    before = table.read_bytes()
    port = str(free_port())
    cmd = [sys.executable, str(script), "--device", "cpu", "--sizes", "4K", "--algos", "one_shot,two_shot",
           "--iters", "2", "--warmup", "1", "--write-crossovers", "--crossovers-file", str(table)]
    procs = [subprocess.Popen(cmd, env=dict(clean_env(), RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outputs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [1, 1], outputs
    stdout, stderr = outputs[0]
    assert "FAILED" in stdout and "wrong elements" in stderr, outputs[0]
    assert table.read_bytes() == before, "a failed run must not write crossovers"


def row(size, algo, ours, ref):
    stats = {"time_us": ours}
    return {"backend": "cpu", "size": size, "algo": algo, "in_place": stats, "reference": {"time_us": ref}}


@pytest.mark.quick
def test_crossover_is_the_start_of_the_winning_tail():
    bench = bench_scripts.load("compare_nccl")
    # two-shot wins at 2K (a blip), loses at 4K, wins from 8K on; the
    # reference wins only at the largest size.
    one = {1024: 10, 2048: 20, 4096: 30, 8192: 50, 16384: 90}
    two = {1024: 12, 2048: 15, 4096: 35, 8192: 40, 16384: 60}
    ref = {1024: 100, 2048: 100, 4096: 100, 8192: 100, 16384: 55}
    rows = [row(s, "one_shot", one[s], ref[s]) for s in one] + [row(s, "two_shot", two[s], ref[s]) for s in two]
    got = bench.derive_crossover(rows, "cpu")
    assert got == {"two_shot_min_bytes": 8192, "reference_min_bytes": 16384, "measured": True}

    # A two-shot win within TWO_SHOT_MARGIN does not count: one-shot keeps 8K.
    close = {**two, 8192: 50 / policy.TWO_SHOT_MARGIN + 0.5}
    rows = [row(s, "one_shot", one[s], ref[s]) for s in one] + [row(s, "two_shot", close[s], ref[s]) for s in close]
    assert bench.derive_crossover(rows, "cpu")["two_shot_min_bytes"] == 16384

    # Three runs, one of them in a slow phase where one-shot wins everywhere by far:
    # the median run decides, not the slow run's large absolute times.
    runs = []
    for run, scale in enumerate((1, 1, 10)):
        slow_two = {s: two[s] * (3 if scale > 1 else 1) for s in two}
        for s in one:
            runs += [dict(row(s, "one_shot", one[s] * scale, ref[s] * scale), run=run),
                     dict(row(s, "two_shot", slow_two[s] * scale, ref[s] * scale), run=run)]
    assert bench.derive_crossover(runs, "cpu")["two_shot_min_bytes"] == 8192

    never = [row(s, "one_shot", 1, 100) for s in one] + [row(s, "two_shot", 2, 100) for s in one]
    got = bench.derive_crossover(never, "cpu")
    assert got["two_shot_min_bytes"] == policy.NEVER and got["reference_min_bytes"] is None


@pytest.mark.quick
def test_other_all_reduces_are_timed_in_turns_with_ours(monkeypatch):
    """On CPU, our in-place call and the other libraries of a row are timed in
    ALTERNATIONS turns each, not one after the other: a shared machine's phase
    (several-fold in speed, within seconds) then meets all of them, and the row
    compares libraries, not phases."""
    bench = bench_scripts.load("compare_nccl")
    monkeypatch.setattr(bench.dist, "barrier", lambda: None)
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("ours", "mpi")}
    times = bench.time_cpu(fns, 30, 2)
    assert {name: len(t) for name, t in times.items()} == {"ours": 30, "mpi": 30}
    timed = calls[4:]  # after each one's 2 warm-up calls
    turn = 30 // bench.ALTERNATIONS
    assert timed[:2 * turn] == ["ours"] * turn + ["mpi"] * turn
    assert sum(a != b for a, b in zip(timed, timed[1:])) == 2 * bench.ALTERNATIONS - 1, timed


@pytest.mark.quick
def test_mpi_table_gives_each_mpis_median_ratio_over_the_runs(tmp_path):
    """bench/mpi_table.py, the README's tables: per size and MPI, the median
    over the runs of MPI's time / ours (median and p90), the range of the
    times, the faster MPI's ratio, and a ratio below 1 in bold."""
    def report(mpi, run, ours, theirs):
        stats = lambda t: {"time_us": t, "p90_us": 2 * t}  # noqa: E731
        row = {"algo": "auto", "size": 1024, "in_place": stats(ours), "mpi": stats(theirs),
               "bound": {"time_us": 0.5}}
        path = tmp_path / f"{mpi}-{run}.json"
        path.write_text(json.dumps({"mpi": {"mpi": mpi}, "rows": [row]}))
        return str(path)

    # Open MPI's ratios over three runs: 2, 0.5, 1.5 (median 1.5); MPICH's: 0.8, 0.9, 0.7 (median 0.8).
    files = [report("openmpi", 1, 1.0, 2.0), report("openmpi", 2, 2.0, 1.0), report("openmpi", 3, 2.0, 3.0),
             report("mpich", 1, 1.0, 0.8), report("mpich", 2, 1.0, 0.9), report("mpich", 3, 1.0, 0.7)]
    proc = subprocess.run([sys.executable, str(bench_scripts.BENCH_DIR / "mpi_table.py"), *files],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    header, _, line = proc.stdout.splitlines()
    assert "Open MPI" in header and "MPICH" in header
    assert line == ("| 1 KiB | 1.0–2.0 vs 1.0–3.0: 1.50 / 1.50 | 1.0 vs 0.7–0.9: **0.80** / **0.80** "
                    "| **0.80** / **0.80** | 0.5 |"), line


def test_backend_bench_run_checks_every_path_and_writes_json(tmp_path):
    """bench/backend_bench.py: every collective on gloo, the backend and a direct
    Communicator, each result checked (#wrong 0), and torch's floors (a
    do-nothing Python backend, torch's C++ fake backend); one JSON row per size."""
    import torch

    torch_before_2_14 = torch.__version__ < (2, 14)  # a TorchVersion, which compares with tuples
    out = tmp_path / "backend.json"
    cmd = [sys.executable, str(bench_scripts.BENCH_DIR / "backend_bench.py"), "--nproc", "2", "--sizes", "256:16K",
           "--factor", "64", "--iters", "3", "--warmup", "1", "--json", str(out)]
    proc = bench_scripts.run_script(cmd, TIMEOUT_S)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    rows = json.loads(out.read_text())["rows"]
    assert [(r["collective"], r["bytes"]) for r in rows] == [
        (c, s) for c in ("all_reduce", "reduce_scatter", "all_gather") for s in (256, 16384)]
    for r in rows:
        assert r["wrong"] == 0 and r["world"] == 2, r
        assert all(r[f"{p}_us"] > 0 for p in ("gloo", "backend", "direct", "cpp_floor")), r
        assert r["overhead_us"] == pytest.approx(r["backend_us"] - r["direct_us"]), r
        if torch_before_2_14:  # the Python floor needs 2.14's Python-subclassable Backend
            assert r["floor_us"] is None and r["over_floor_us"] is None, r
        else:
            assert r["floor_us"] > 0 and r["over_floor_us"] == pytest.approx(r["overhead_us"] - r["floor_us"]), r
        assert r["over_cpp_floor_us"] == pytest.approx(r["overhead_us"] - r["cpp_floor_us"]), r


def test_busy_back_to_back_run_writes_per_call_medians_and_p99(tmp_path):
    """bench/busy.py --back-to-back, the busy-machine benchmark (short: one
    size, one spinning process): per-call times for both backends."""
    out = tmp_path / "busy.json"
    cmd = [sys.executable, str(bench_scripts.BENCH_DIR / "busy.py"), "--back-to-back", "--nproc", "2", "--loads",
           "1", "--sizes", "4K", "--calls", "20", "--repeats", "2", "--json", str(out)]
    proc = bench_scripts.run_script(cmd, TIMEOUT_S)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    report = json.loads(out.read_text())
    assert report["back_to_back"] and report["nproc"] == 2
    [condition] = report["conditions"]
    assert condition["load"] == 1 and len(condition["loadavg"]) == 3
    [row] = condition["rows"]
    assert row["bytes"] == 4096 and row["calls"] == 2 * 20  # every call of both repeats
    for backend in ("pyallreduce", "gloo"):
        assert 0 < row[f"{backend}_median_s"] <= row[f"{backend}_p90_s"] <= row[f"{backend}_p99_s"]


MPI_READY = {mpi: (bench_scripts.BENCH_DIR.parent / "build" / "mpi" / mpi / "mpi4py").is_dir()
             and shutil.which(f"mpiexec.{mpi}") is not None for mpi in ("openmpi", "mpich")}


@pytest.mark.parametrize("mpi", ["openmpi", "mpich"])
def test_mpi_columns_are_timed_in_the_same_ranks_and_checked(tmp_path, mpi):
    """--mpi: the ranks start under that MPI's launcher, and every row carries
    its MPI_Allreduce's time and its own count of wrong elements (fp32 in
    place, bf16 through fp32 copies, avg as a sum and a division)."""
    if not MPI_READY[mpi]:
        pytest.skip(f"no {mpi} with mpi4py built against it here: bash bench/mpi_setup.sh")
    out = tmp_path / "mpi.json"
    cmd = [sys.executable, str(BENCH), "--device", "cpu", "--nproc", "2", "--mpi", mpi, "--sizes", "1K:64K",
           "--factor", "8", "--dtypes", "float32,bfloat16", "--ops", "sum,avg", "--algos", "auto", "--iters", "3",
           "--warmup", "1", "--json", str(out)]
    proc = bench_scripts.run_script(cmd, TIMEOUT_S)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    report = json.loads(out.read_text())
    assert report["mpi"]["mpi"] == mpi and report["mpi"]["library"]
    rows = report["rows"]
    assert len(rows) == 3 * 2 * 2  # sizes (1K, 8K, 64K) x dtypes x ops
    for r in rows:
        assert set(r["mpi"]) == STATS | {"wrong"} and r["mpi"]["wrong"] == 0 and r["mpi"]["time_us"] > 0, r


@pytest.mark.parametrize("mpi", ["openmpi", "mpich"])
def test_busy_times_an_mpi_beside_ours_under_its_launcher(tmp_path, mpi):
    """bench/busy.py --mpi: the ranks start under that MPI's launcher, and each
    row has its MPI_Allreduce's per-call median and p99 beside ours; the JSON
    names the MPI library."""
    if not MPI_READY[mpi]:
        pytest.skip(f"no {mpi} with mpi4py built against it here: bash bench/mpi_setup.sh")
    out = tmp_path / "busy.json"
    cmd = [sys.executable, str(bench_scripts.BENCH_DIR / "busy.py"), "--back-to-back", "--nproc", "2", "--loads",
           "0", "--sizes", "4K", "--calls", "20", "--repeats", "1", "--mpi", mpi, "--backends", "pyallreduce,mpi",
           "--json", str(out)]
    proc = bench_scripts.run_script(cmd, TIMEOUT_S)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    report = json.loads(out.read_text())
    assert report["backends"] == ["pyallreduce", "mpi"] and report["mpi"] == mpi
    [condition] = report["conditions"]
    assert condition["mpi"]["mpi"] == mpi and condition["mpi"]["library"]
    [row] = condition["rows"]
    for backend in ("pyallreduce", "mpi"):
        assert 0 < row[f"{backend}_median_s"] <= row[f"{backend}_p90_s"] <= row[f"{backend}_p99_s"]
    assert "gloo_median_s" not in row
