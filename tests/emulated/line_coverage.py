"""Line coverage of the GPU path: gcov for the CUDA glue when
tests/test_cuda.py runs on the emulated CUDA runtime (the instrumented
extension, build_emulated.py --coverage); coverage.py for the Python CUDA
engine, transport, DDP hook and backend, over that run and the CPU tests that
drive the same Python with the CUDA calls stubbed (HOST_TESTS: error paths the
emulation cannot provoke), a line counting as executed if either ran it (the
pytest processes and every rank; needs `pip install coverage`). Reports, per
file, the lines executed and the ones that were not.

    python tests/emulated/line_coverage.py [--json OUT.json] [pytest -k expression]

Every rank process writes its counts when it exits; gcov sums them, and
coverage.py combines the processes' data files.
"""
import argparse
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import build_emulated  # noqa: E402
from launch import COVERAGE_ENV  # noqa: E402

ROOT = build_emulated.ROOT
# The glue under measurement, and the object each is compiled into.
GLUE = {"csrc/cuda/adapter.cpp": "adapter.o", "csrc/cuda/glue.cpp": "glue.o", "csrc/cuda/runtime.cpp": "runtime.o",
        "csrc/backend.cpp": "backend.o"}  # the last: the torch.distributed backend's C++ half
# The Python of the GPU path (ddp.py and backend.py have CPU branches too, which the CPU suites run).
PYTHON = ("pyallreduce/engines/cuda.py", "pyallreduce/transport/cuda_ipc.py", "pyallreduce/ddp.py",
          "pyallreduce/backend.py", "pyallreduce/communicator.py", "pyallreduce/eager.py")
PY_DATA = build_emulated.OUT / "python-coverage" / "data"
# The CPU tests of the Python GPU path (pyallreduce._C's CUDA functions stubbed) and of
# ddp.py's and backend.py's other branches.
HOST_TESTS = ("tests/test_lifetimes.py", "tests/test_graph_registration.py", "tests/test_topology.py",
              "tests/test_backend.py", "tests/test_ddp.py")


def python_under_coverage(args, cwd, env):
    return subprocess.run([sys.executable, "-P", "-m", "coverage", "run", "--parallel-mode", f"--data-file={PY_DATA}",
                           "--include=*/pyallreduce/*", "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", *args],
                          cwd=cwd, env={**env, COVERAGE_ENV: str(PY_DATA)}, capture_output=True, text=True)


def run_tests(select=None):
    """test_cuda.py on the emulation (gcov and coverage.py), test_backend.py on the same
    build (gcov of the backend's C++ half on CPU tensors), then HOST_TESTS (coverage.py)."""
    for gcda in build_emulated.objects(coverage=True).glob("*.gcda"):
        gcda.unlink()
    PY_DATA.parent.mkdir(parents=True, exist_ok=True)
    for old in PY_DATA.parent.glob("data*"):
        old.unlink()
    # The pytest processes too, under coverage.py: they import the package (the
    # module-level lines) before the ranks fork.
    env = {**os.environ, **build_emulated.build(coverage=True)}
    emulated = python_under_coverage([str(ROOT / "tests" / "test_cuda.py"), *(["-k", select] if select else [])],
                                     build_emulated.OUT, env)
    # FSDP2 and DTensor pick the (emulated) CUDA device when there is one, and run torch kernels on it.
    backend = python_under_coverage([str(ROOT / "tests" / "test_backend.py"), "-k", "not fsdp2 and not dtensor"],
                                    build_emulated.OUT, env)
    host = python_under_coverage([str(ROOT / t) for t in HOST_TESTS], ROOT, dict(os.environ))
    runs = (("emulated", emulated), ("backend on the emulated build", backend), ("host", host))
    summary = "; ".join(f"{what}: {(proc.stdout.strip().splitlines() or [''])[-1]}" for what, proc in runs)
    return summary, max(proc.returncode for _, proc in runs)


def measure_python():
    import coverage

    data = coverage.Coverage(data_file=str(PY_DATA))
    data.combine()
    data.save()
    measured = data.get_data().measured_files()
    files = {}
    for source in PYTHON:
        # The same file under two paths: the emulated package's link and the repository's.
        statements, missed = [], None
        for path in (f for f in measured if f.endswith(source)):
            _, statements, _, missing, _ = data.analysis2(path)
            missed = set(missing) if missed is None else missed & set(missing)
        if missed is None:
            files[source] = {"lines": 0, "executed": 0, "missed": "not imported"}
            continue
        files[source] = {"lines": len(statements), "executed": len(statements) - len(missed),
                         "missed": sorted(missed)}
    return files


def measure(summary):
    obj = build_emulated.objects(coverage=True)
    report = {"pytest": summary, "files": {}}
    for source, obj_name in GLUE.items():
        subprocess.run(["gcov", "-j", "-o", str(obj), str(obj / obj_name)], cwd=obj, capture_output=True, check=True)
        data = json.loads(gzip.open(obj / f"{Path(obj_name).stem}.gcov.json.gz").read())
        lines = {}
        for f in data["files"]:
            if Path(f["file"]).resolve() == (ROOT / source).resolve():
                for line in f["lines"]:  # one entry per (line, function instance): executed if any ran it
                    lines[line["line_number"]] = lines.get(line["line_number"], 0) + line["count"]
        missed = sorted(n for n, c in lines.items() if c == 0)
        report["files"][source] = {"lines": len(lines), "executed": len(lines) - len(missed), "missed": missed}
    report["files"].update(measure_python())
    return report


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("select", nargs="?", help="pytest -k expression (default: the whole file)")
    p.add_argument("--json", type=Path)
    p.add_argument("--report-only", action="store_true", help="report the counts of the last run")
    args = p.parse_args()
    summary, rc = ("(counts of the last run)", 0) if args.report_only else run_tests(args.select)
    report = measure(summary)
    print(f"tests/test_cuda.py on the emulated runtime: {report['pytest']}")
    for source, r in report["files"].items():
        print(f"{source}: {r['executed']} of {r['lines']} lines executed "
              f"({100 * r['executed'] / max(r['lines'], 1):.1f}%); not executed: {r['missed']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
