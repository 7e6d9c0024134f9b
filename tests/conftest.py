import os
import re

import pytest

# Segment names are /dev/shm/pyallreduce-<creator pid>-<random> (transport/host_shm.py).
SEGMENT = re.compile(r"pyallreduce-(\d+)-")


def leaked_segments():
    """Our segments whose creating process is gone: nobody will ever unlink them.
    (A live creator's segment is another run's setup in progress.)"""
    leaked = []
    for name in os.listdir("/dev/shm"):
        m = SEGMENT.match(name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            leaked.append(name)
    return sorted(leaked)


@pytest.fixture(autouse=True)
def no_shm_leftovers():
    """Every test must leave /dev/shm as it found it."""
    before = set(leaked_segments())
    yield
    left = set(leaked_segments()) - before
    assert not left, f"shared-memory segments left behind: {sorted(left)}"
