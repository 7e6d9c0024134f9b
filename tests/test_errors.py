"""Failing loudly: bad input, deadlines naming the missing rank, dead ranks,
concurrent threads, abort(), mismatch detection, segment isolation."""
import os
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from launch import own_segments_mapped, raises_when_a_watchdog_aborts, run_ranks
from reference import exact_input, exact_sum


def make_comm(**kw):
    import pyallreduce

    kw.setdefault("max_bytes", 64 << 10)
    kw.setdefault("timeout", 30)
    return pyallreduce.Communicator(**kw)


def expect(exc_type, match, fn, *args, **kwargs):
    with pytest.raises(exc_type, match=match):
        fn(*args, **kwargs)


def bad_input(rank, world):
    import pyallreduce

    comm = make_comm()
    x = torch.ones(8)
    expect(ValueError, "out has shape", comm.all_reduce, x, out=torch.empty(9))
    expect(ValueError, "dtype torch.float16", comm.all_reduce, x, out=torch.empty(8, dtype=torch.float16))
    expect(ValueError, "is on meta but this communicator serves cpu", comm.all_reduce, torch.ones(8, device="meta"))
    expect(ValueError, "out is on meta", comm.all_reduce, x, out=torch.empty(8, device="meta"))
    expect(TypeError, "must be a torch.Tensor", comm.all_reduce, [1.0, 2.0])
    expect(ValueError, "op must be 'sum' or 'avg', got 'max'", comm.all_reduce, x, op="max")
    expect(ValueError, "algo must be 'auto', 'one_shot' or 'two_shot', got 'ring'", comm.all_reduce, x, algo="ring")
    expect(ValueError, "algo must be", comm.all_reduce, torch.ones(2, dtype=torch.int64), algo="ring")
    # out overlapping the input (large messages go in rounds: it would read what it wrote).
    buf = torch.ones(16)
    expect(RuntimeError, "out overlaps the input", comm.all_reduce, buf[:8], out=buf[4:12])
    # ... also when the call is chunked and no chunk's out overlaps that chunk's input.
    chunk = comm.max_bytes // 4
    big = torch.ones(5 * chunk)
    expect(RuntimeError, "out overlaps the input", comm.all_reduce, big[:4 * chunk], out=big[chunk:])
    assert torch.equal(big, torch.ones(5 * chunk)), "a refused call wrote"
    expect(RuntimeError, r"capture\(\) is for CUDA graphs", comm.capture().__enter__)
    # Nothing above moved data: the communicator still works.
    assert torch.equal(comm.all_reduce(x), torch.full((8,), float(world)))
    # Direct op calls are checked too: never out of bounds.
    expect(RuntimeError, "exceed the staging buffer", torch.ops.pyallreduce.all_reduce, torch.ones(1 << 20),
           comm._engine.handle, 0, False)
    expect(RuntimeError, "unknown algorithm id 7", torch.ops.pyallreduce.all_reduce, x, comm._engine.handle, 7, False)
    expect(RuntimeError, "handle 999999 was never created", torch.ops.pyallreduce.all_reduce, x,
           999999, 0, False)
    handle = comm._engine.handle
    comm.close()
    comm.close()  # twice is fine
    expect(RuntimeError, "communicator is closed", comm.all_reduce, x)
    # A closed communicator's handle (kept by a compiled graph, or read by a call before
    # another thread closed it) says that it was closed.
    expect(RuntimeError, rf"handle {handle} was closed \(before this call, or by another thread during it\)",
           torch.ops.pyallreduce.all_reduce, x, handle, 0, False)
    # Construction errors.
    expect(ValueError, "backend must be one of", pyallreduce.Communicator, backend="nccl")
    expect(ValueError, "backend='cuda' needs a CUDA device", pyallreduce.Communicator, backend="cuda", device="cpu")
    expect(ValueError, "timeout must be positive", pyallreduce.Communicator, timeout=0)
    expect(ValueError, "max_bytes must be positive", pyallreduce.Communicator, max_bytes=0)


@pytest.mark.quick
def test_bad_input_raises_clear_errors():
    run_ranks(bad_input, 2, timeout=120)


def missing_rank(rank, world):
    comm = make_comm(timeout=2)
    x = torch.ones(100)
    assert torch.equal(comm.all_reduce(x), torch.full((100,), float(world)))
    if rank == world - 1:
        dist.barrier()  # never calls the second collective; waits for the others to give up
        comm.close()
        return
    start = time.monotonic()
    expect(RuntimeError, rf"start barrier of collective call 2 on this communicator; rank\(s\) {world - 1} never "
           "arrived", comm.all_reduce, x)
    assert time.monotonic() - start < 10
    # The protocol state is broken now: refuse, never continue from it. The
    # message quotes the first line of the failure, without a C++ stack trace.
    with pytest.raises(RuntimeError, match=r"unusable after an earlier failure \(pyallreduce: rank \d waited") as e:
        comm.all_reduce(x)
    assert "Exception raised from" not in str(e.value) and "\n" not in str(e.value).strip(), str(e.value)
    comm.close()  # still works
    dist.barrier()


@pytest.mark.quick
@pytest.mark.parametrize("world", [2, 3])
def test_rank_that_never_calls_makes_the_others_raise_naming_it(world):
    run_ranks(missing_rank, world, timeout=120)


def aborted_wait(rank, world):
    """Communicator.abort() from a watchdog thread ends a call waiting for a
    peer that never comes, at once and not at its deadline, without the peer's
    help; the communicator refuses later calls, and a new one works."""
    comm = make_comm(timeout=600)
    x = torch.ones(100)
    assert torch.equal(comm.all_reduce(x), torch.full((100,), float(world)))
    if rank == world - 1:
        dist.barrier()  # never calls the second collective; waits until the others aborted
        comm._interrupt()  # abort()'s first half alone: no call starts after it
        expect(RuntimeError, "this communicator was aborted; create a new Communicator", comm.all_reduce_, x)
    else:  # the deadline is 600 s; the abort is seen within 0.1 s of it
        raises_when_a_watchdog_aborts(comm, lambda: comm.all_reduce(x),
                                      rf"collective call 2 on this communicator was aborted .* rank {rank} waited "
                                      rf"[0-9.]+ s in the start barrier for rank\(s\) {world - 1}; create a new "
                                      "Communicator", after_s=2.0)
        expect(RuntimeError, "this communicator is closed", comm.all_reduce, x)
        comm.abort()  # twice: nothing
        comm.close()
        dist.barrier()
    comm.abort()  # the last rank gives up on the others the same way, with nothing in flight
    assert not own_segments_mapped(), "a segment stays mapped after abort()"
    with make_comm() as fresh:
        assert torch.equal(fresh.all_reduce(x), torch.full((100,), float(world)))


@pytest.mark.quick
def test_abort_ends_a_wait_for_a_peer_without_the_peer():
    run_ranks(aborted_wait, 2, timeout=180)


def exits_beside_a_waiting_daemon_thread(rank, world):
    """A daemon thread still waits for a peer when the process exits: the
    close at exit (the atexit hook, called here: run_ranks' children end with
    os._exit) interrupts it instead of waiting for its deadline (600 s)."""
    from pyallreduce.live import close_all

    comm = make_comm(timeout=600)
    x = torch.ones(100)
    assert torch.equal(comm.all_reduce(x), torch.full((100,), float(world)))
    if rank == 0:
        errors = []

        def daemon():
            try:
                comm.all_reduce(x)  # rank 1 never calls
            except RuntimeError as e:
                errors.append(str(e))

        thread = threading.Thread(target=daemon, daemon=True)
        thread.start()
        time.sleep(2.0)  # it waits for rank 1 by now
        start = time.monotonic()
        close_all()
        assert time.monotonic() - start < 60 and comm.closed
        thread.join(60)
        assert not thread.is_alive() and len(errors) == 1 and "or at exit) after rank 0 waited" in errors[0], errors
    dist.barrier()  # gloo, outside the communicator


def test_the_close_at_exit_interrupts_a_daemon_thread_waiting_for_a_peer():
    run_ranks(exits_beside_a_waiting_daemon_thread, 2, timeout=120)


def abort_beside_a_close_waiting_for_a_call(rank, world):
    """close() on another thread waits for a call in flight, which waits for a
    peer that never comes (its deadline: 600 s). abort() from a watchdog must
    still end that call, and with it the close, at once."""
    comm = make_comm(timeout=600)
    x = torch.ones(100)
    assert torch.equal(comm.all_reduce(x), torch.full((100,), float(world)))
    if rank == 0:
        closer = threading.Timer(1.5, comm.close)  # by then the call below waits for rank 1
        closing_when_aborted = []

        def watchdog():
            closing_when_aborted.append(closer.is_alive() and comm._closing is not None)
            type(comm).abort(comm)

        comm.abort = watchdog  # what raises_when_a_watchdog_aborts runs
        closer.start()
        raises_when_a_watchdog_aborts(comm, lambda: comm.all_reduce(x),
                                      r"collective call 2 on this communicator was aborted .* for rank\(s\) 1; ",
                                      after_s=3.5)
        assert closing_when_aborted == [True], "the close was not waiting for the call when the abort came"
        closer.join(60)
        assert not closer.is_alive(), "the close beside the aborted call did not return"
        assert not own_segments_mapped(), "a segment stays mapped after the close and the abort"
    dist.barrier()  # gloo, outside the communicator: rank 1 never made the second call
    comm.close()


def test_abort_ends_a_call_that_a_close_on_another_thread_waits_for():
    run_ranks(abort_beside_a_close_waiting_for_a_call, 2, timeout=120)


def sealed_beside_a_call(rank, world):
    """_C.seal_context, the CUDA close's first step (issue 38's second bug: the
    CUDA close freed the status record under a call still running on another
    thread): it returns only once the call in flight on another thread ended,
    later calls are refused, and the handle stays registered for an abort."""
    import threading

    from pyallreduce import _C

    comm = make_comm(timeout=60)
    x = torch.ones(1000)
    want = torch.full((1000,), float(world))
    if rank == 1:
        time.sleep(4.0)  # rank 0's call waits for this one meanwhile
        assert torch.equal(comm.all_reduce(x), want)
        comm.close()
        return None
    # The call writes `out` before it leaves the C++ call, so `out` says whether
    # the call was over when seal_context returned. (Not the threads' clocks:
    # which of them gets the GIL back first after both leave C++ is the
    # scheduler's choice; on a loaded machine that order once flipped.)
    out, ended = torch.zeros(1000), []
    call = threading.Thread(target=lambda: ended.append(comm.all_reduce(x, out=out)))
    call.start()
    time.sleep(1.0)  # the call is waiting for rank 1 by then, on a loaded machine too
    _C.seal_context(comm._engine.handle)
    over_when_sealed = torch.equal(out, want)
    call.join(60)
    assert ended and torch.equal(ended[0], want), "the call in flight failed"
    assert over_when_sealed, "seal_context returned while the call of the other thread was in flight"
    expect(RuntimeError, "this communicator is closed", comm._engine.all_reduce, x, x, _C.ONE_SHOT, False, 0)
    _C.abort_context(comm._engine.handle, False)  # still registered: found, nothing in flight
    comm.close()
    return None


def test_seal_waits_for_a_call_on_another_thread_and_refuses_later_ones():
    run_ranks(sealed_beside_a_call, 2, timeout=120)


def aborted_between_chunks(rank, world):
    """abort() on another thread between two chunks of a call (played here
    by the engine's first chunk calling it): the next chunk raises what
    happened, a RuntimeError, not an AttributeError of the emptied engine."""
    comm = make_comm(max_bytes=4 << 10, timeout=5)
    x = torch.ones(3000)  # 3 chunks of 4 KiB
    assert torch.equal(comm.all_reduce(x), torch.full((3000,), float(world)))
    if rank == 0:
        engine = comm._engine
        real = engine.all_reduce

        def first_chunk_then_abort(*args):
            real(*args)
            comm.abort()

        engine.all_reduce = first_chunk_then_abort
        expect(RuntimeError, "closed or aborted on another thread during this call; create a new Communicator",
               comm.all_reduce, x)
    else:  # rank 0 never comes to the second chunk
        expect(RuntimeError, r"rank\(s\) 0 never arrived", comm.all_reduce, x)
        comm.close()
    dist.barrier()


def test_abort_between_chunks_raises_a_runtime_error():
    run_ranks(aborted_between_chunks, 2, timeout=120)


def killed_rank(rank, world, when):
    comm = make_comm(timeout=60)
    x = exact_input(5000, rank, torch.float32)
    assert torch.equal(comm.all_reduce(x), exact_sum(5000, world, torch.float32))
    if rank == 1:
        if when == "during":
            # Arrive at the start barrier, then die before the mid barrier of a two-shot call.
            comm.all_reduce(x, algo="one_shot")
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    if when == "during":
        comm.all_reduce(x, algo="one_shot")
    # The dead rank's pid is checked while spinning: far sooner than the 60 s deadline.
    expect(RuntimeError, r"rank 1's process has exited", comm.all_reduce, x, algo="two_shot")
    assert time.monotonic() - start < 30
    comm.close()


@pytest.mark.parametrize("when", ["before", "during"])
def test_killed_rank_makes_survivors_raise_and_leaves_no_segment(when):
    run_ranks(killed_rank, 2, when, timeout=120, expect_exit={1: -signal.SIGKILL})
    # (conftest checks /dev/shm) and a fresh set of processes can start right after:
    run_ranks(killed_rank_then_fresh, 2, timeout=60)


def killed_rank_then_fresh(rank, world):
    with make_comm() as comm:
        assert torch.equal(comm.all_reduce(torch.ones(3)), torch.full((3,), float(world)))


def two_threads(rank, world):
    comm = make_comm(timeout=30)
    x = torch.ones(1000)
    if rank == 0:
        result = {}
        blocked = threading.Thread(target=lambda: result.setdefault("y", comm.all_reduce(x)))
        blocked.start()
        time.sleep(0.5)  # the thread now waits in the barrier for rank 1
        expect(RuntimeError, "another thread is inside a collective", comm.all_reduce, x)
        dist.barrier()  # let rank 1 call
        blocked.join()
        assert torch.equal(result["y"], torch.full((1000,), 2.0))
    else:
        dist.barrier()
        assert torch.equal(comm.all_reduce(x), torch.full((1000,), 2.0))
    # Serial use afterwards is fine.
    assert torch.equal(comm.all_reduce(x), torch.full((1000,), 2.0))
    comm.close()


def test_concurrent_calls_from_two_threads_are_rejected_not_interleaved():
    run_ranks(two_threads, 2, timeout=120)


def mismatch(rank, world):
    comm = make_comm(debug=True)
    assert torch.equal(comm.all_reduce(torch.ones(10)), torch.full((10,), 2.0))
    numel = 10 if rank == 0 else 11
    expect(RuntimeError, r"ranks disagree[\s\S]*rank 0: .*10, 'auto'\)[\s\S]*rank 1: .*11, 'auto'\)",
           comm.all_reduce, torch.ones(numel))
    comm.close()
    # Without debug mode the call descriptors catch it (tests/test_agreement.py),
    # also where "auto" picks different algorithms for the two sizes.
    comm = make_comm()
    for algo in ("one_shot", "two_shot", "auto"):
        expect(RuntimeError, "ranks disagree", comm.all_reduce, torch.ones(16384 if rank == 0 else 1), algo=algo)
    comm.close()


# Per rank: the Communicator's arguments. "auto" and "cpu" resolve alike on CPU.
SETTINGS = {
    "different_max_bytes": (lambda rank: {"max_bytes": (64 << 10) * (1 + rank)}, True),
    "same_once_resolved": (lambda rank: {"backend": "cpu" if rank else "auto"}, False),
}


def created_with(rank, world, setting):
    kwargs, differ = SETTINGS[setting]
    if differ:
        expect(ValueError, r"different settings[\s\S]*rank 0: .*max_bytes=65536[\s\S]*rank 1: .*max_bytes=131072",
               make_comm, **kwargs(rank))
        return
    with make_comm(**kwargs(rank)) as comm:
        assert torch.equal(comm.all_reduce(torch.ones(4)), torch.full((4,), float(world)))


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_ranks_must_create_the_communicator_with_the_same_settings(setting):
    run_ranks(created_with, 2, setting, timeout=120)


def test_debug_mode_detects_mismatched_calls():
    run_ranks(mismatch, 2, timeout=120)


@pytest.mark.quick
def test_segments_are_private_and_exclusive():
    from pyallreduce import _C

    name = f"/pyallreduce-test-{os.getpid()}"
    addr = _C.shm_create(name, 8192)
    try:
        mode = stat.S_IMODE(os.stat(f"/dev/shm{name}").st_mode)
        assert mode == 0o600, oct(mode)
        with pytest.raises(RuntimeError, match="File exists"):
            _C.shm_create(name, 8192)
        with pytest.raises(RuntimeError, match="expected uid"):
            _C.shm_map(name, 4096)  # the wrong size is refused
    finally:
        _C.shm_unmap(addr, 8192)
        assert _C.shm_remove(name)
    assert not _C.shm_remove(name)  # already gone is not an error


# What fails, on which rank, and what every rank then raises.
SEGMENT_FAILURES = {
    "create": ("shm_create", 1, "creating the shared-memory segments failed on rank 1: injected"),
    "map": ("shm_map", 0, "mapping the peers' shared-memory segments failed on rank 0: injected"),
}


def segment_failing_on_one_rank(rank, world, step):
    """A segment that cannot be created or mapped on one rank (a full /dev/shm):
    every rank raises the same error at construction, instead of the others
    waiting for it in a collective it never joins; nothing stays mapped, and
    the next communicator works."""
    from pyallreduce import _C

    function, failing, error = SEGMENT_FAILURES[step]
    real = getattr(_C, function)

    def fail(*args):
        raise RuntimeError(f"injected {function} failure")

    setattr(_C, function, fail if rank == failing else real)
    try:
        expect(RuntimeError, error, make_comm)
    finally:
        setattr(_C, function, real)
    assert own_segments_mapped() == [], own_segments_mapped()
    with make_comm() as comm:
        assert torch.equal(comm.all_reduce(torch.ones(3)), torch.full((3,), float(world)))


@pytest.mark.parametrize("step", sorted(SEGMENT_FAILURES))
def test_a_segment_failing_on_one_rank_fails_on_every_rank(step):
    run_ranks(segment_failing_on_one_rank, 2, step, timeout=120)


def dev_shm_too_small(rank, world):
    """Run in a /dev/shm of 100 MiB: the default max_bytes (two 32 MiB staging
    buffers per rank) does not fit, and a smaller one does."""
    import pyallreduce

    with pytest.raises(RuntimeError, match=r"does not fit in /dev/shm .* Give /dev/shm more room \(Docker: "
                                           r"--shm-size=1g or --ipc=host\) or create the Communicator with a "
                                           r"smaller max_bytes") as raised:
        pyallreduce.Communicator(device="cpu", timeout=30)
    with make_comm(max_bytes=8 << 20) as comm:
        x = exact_input(1 << 20, rank, torch.float32)
        assert torch.equal(comm.all_reduce(x), exact_sum(1 << 20, world, torch.float32))
    return str(raised.value)


SMALL_DEV_SHM = """set -e
mount -t tmpfs -o size=100m tmpfs /dev/shm
{python} -c 'import launch, test_errors; print(launch.run_ranks(test_errors.dev_shm_too_small, 2, timeout=150))'
echo "left in /dev/shm: $(ls -A /dev/shm | wc -l)"
"""


def test_a_dev_shm_too_small_raises_what_to_do_instead_of_crashing():
    """The default /dev/shm of a Docker container (64 MiB) holds less than one
    rank's default segment. tmpfs gives a file's pages at first touch, so a
    segment merely sized there killed the ranks with SIGBUS inside their first
    large collective; now construction raises on every rank what to do. Runs
    in a private mount namespace whose /dev/shm is a 100 MiB tmpfs."""
    if subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                      capture_output=True).returncode != 0:
        pytest.skip("needs a private mount namespace with its own /dev/shm (unshare -m and mount: root)")
    here = os.path.dirname(os.path.abspath(__file__))
    script = SMALL_DEV_SHM.format(python=sys.executable)
    run = subprocess.Popen(["unshare", "-m", "sh", "-c", script], cwd=here, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    assert run.returncode == 0, out
    assert "left in /dev/shm: 0" in out, out
    assert out.count("does not fit in /dev/shm") >= 2, out  # each rank's message, naming the ranks


UNMAPPABLE_SEGMENT = """
import os, resource
from pyallreduce import _C
name = f"/pyallreduce-test-{os.getpid()}"
used = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
resource.setrlimit(resource.RLIMIT_AS, (used + (16 << 20), resource.RLIM_INFINITY))
try:
    _C.shm_create(name, 256 << 20)  # its pages reserved, then its mapping refused
    print("created")
except RuntimeError as e:
    print("raised:", e)
left = os.path.exists("/dev/shm" + name)
if left:
    _C.shm_remove(name)  # the test fails; /dev/shm stays clean
print("left:", left)
"""


def test_a_segment_that_cannot_be_mapped_is_not_left_behind():
    """Its pages are reserved before it is mapped: a mapping that fails
    (address space exhausted, here RLIMIT_AS) must not leave the name, which
    nobody would ever remove, holding them."""
    run = subprocess.run([sys.executable, "-c", UNMAPPABLE_SEGMENT], capture_output=True, text=True, timeout=120)
    assert "raised: pyallreduce: mmap of shared-memory segment" in run.stdout, run.stdout + run.stderr
    assert "left: False" in run.stdout, run.stdout
