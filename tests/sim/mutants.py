"""Deliberate bugs in the CUDA kernel source, each of which the host harness
(tests/sim/harness.cpp) must catch: a check that cannot fail proves nothing.

Each mutant is one textual change to a copy of csrc/ (the change must match
exactly once, so a mutant that no longer applies is reported, not skipped),
built with the harness in the flavour that should catch it (plain, ASan+UBSan
or TSan), and run; the mutant is caught when the harness exits non-zero or is
killed by a sanitizer. A mutant still running at the time limit counts as
caught only if it says "hang", which the deadline design should make rare.

    python tests/sim/mutants.py [--only NAME] [--jobs 1]

Prints a table (name, flavour, result, seconds) and exits 1 if any mutant
survived. Results are recorded in docs/verification.md.
"""
import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build  # noqa: E402  (tests/sim/build.py: one place for the compile command)

ROOT = Path(__file__).resolve().parents[2]
KERNELS = "cuda/all_reduce.cuh"
DEVICE_OPS = "cuda/device_ops.h"
PLAN = "cuda/call_plan.h"
PROTOCOL = "common/protocol.h"

# (name, file under csrc, original text, mutated text, flavour, harness arguments)
MUTANTS = [
    ("relaxed flag store/load", DEVICE_OPS,
     "__atomic_store_n(p, v, __ATOMIC_RELEASE);\n  sim::flag_point();",
     "__atomic_store_n(p, v, __ATOMIC_RELAXED);\n  sim::flag_point();",
     "tsan", ["--suite", "tsan", "--mode", "threads", "--only", "random"]),
    ("relaxed flag load", DEVICE_OPS,
     "return __atomic_load_n(p, __ATOMIC_ACQUIRE);",
     "return __atomic_load_n(p, __ATOMIC_RELAXED);",
     "tsan", ["--suite", "tsan", "--mode", "threads", "--only", "random"]),
    ("no __syncthreads before the release", KERNELS,
     "                                            BarrierView& view) {\n  __syncthreads();",
     "                                            BarrierView& view) {",
     "plain", ["--suite", "quick", "--only", "random"]),
    ("no __syncthreads after the acquire", KERNELS,
     "  }\n  __syncthreads();\n  uint32_t missing = 0;",
     "  }\n  uint32_t missing = 0;",
     "plain", ["--suite", "quick", "--only", "random"]),
    ("one staging buffer", KERNELS,
     "a.sources_odd_shift = staged ? odd_shift : 0;\n  a.reduced_odd_shift = call.mode == kRegisteredInPlace ? 0 : odd_shift;",
     "a.sources_odd_shift = 0;\n  a.reduced_odd_shift = 0;",
     "plain", ["--suite", "quick", "--only", "random"]),
    ("no end barrier in registered one-shot", KERNELS,
     "  if (epochs_used == 2) meet<W>(a, own_region, kStartFlagsOffset, e + 1, kBarrierEnd);",
     "",
     "plain", ["--suite", "quick", "--only", "random"]),
    ("exact-match flag compare", KERNELS,
     "while (!epoch_reached(load_acquire_sys(own), e))",
     "while (load_acquire_sys(own) != e)",
     "plain", ["--suite", "quick", "--only", "random"]),
    ("wrong two-shot owner", KERNELS,
     "const int owner = k % W;",
     "const int owner = (k + 1) % W;",
     "plain", ["--suite", "quick", "--only", "random"]),
    ("unbalanced two-shot ownership (block c % nblocks, owner (c / nblocks) % W)", PROTOCOL,
     "  return (block + k / world_size * nblocks) * world_size + k % world_size;\n}\n#if defined(__CUDACC__)\n"
     "__host__ __device__\n#endif\ninline constexpr int64_t block_rounds(int block, int64_t nchunks, int nblocks, "
     "int world_size) {\n  const int64_t groups",
     "  return block + k * nblocks;\n}\n#if defined(__CUDACC__)\n__host__ __device__\n#endif\n"
     "inline constexpr int64_t block_rounds(int block, int64_t nchunks, int nblocks, int world_size) {\n"
     "  return (nchunks - block + nblocks - 1) / nblocks;\n  const int64_t groups",
     "plain", ["--suite", "quick", "--mode", "threads", "--only", "balance"]),
    ("misaligned out written in place by zero-copy calls", PLAN,
     "p.copy_out = p.mode != kRegisteredInPlace && !vec_aligned(out);",
     "p.copy_out = p.mode == kStaged && !vec_aligned(out);",
     "asan", ["--suite", "quick", "--mode", "threads", "--only", "random"]),
    ("launches on two streams not ordered", PLAN,
     "  const bool wait = order.any && order.last != stream;",
     "  const bool wait = false;",
     "plain", ["--suite", "quick", "--mode", "threads", "--only", "streams"]),
    ("tail over-read", KERNELS,
     "__device__ __forceinline__ Vec<T> load_vec(const char* p, int64_t valid) {\n  if (valid >= kVecBytes) {",
     "__device__ __forceinline__ Vec<T> load_vec(const char* p, int64_t valid) {\n  if (valid > 0) {",
     "asan", ["--suite", "quick", "--mode", "threads", "--only", "random"]),
    ("tail over-write", KERNELS,
     "__device__ __forceinline__ void store_vec(char* p, const Vec<T>& x, int64_t valid) {\n  if (valid >= kVecBytes) {",
     "__device__ __forceinline__ void store_vec(char* p, const Vec<T>& x, int64_t valid) {\n  if (valid > 0) {",
     "plain", ["--suite", "quick", "--only", "random"]),
    ("no mid-flag store in one-shot (wrap fix removed)", KERNELS,
     "if (!start_call<W>(a, own_region, e, kind, /*with_mid=*/true)) return;",
     "if (!start_call<W>(a, own_region, e, kind, /*with_mid=*/false)) return;",
     "plain", ["--suite", "quick", "--only", "wrap"]),
    ("descriptor check skipped", KERNELS,
     "  if (agree) return true;",
     "  if (agree || true) return true;",
     "plain", ["--suite", "quick", "--only", "mismatch"]),
    ("mismatch recovery skips the epochs its own kind reserved", KERNELS,
     "  if (threadIdx.x == 0) reinterpret_cast<uint32_t*>(own_region + kEpochOffset)[blockIdx.x] = e;",
     "  if (threadIdx.x == 0) reinterpret_cast<uint32_t*>(own_region + kEpochOffset)[blockIdx.x] = e + desc_epochs_used(kind) - 1;",
     "plain", ["--suite", "quick", "--only", "mismatch"]),
    ("a mismatch the host has not seen yet is not counted (only the first is kept)", KERNELS,
     "  a.status->mismatches += 1;",
     "  a.status->mismatches = 1;",
     "plain", ["--suite", "quick", "--only", "mismatch"]),
    ("the record claimed for its first generation only (the claim word never passes 1)", KERNELS,
     "gave_up ? generation | kClaimSevere : generation)",
     "gave_up ? 1u | kClaimSevere : 1u)",
     "plain", ["--suite", "quick", "--only", "mismatch"]),
    ("deadline ignored (returns as if arrived)", KERNELS,
     "        late = 1;\n        break;",
     "        break;",
     "plain", ["--suite", "quick", "--only", "deadline"]),
    ("abort never looked at (waits for the deadline)", KERNELS,
     "} else if (may_abort && now >= next_abort_look) {",
     "} else if (false && now >= next_abort_look) {",
     "plain", ["--suite", "quick", "--mode", "threads", "--only", "abort"]),
    ("an abort recorded as a deadline", KERNELS,
     "  if (code == kStatusDeadline && load_acquire_sys(&st->aborted) != 0) code = kStatusAborted;\n",
     "",
     "plain", ["--suite", "quick", "--mode", "threads", "--only", "abort"]),
    ("an abort ends every barrier (zero-copy end and mid barriers too)", KERNELS,
     "nullptr, false, a.mode == kStaged, view);",
     "nullptr, false, true, view);",
     "plain", ["--suite", "quick", "--mode", "threads", "--only", "abort"]),
    ("an abort spares only the end barrier (not two-shot's zero-copy mid barrier)", KERNELS,
     "nullptr, false, a.mode == kStaged, view);",
     "nullptr, false, barrier_id != kBarrierEnd, view);",
     "plain", ["--suite", "quick", "--mode", "threads", "--only", "abort"]),
    ("an abort ends no later barrier (not a staged mid barrier either)", KERNELS,
     "nullptr, false, a.mode == kStaged, view);",
     "nullptr, false, false, view);",
     "plain", ["--suite", "quick", "--mode", "threads", "--only", "abort"]),
    ("a deadline does not take the record over from a mismatch the host has not seen", KERNELS,
     "gave_up ? generation | kClaimSevere : generation)",
     "generation)",
     "plain", ["--suite", "quick", "--mode", "threads", "--only", "deadline"]),
    ("kernels launched after a wait gave up run as usual (publishing calls never completed)", KERNELS,
     "  if (gave_up) store_relaxed_gpu(a.gave_up, 1u);",
     "",
     "plain", ["--suite", "quick", "--mode", "threads", "--only", "deadline"]),
    # Reduce-scatter and all-gather.
    ("reduce-scatter reduces the next rank's segment", KERNELS,
     "  const int64_t first = a.rank * segment_chunks;",
     "  const int64_t first = (a.rank + 1) % W * segment_chunks;",
     "plain", ["--suite", "quick", "--mode", "threads", "--only", "segments"]),
    ("reduce-scatter stages segment q at q * S (not segment_stride)", KERNELS,
     "return Piece{input + q * segment + o, own_staging + c * kChunkBytes + lane, segment - o};",
     "return Piece{input + q * segment + o, own_staging + q * segment + o, segment - o};",
     "plain", ["--suite", "quick", "--mode", "threads", "--only", "segments"]),
    ("reduce-scatter segment stride rounded down", KERNELS,
     "  a.segment_stride = segment_stride(call.bytes);",
     "  a.segment_stride = call.bytes / kSegmentUnit * kSegmentUnit;",
     "plain", ["--suite", "quick", "--mode", "threads", "--only", "segments"]),
    ("reduce-scatter reads chunks by segment offset (not by staging chunk: another block's)", KERNELS,
     "  for_block_chunks<W>(first, first + segment_chunks, [&](int64_t c) {",
     "  for_block_chunks<W>(0, segment_chunks, [&](int64_t c) {\n    c += first;",
     "tsan", ["--suite", "tsan", "--mode", "threads", "--only", "segments"]),
    ("all-gather skips rank 0's segment", KERNELS,
     "    for (int q = 0; q < W; ++q) store_piece<Word>(a.out + q * segment + o, v[q], segment - o);",
     "    for (int q = 1; q < W; ++q) store_piece<Word>(a.out + q * segment + o, v[q], segment - o);",
     "plain", ["--suite", "quick", "--mode", "threads", "--only", "segments"]),
    ("misaligned caller side loaded as 16-byte vectors", KERNELS,
     "  return vec_aligned(reinterpret_cast<uintptr_t>(p)) ? load_vec<T>(p, valid) : load_elems<T>(p, valid);",
     "  return load_vec<T>(p, valid);",
     "asan", ["--suite", "quick", "--mode", "threads", "--only", "segments"]),
    ("misaligned caller side stored as 16-byte vectors", KERNELS,
     "  if (vec_aligned(reinterpret_cast<uintptr_t>(p))) {\n    store_vec<T>(p, x, valid);",
     "  if (true) {\n    store_vec<T>(p, x, valid);",
     "asan", ["--suite", "quick", "--mode", "threads", "--only", "segments"]),
    ("all-gather word ignores alignment (always 8 bytes)", KERNELS,
     "uintptr_t(call.bytes) | uintptr_t(8);",
     "uintptr_t(8) | uintptr_t(call.bytes & 0);",
     "asan", ["--suite", "quick", "--mode", "threads", "--only", "segments"]),
    ("reduce-scatter stores no mid flags (wrap fix missing)", KERNELS,
     "segment - o};\n  });\n  if (!start_call<W>(a, own_region, e, call_kind(a), /*with_mid=*/true)) return;\n\n  const char* src[W];",
     "segment - o};\n  });\n  if (!start_call<W>(a, own_region, e, call_kind(a), /*with_mid=*/false)) return;\n\n  const char* src[W];",
     "plain", ["--suite", "quick", "--only", "wrap"]),
    ("all-gather stores no mid flags (wrap fix missing)", KERNELS,
     "segment - o};\n  });\n  if (!start_call<W>(a, own_region, e, call_kind(a), /*with_mid=*/true)) return;\n\n  for_block_chunks",
     "segment - o};\n  });\n  if (!start_call<W>(a, own_region, e, call_kind(a), /*with_mid=*/false)) return;\n\n  for_block_chunks",
     "plain", ["--suite", "quick", "--only", "wrap"]),
    ("agreement round publishes kAgreeOnly whatever it stands for", KERNELS,
     "  a.desc_algo = call.algo == kAgreeOnly ? int(call.agree_algo) : a.algo;",
     "  a.desc_algo = a.algo;",
     "plain", ["--suite", "quick", "--only", "mismatch"]),
    ("alias of reduce-scatter/all-gather not published (in-place bit 0)", PROTOCOL,
     "  if (algo == kReduceScatter) return segment_bytes > 0 && out == in + own_segment;\n"
     "  if (algo == kAllGather) return segment_bytes > 0 && in == out + own_segment;",
     "  if (algo == kReduceScatter || algo == kAllGather) return false;",
     "plain", ["--suite", "quick", "--only", "mismatch"]),
]


def run_mutant(name, path, old, new, flavour, args, workdir, timeout):
    src = workdir / "csrc"
    if src.exists():
        shutil.rmtree(src)
    shutil.copytree(ROOT / "csrc", src)
    target = src / path
    text = target.read_text()
    if text.count(old) != 1:
        return "DOES NOT APPLY", 0.0
    target.write_text(text.replace(old, new))
    exe = workdir / f"harness_{flavour}"
    build.compile_harness(exe, flavour, csrc=src, opt="-O0")  # builds dominate: -O0 compiles fastest
    t0 = time.monotonic()
    try:
        proc = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout,
                              env=build.run_env(flavour))
    except subprocess.TimeoutExpired:
        return "caught (hang)", time.monotonic() - t0
    seconds = time.monotonic() - t0
    if proc.returncode == 0:
        return "SURVIVED", seconds
    out = proc.stdout + proc.stderr
    how = ("data race" if "ThreadSanitizer" in out else
           "ASan" if "AddressSanitizer" in out else
           "UBSan" if "runtime error" in out else "wrong result/status")
    first = next((line for line in out.splitlines()
                  if line.startswith(("FAIL", "sim:", "SUMMARY")) or "runtime error" in line), "")
    return f"caught ({how}) {first[:160]}", seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="run the mutants whose name contains this")
    parser.add_argument("--timeout", type=float, default=300)
    opts = parser.parse_args()
    survived = 0
    with tempfile.TemporaryDirectory(prefix="pyallreduce-mutants-") as tmp:
        for name, path, old, new, flavour, args in MUTANTS:
            if opts.only and opts.only not in name:
                continue
            result, seconds = run_mutant(name, path, old, new, flavour, args, Path(tmp), opts.timeout)
            survived += not result.startswith("caught")
            print(f"| {name} | {flavour} | {result} | {seconds:.1f} s |", flush=True)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
