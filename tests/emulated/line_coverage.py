"""Line coverage (gcov) of the CUDA glue when tests/test_cuda.py runs on the
emulated CUDA runtime: builds the instrumented extension
(build_emulated.py --coverage), runs the file there, and reports, per glue
file, the lines executed and the ones that were not.

    python tests/emulated/coverage.py [--json OUT.json] [pytest -k expression]

Every rank process writes its counts when it exits; gcov sums them.
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
import build_emulated  # noqa: E402

ROOT = build_emulated.ROOT
# The glue under measurement, and the object each is compiled into.
GLUE = {"csrc/cuda/adapter.cpp": "adapter.o", "csrc/cuda/glue.cpp": "glue.o", "csrc/cuda/runtime.cpp": "runtime.o"}


def run_tests(select=None):
    env = {**os.environ, **build_emulated.build(coverage=True)}
    for gcda in build_emulated.objects(coverage=True).glob("*.gcda"):
        gcda.unlink()
    tests = build_emulated.run_pytest(env, [str(ROOT / "tests" / "test_cuda.py"), *(["-k", select] if select else [])])
    return (tests.stdout.strip().splitlines() or [""])[-1], tests.returncode


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
