import pytest

from pyallreduce.transport.host_shm import leaked_segments


@pytest.fixture(autouse=True)
def no_shm_leftovers():
    """Every test must leave /dev/shm as it found it."""
    before = set(leaked_segments())
    yield
    left = set(leaked_segments()) - before
    assert not left, f"shared-memory segments left behind: {sorted(left)}"
