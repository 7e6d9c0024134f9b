"""tests/launch.py itself: when the ranks' gloo group cannot form (before any
rank runs the test's function) or one that the function makes cannot,
run_ranks starts the ranks again, and then fails saying so; a rank that
reported but never exits fails the test, within its timeout."""
import os
import socket
import threading
import time

import pytest

import launch

pytestmark = pytest.mark.quick


def _rank(rank, world):
    return rank


@pytest.fixture
def closing_port():
    """A port whose every connection is closed at once: no TCPStore there."""
    with socket.socket() as bad:
        bad.bind(("127.0.0.1", 0))
        bad.listen()

        def slam():
            try:
                while True:
                    conn, _ = bad.accept()
                    conn.close()
            except OSError:  # closed at the end of the test
                pass

        threading.Thread(target=slam, daemon=True).start()
        yield bad.getsockname()[1]


def test_a_group_that_fails_to_form_is_started_again(monkeypatch, closing_port):
    real, ports = launch.free_port, []

    def port():
        ports.append(1)
        return closing_port if len(ports) == 1 else real()

    monkeypatch.setattr(launch, "free_port", port)
    assert launch.run_ranks(_rank, 2, timeout=120) == [0, 1]
    assert len(ports) == 2


def test_a_group_that_never_forms_fails_saying_so(monkeypatch, closing_port):
    monkeypatch.setattr(launch, "free_port", lambda: closing_port)
    with pytest.raises(launch.RankFailure, match="a gloo group could not form"):
        launch.run_ranks(_rank, 2, timeout=120)


def _own_group_fails_to_form_at_first(rank, world, store):
    """Attempt 1: rank 0's own group fails as gloo's do (after a marker named
    after the store was made); rank 1 waits to be killed. Attempt 2 starts
    without the first attempt's files, and its group forms."""
    import torch
    import torch.distributed as dist

    attempts = os.environ["ATTEMPTS_FILE"]
    if rank == 0:
        with open(attempts, "a") as f:
            f.write("started\n")
    dist.barrier()  # run_ranks' group: rank 1 reads after rank 0 wrote
    if open(attempts).read().count("started") == 1:
        if rank == 0:
            open(store + ".done", "w").close()
            raise RuntimeError("Gloo connectFullMesh failed with [pair.cc:534] Connection closed by peer (simulated)")
        time.sleep(120)
    assert not os.path.exists(store + ".done"), "the retry found the failed attempt's marker"
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    x = torch.ones(2)
    dist.all_reduce(x)
    return x.tolist()


def test_a_group_the_test_makes_that_fails_to_form_starts_the_test_again(tmp_path):
    attempts = tmp_path / "attempts"
    assert launch.run_ranks(_own_group_fails_to_form_at_first, 2, str(tmp_path / "store"), timeout=120,
                            env={"ATTEMPTS_FILE": str(attempts)}) == [[2.0, 2.0]] * 2
    assert attempts.read_text().count("started") == 2


def _an_assertion_that_quotes_gloos_error(rank, world, store):
    """Rank 1's own check fails, its message quoting gloo's error (as a test
    that expected a group to fail differently would): a real failure."""
    with open(os.environ["ATTEMPTS_FILE"], "a") as f:
        f.write(f"rank {rank} started\n")
    if rank == 1:
        raise AssertionError("expected the peer's error, got: Gloo connectFullMesh failed with [pair.cc:534] "
                             "Connection closed by peer (quoted)")
    time.sleep(120)


def test_a_real_error_is_not_retried_away_as_a_group_that_failed_to_form(tmp_path):
    """Only gloo's own RuntimeError restarts a test, not a failure whose
    message or traceback merely mentions it."""
    attempts = tmp_path / "attempts"
    with pytest.raises(launch.RankFailure, match="expected the peer's error"):
        launch.run_ranks(_an_assertion_that_quotes_gloos_error, 2, str(tmp_path / "store"), timeout=120,
                         env={"ATTEMPTS_FILE": str(attempts)})
    assert attempts.read_text().count("rank 1 started") == 1


def _rank_that_never_exits(rank, world):
    if rank == 1:  # not a daemon: the rank's process waits for it as it exits
        threading.Thread(target=threading.Event().wait).start()
    return rank


def test_a_rank_that_reported_but_never_exits_fails_the_test(monkeypatch):
    monkeypatch.setattr(launch, "EXIT_GRACE_S", 1.0)
    start = time.monotonic()
    with pytest.raises(launch.RankFailure, match=r"rank 1 exited with code None, expected 0"):
        launch.run_ranks(_rank_that_never_exits, 2, timeout=10)
    assert time.monotonic() - start < 40
