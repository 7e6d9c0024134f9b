"""What the tests of the bench/ scripts share: importing a script as a module
and the environment in which a script spawns its own ranks."""
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))  # the scripts' helper module, as when they run as scripts

from local_ranks import TORCHRUN_ENV  # noqa: E402


def load(name):
    """bench/<name>.py as a module (its main() not run)."""
    spec = importlib.util.spec_from_file_location(name, BENCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def clean_env():
    """No torchrun variables, so a script spawns its own ranks; one thread each."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_script(cmd, timeout):
    """Runs a bench script in its own process group; on timeout kills the whole
    group (the ranks it spawned too, which would otherwise outlive the test) and
    fails the test with the output so far."""
    import pytest

    proc = subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} did not finish in {timeout} s:\n{stdout}\n{stderr}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
