"""The multi-process launcher every test uses.

run_ranks(fn, world_size, *args) runs the module-level function
fn(rank, world_size, *args) in `world_size` spawned processes, each with a gloo
process group already initialised. It returns the list of fn's return values
(picklable), in rank order. If any rank raises, exits, or the whole run passes
`timeout` seconds, every child is killed and the test fails with each failing
rank's traceback. It never hangs.

Ranks fork from a server process that has imported torch once
(tests/rank_preload.py) instead of each importing it afresh (~3 s of CPU per
rank, most of a short test's time on 2 cores). A rank still sees the
environment of the moment run_ranks is called, as a spawned process would.

Each rank reports through its own pipe, not a multiprocessing.Queue: a queue's
named semaphores live in /dev/shm and stay there when the test process is
killed outright (a CI timeout kills the whole process group).
"""
import glob
import multiprocessing as mp
from multiprocessing import forkserver
import os
import pickle
import socket
import time
import traceback
from multiprocessing.connection import wait

DEFAULT_TIMEOUT = 120.0
# How long ranks that reported may take to exit, past the timeout if need be:
# gloo's teardown and the interpreter's took over the second they had on a
# loaded machine (torch 2.6 and 2.7 rows, 2026-11-28).
EXIT_GRACE_S = 20.0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_file(path, timeout_s=120.0):
    """Waits outside torch.distributed (whose waits a test may have shortened,
    or aborted) until another rank creates `path`; the test's assertions then
    say what went wrong if it never does."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def raises_when_a_watchdog_aborts(comm, call, pattern, after_s=3.0, bound_s=60.0):
    """Runs call(), which waits for a peer that never comes, while a watchdog
    thread runs comm.abort() after_s into it: the call must raise a
    RuntimeError matching `pattern`, the abort return and close comm, all
    within bound_s, far below the deadlines the tests give (an abort that
    waited for one fails here)."""
    import re
    import threading

    watchdog = threading.Timer(after_s, comm.abort)
    start = time.monotonic()
    watchdog.start()
    try:
        call()
        raise AssertionError("the call returned although the abort ended it")
    except RuntimeError as e:
        assert re.search(pattern, str(e)), f"{pattern!r} not in: {e}"
    watchdog.join(bound_s)
    ended_in = time.monotonic() - start
    assert not watchdog.is_alive() and comm.closed, "the abort did not return, or left the communicator open"
    assert ended_in < bound_s, f"the call and the abort took {ended_in:.0f} s: the abort did not end the wait"


def own_segments_mapped():
    """This process's mappings of our shared-memory segments."""
    with open("/proc/self/maps") as maps:
        return [line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                for line in maps if "/pyallreduce-" in line]


def _rank_main(pickled_fn, rank, world_size, port, env, report, args):
    os.environ.clear()  # the server's environment is that of when it started
    os.environ.update(env)
    # fn's module (a test file, which may ask CUDA about its devices when it
    # loads) is imported only now, under the rank's environment.
    fn = pickle.loads(pickled_fn)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable()  # a rank that crashes (SIGSEGV in native code) shows where, on its stderr
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    except RuntimeError:  # before fn ran: run_ranks may start the ranks again (see _SETUP_ATTEMPTS)
        report.send(("setup error", traceback.format_exc()))
        raise SystemExit(1) from None
    measured = _start_coverage()
    try:
        # Plain pickle copies tensor data into the message. The queue's own pickler
        # would pass tensors as shared-memory file descriptors that the parent fetches
        # from this process later, which fails once this process has exited.
        value = pickle.dumps(fn(rank, world_size, *args))
        report.send(("ok", value))
    except BaseException as e:
        # A gloo group that fn made (its own process group, after the one
        # above) failing to form is the same setup failure: fn may start again.
        # Gloo's own error only, not an assertion that quotes it.
        group_failed = isinstance(e, RuntimeError) and str(e).startswith(_GLOO_MESH_FAILED)
        report.send(("setup error" if group_failed else "error", traceback.format_exc()))
        raise SystemExit(1)
    finally:
        # A rank whose exit hangs prints every thread's stack before run_ranks gives up on it.
        faulthandler.dump_traceback_later(EXIT_GRACE_S / 2)
        if measured is not None:
            measured.stop()
            measured.save()
        if dist.is_initialized():
            # DDP's reference cycles can keep the gloo group alive into interpreter
            # shutdown, which then aborts; collect them while the group still exists.
            import gc

            import torch

            gc.collect()
            # torch < 2.8's gloo can hang destroying a group, pyallreduce or not
            # (scripts/gloo_destroy_hang.py: 2.4.1 13 runs in 39, 2.7.1 12 in 40,
            # 2.14.1 0 in 40, under load); a rank ends in os._exit, which needs
            # no teardown of a plain gloo group. A pyallreduce group is still
            # destroyed: its shutdown is under test.
            if not (dist.get_backend() == "gloo" and torch.__version__ < (2, 8)):
                dist.destroy_process_group()


# The data file (a prefix: each rank adds its own suffix) of coverage.py's
# line counts of the test's function in every rank (tests/emulated/line_coverage.py).
COVERAGE_ENV = "PYALLREDUCE_TEST_PYCOVERAGE"


def _start_coverage():
    data_file = os.environ.get(COVERAGE_ENV)
    if not data_file:
        return None
    import coverage

    measured = coverage.Coverage(data_file=data_file, data_suffix=True, include=["*/pyallreduce/*"])
    measured.start()
    return measured


class RankFailure(AssertionError):
    pass


class _SetupFailure(RankFailure):
    """A gloo group could not form: run_ranks' own (before fn ran), or one
    that fn made (the tests' own "pyallreduce" groups, whose inner backend
    is gloo). Seen as "Gloo connectFullMesh failed ... Connection closed by
    peer" on one rank and "... Connection refused" on the other, now and then
    on this 2-core machine while another test run's ranks ran beside (CI:
    the torch matrix beside the main suite; 3 of 5 clean-clone runs there on
    2026-11-28/29, in different tests; none in 450 groups formed and
    destroyed by 3 loops side by side, nor in 2 runs of tests/test_backend.py
    beside the explorer)."""


_GLOO_MESH_FAILED = "Gloo connectFullMesh failed"

# How often run_ranks starts the ranks when a gloo group fails to form, a
# second longer apart each time. Two attempts back to back both failed once
# (CI at c2375cd, torch 2.4.1's row, beside the main suite's ranks). Where fn
# had begun, it runs again from its start: the tests name the files their
# ranks make (the FileStores of their groups and the markers named after
# them) after a path argument ending in "/store", and those the failed
# attempt made are removed first, or the next attempt's groups would read the
# dead ranks' addresses. Only where no rank reported an error of its own.
_SETUP_ATTEMPTS = 3


def _remove_store_files(args):
    for arg in args:
        if isinstance(arg, str) and os.path.isabs(arg) and os.path.basename(arg) == "store":
            for path in glob.glob(glob.escape(arg) + "*"):
                if os.path.isfile(path):
                    os.remove(path)


def _forkserver():
    """The forkserver context, its server started with rank_preload imported.
    Python 3.11's forkserver drops the sys.path it is given (forkserver.main
    ignores sys_path), and ignores a preload it cannot import: started from
    the repository root, as pytest runs, it found no rank_preload and every
    rank imported torch itself. So the server starts with this folder on
    PYTHONPATH (its environment only: a rank's is the caller's, _rank_main)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["rank_preload"])
    saved = os.environ.get("PYTHONPATH")
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = here + (os.pathsep + saved if saved else "")
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return ctx


def run_ranks(fn, world_size, *args, timeout=DEFAULT_TIMEOUT, env=None, rank_env=None, expect_exit=None):
    """Runs fn on every rank; see the module docstring.

    env: extra environment variables for the children (set before fn's
    module is imported in them); rank_env: a dict of more for each rank.
    expect_exit: {rank: exitcode} for ranks a test kills on purpose; those
    ranks report no result and their exit code must match.
    """
    for attempt in range(1, _SETUP_ATTEMPTS + 1):
        try:
            return _run_ranks_once(fn, world_size, args, timeout, env, rank_env, expect_exit)
        except _SetupFailure:
            if attempt == _SETUP_ATTEMPTS:
                raise
            _remove_store_files(args)
            time.sleep(attempt)


def _run_ranks_once(fn, world_size, args, timeout, env, rank_env, expect_exit):
    ctx = _forkserver()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]  # (read end, write end) per rank
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    rank_env = rank_env or [{}] * world_size
    expect_exit = dict(expect_exit or {})
    procs = [ctx.Process(target=_rank_main, args=(pickle.dumps(fn), r, world_size, port, {**env, **rank_env[r]},
                                                  pipes[r][1], args), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    for _, write_end in pipes:
        write_end.close()  # the children hold them now: a rank that dies shows as end of file
    outcomes = {}
    waiting = {pipes[r][0]: r for r in range(world_size) if r not in expect_exit}
    deadline = time.monotonic() + timeout
    try:
        while waiting and not any(status in ("error", "setup error") for status, _ in outcomes.values()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RankFailure(f"ranks {sorted(waiting.values())} did not finish within {timeout:.0f} s")
            for conn in wait(list(waiting), timeout=min(remaining, 0.5)):
                r = waiting.pop(conn)
                try:
                    outcomes[r] = conn.recv()
                except EOFError:
                    procs[r].join(timeout=5)
                    raise RankFailure(f"ranks {[r]} exited with codes {[procs[r].exitcode]} without reporting") from None
        setup = {r: v for r, (s, v) in outcomes.items() if s == "setup error"}
        errors = {r: v for r, (s, v) in outcomes.items() if s == "error"}
        if setup and not errors:  # a rank's own error is never retried away
            raise _SetupFailure("\n".join(f"--- rank {r}: a gloo group could not form:\n{tb}"
                                          for r, tb in sorted(setup.items())))
        if errors:
            raise RankFailure("\n".join(f"--- rank {r} failed:\n{tb}" for r, tb in sorted({**setup, **errors}.items())))
        exit_by = max(deadline, time.monotonic() + EXIT_GRACE_S)
        for p in procs:
            p.join(timeout=max(0.0, exit_by - time.monotonic()))
        for r, p in enumerate(procs):
            want = expect_exit.get(r, 0)
            if p.exitcode != want:
                raise RankFailure(f"rank {r} exited with code {p.exitcode}, expected {want}")
        return [pickle.loads(outcomes[r][1]) if r in outcomes else None for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        for read_end, _ in pipes:
            read_end.close()
