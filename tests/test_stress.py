"""bench/stress.py: the short CI version of the stress run (4 ranks, random
sizes, dtypes, ops, algorithms, layouts and delays: no wrong result, no leaked
segment, flat memory), and its checker, which must catch a wrong result."""
import json
import random
import sys

import pytest
import torch

import bench_scripts

STRESS = bench_scripts.BENCH_DIR / "stress.py"
CALLS = 400
TIMEOUT_S = 240  # ~15 s unloaded; 4 ranks share 2 cores in CI


def test_short_stress_run(tmp_path):
    out = tmp_path / "stress.json"
    cmd = [sys.executable, str(STRESS), "--nproc", "4", "--calls", str(CALLS), "--seed", "7", "--json", str(out)]
    proc = bench_scripts.run_script(cmd, TIMEOUT_S)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    report = json.loads(out.read_text())
    assert report["world_size"] == 4 and report["backend"] == "cpu"
    assert report["wrong"] == 0 and report["leaked_segments"] == [] and report["memory_grew_on_ranks"] == []
    assert sum(report["calls_by_algo"].values()) == CALLS
    assert set(report["calls_by_algo"]) == {"auto", "one_shot", "two_shot", "fallback"}
    assert [r["rank"] for r in report["ranks"]] == [0, 1, 2, 3]
    for r in report["ranks"]:
        assert r["wrong"] == 0 and len(r["rss_mib"]) == 10


class LocalComm:
    """A one-rank stand-in: the right answer for world size 1 is the input, except
    where `corrupt` says the first element should come back changed."""

    def __init__(self, corrupt=False):
        self.corrupt = corrupt

    def _result(self, x):
        r = x.clone()
        if self.corrupt and r.numel():
            r[(0,) * r.dim()] += 1
        return r

    def all_reduce(self, x, op="sum", algo="auto", out=None):
        r = self._result(x)
        if out is None:
            return r
        out.copy_(r)
        return out

    def all_reduce_(self, x, op="sum", algo="auto"):
        x.copy_(self._result(x))
        return x


@pytest.mark.quick
def test_checker_accepts_right_and_catches_wrong_results_in_every_layout_and_style():
    stress = bench_scripts.load("stress")
    plan = random.Random(3)
    seen = set()
    for i in range(400):
        call = stress.draw_call(plan, 1 << 14)
        if call["numel"] == 0:
            continue
        seen.add((call["layout"], call["style"]))
        assert stress.run_call(LocalComm(), call, 0, 1, torch.device("cpu")) is None, stress.describe(i, call)
        problem = stress.run_call(LocalComm(corrupt=True), call, 0, 1, torch.device("cpu"))
        assert problem == f"1 of {1 if call['layout'] == 'scalar' else call['numel']} elements wrong", \
            (stress.describe(i, call), problem)
    assert seen == {(lay, sty) for lay in stress.LAYOUTS for sty in stress.CALL_STYLES}
