import os
import shutil
import signal
import tempfile

import pytest

from pyallreduce.transport.host_shm import leaked_segments

# Compiles started by pytest_collection_finish, killed at the end of the session.
_background = []


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true",
                     help="the inner-loop tier (scripts/test.sh --quick): only the tests marked quick, each with "
                          "its first parameter set")


def pytest_configure(config):
    # Crossovers measured at first use (pyallreduce/calibrate.py) go to a
    # directory of this session's, never the user's cache: each kind and world
    # size is measured once per session, and the session leaves nothing behind.
    # Ranks and bench scripts inherit it.
    os.environ["PYALLREDUCE_CACHE_DIR"] = tempfile.mkdtemp(prefix="pyallreduce-test-cache-")
    config.addinivalue_line(
        "markers", "quick: in the quick tier (--quick) too, with its first parameter set: together these touch "
        "every module's main behaviour in under 3 minutes; every test runs in the full tier (CI)")
    config.addinivalue_line(
        "markers", "cuda_emulated: the GPU stack on the emulated CUDA runtime (tests/emulated); "
        "`pytest tests -m cuda_emulated` builds what they need and runs exactly them")


def first_case(item):
    callspec = getattr(item, "callspec", None)
    return callspec is None or not any(callspec.indices.values())


def pytest_collection_modifyitems(config, items):
    if config.getoption("--quick"):
        keep = [item for item in items if item.get_closest_marker("quick") and first_case(item)]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
    # Modules with long compiles of their own run last (a stable sort keeps the
    # order otherwise); their compiles start with the session, below.
    items.sort(key=lambda item: hasattr(item.module, "start_background_compile"))


def pytest_collection_finish(session):
    """Starts the long compiles that some test modules need (the host-shim
    harness builds, the Triton target compiles) when the session starts, at
    the lowest CPU priority: they use the cores that the multi-process tests
    leave idle while their ranks wait on each other, instead of adding minutes
    at the end. A module that defines start_background_compile(items) gets
    its selected items and returns the started process (or None); its tests
    wait for it."""
    if session.config.option.collectonly:
        return
    modules = dict.fromkeys(item.module for item in session.items)
    for module in modules:
        if hasattr(module, "start_background_compile"):
            proc = module.start_background_compile([item for item in session.items if item.module is module])
            if proc is not None:
                _background.append(proc)


def pytest_sessionfinish(session):
    shutil.rmtree(os.environ["PYALLREDUCE_CACHE_DIR"], ignore_errors=True)
    for proc in _background:  # started in sessions of their own: kill the compilers too
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(autouse=True)
def no_shm_leftovers():
    """Every test must leave /dev/shm as it found it."""
    before = set(leaked_segments())
    yield
    left = set(leaked_segments()) - before
    assert not left, f"shared-memory segments left behind: {sorted(left)}"
