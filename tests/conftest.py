import pytest

from pyallreduce.transport.host_shm import leaked_segments


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true",
                     help="the inner-loop tier (scripts/test.sh --quick): only the tests marked quick, each with "
                          "its first parameter set")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "quick: in the quick tier (--quick) too, with its first parameter set: together these touch "
        "every module's main behaviour in under 3 minutes; every test runs in the full tier (CI)")


def first_case(item):
    callspec = getattr(item, "callspec", None)
    return callspec is None or not any(callspec.indices.values())


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--quick"):
        return
    keep = [item for item in items if item.get_closest_marker("quick") and first_case(item)]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep


@pytest.fixture(autouse=True)
def no_shm_leftovers():
    """Every test must leave /dev/shm as it found it."""
    before = set(leaked_segments())
    yield
    left = set(leaked_segments()) - before
    assert not left, f"shared-memory segments left behind: {sorted(left)}"
