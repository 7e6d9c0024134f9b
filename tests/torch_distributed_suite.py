"""torch's own distributed test suite against the "pyallreduce" backend: the
tests of torch/testing/_internal/distributed/distributed_test.py
(DistributedTest._DistTestBase), as PyTorch's test/distributed/
test_distributed_spawn.py runs them, world size 2, on CPU.

Not part of the pytest tiers (285 tests, each spawning its ranks: about 23
minutes on 2 cores); run by hand after a change to the backend, once per
backend, and compare the counts (README, "torch's distributed test suite").
torch's test utilities need two packages the project does not otherwise use:

    .venv/bin/python -m pip install expecttest hypothesis

    PYALLREDUCE_SUITE_BACKEND=gloo        .venv/bin/python -m pytest tests/torch_distributed_suite.py -q
    PYALLREDUCE_SUITE_BACKEND=pyallreduce .venv/bin/python -m pytest tests/torch_distributed_suite.py -q

The suite gates its tests on the backend's name (BACKEND == "gloo",
DistTestCases.backend_feature): 118 of them skip for any name but gloo's. The
backend claims to be a drop-in for gloo on CPU, so it runs under gloo's gates:
BACKEND is "gloo" for the suite, and every group the suite asks gloo for
(init_process_group, new_group) is made with PYALLREDUCE_SUITE_BACKEND. The
ranks are spawned: each imports this module, so they get the same mapping.
"""
import os
import tempfile

SUITE_BACKEND = os.environ.setdefault("PYALLREDUCE_SUITE_BACKEND", "pyallreduce")
os.environ["BACKEND"] = "gloo"  # the suite's gates, read when it is imported
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="pyallreduce-torch-suite-"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import pyallreduce  # noqa: E402, F401  (registers the backend)
from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

_init_process_group, _new_group = dist.init_process_group, dist.new_group


def _mapped(backend):
    return SUITE_BACKEND if backend in (None, "gloo", dist.Backend.GLOO) else backend


def init_process_group(*args, backend=None, **kwargs):
    return _init_process_group(*args, backend=_mapped(backend), **kwargs)


def new_group(*args, backend=None, **kwargs):
    return _new_group(*args, backend=_mapped(backend) if backend is not None else None, **kwargs)


dist.init_process_group, dist.new_group = init_process_group, new_group


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


if __name__ == "__main__":
    run_tests()
