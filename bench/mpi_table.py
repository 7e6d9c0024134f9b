"""The README's table of ours against MPI, from bench/compare_nccl.py --mpi
result files: for each size, each run's MPI time / our in-place time (median
and p90, both timed in turns in the same run), the median of those ratios
over the runs, the range of the absolute times, and the faster MPI's ratio.
A ratio below 1 (MPI faster) is bold.

    python bench/mpi_table.py bench/results/mpi-*-cpu-4ranks-float32-epyc-turns-run*.json
"""
import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

MPI_TITLES = {"openmpi": "Open MPI", "mpich": "MPICH"}


def size_text(nbytes):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def ratio_text(ratio):
    return f"**{ratio:.2f}**" if ratio < 1 else f"{ratio:.2f}"


def us_text(us):
    return f"{us:.0f}" if us >= 100 else f"{us:.1f}"


def span(values):
    lo, hi = us_text(min(values)), us_text(max(values))
    return lo if lo == hi else f"{lo}–{hi}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path)
    args = p.parse_args()
    # (mpi, size) -> one entry per run: (ours median, ours p90, MPI median, MPI p90, bound)
    runs = defaultdict(list)
    for path in args.files:
        report = json.loads(path.read_text())
        for r in report["rows"]:
            if r["algo"] == "auto" and r.get("mpi"):
                ours, mpi = r["in_place"], r["mpi"]
                runs[report["mpi"]["mpi"], r["size"]].append(
                    (ours["time_us"], ours["p90_us"], mpi["time_us"], mpi["p90_us"], r["bound"]["time_us"]))
    mpis = [m for m in MPI_TITLES if any(key[0] == m for key in runs)]
    sizes = sorted({size for _, size in runs})
    print("| size | " + " | ".join(f"ours vs {MPI_TITLES[m]}, µs: MPI ÷ ours, median / p90" for m in mpis)
          + " | best MPI ÷ ours, median / p90 | bound µs |")
    print("|---:|" + "---|" * len(mpis) + "---:|---:|")
    for size in sizes:
        cells, best_median, best_p90, bounds = [], [], [], []
        for m in mpis:
            found = runs.get((m, size), [])
            if not found:
                cells.append("n/a")
                continue
            median = statistics.median(mpi / ours for ours, _, mpi, _, _ in found)
            p90 = statistics.median(mpi_p90 / ours_p90 for _, ours_p90, _, mpi_p90, _ in found)
            best_median.append(median)
            best_p90.append(p90)
            bounds += [b for *_, b in found]
            cells.append(f"{span([f[0] for f in found])} vs {span([f[2] for f in found])}: "
                         f"{ratio_text(median)} / {ratio_text(p90)}")
        print(f"| {size_text(size)} | " + " | ".join(cells)
              + f" | {ratio_text(min(best_median))} / {ratio_text(min(best_p90))} | {us_text(statistics.median(bounds))} |")


if __name__ == "__main__":
    main()
