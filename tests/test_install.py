"""Installing as a user does (README, "Installing into your own environment"):
a wheel built with `pip wheel --no-build-isolation` from this tree, installed
into a fresh virtual environment that has the same torch, imported and used
outside the source tree. The build reuses the objects in build/temp (setup.py),
so after scripts/setup.sh it compiles nothing."""
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

USE = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    import pyallreduce
    assert pyallreduce.__file__.startswith(sys.prefix), pyallreduce.__file__
    dist.init_process_group("gloo", init_method="file://" + os.path.join(os.getcwd(), "store"), rank=0,
                            world_size=1)
    with pyallreduce.Communicator(device="cpu") as comm:
        x = torch.arange(1000, dtype=torch.float32)
        assert torch.equal(comm.all_reduce(x), x)
    dist.destroy_process_group()
    print("used", pyallreduce.__file__)
""")


def run(cmd, **kw):
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


def test_wheel_installs_into_a_fresh_environment_and_works_outside_the_tree(tmp_path):
    wheels = tmp_path / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", str(wheels),
         str(ROOT)], cwd=ROOT)
    [wheel] = wheels.glob("pyallreduce-*.whl")
    env = tmp_path / "env"
    run([sys.executable, "-m", "venv", str(env)])
    python = env / "bin" / "python"
    # The same torch: this environment's packages, after the new one's own (a plain
    # path, so the editable install's import hook here is not picked up).
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "same_torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)])
    out = tmp_path / "elsewhere"
    out.mkdir()
    used = run([str(python), "-c", USE], cwd=out).stdout
    assert f"used {site}" in used, used


def test_a_toolkit_of_another_cuda_major_stops_the_build_saying_what_to_do(tmp_path):
    """torch's own check would raise a traceback that pip buries under a
    misleading one: setup.py stops first, naming both versions and the ways out."""
    import torch

    if torch.version.cuda is None:
        pytest.skip("a CPU-only torch builds no CUDA kernels, whatever the toolkit")
    other = 12 if int(torch.version.cuda.split(".")[0]) != 12 else 13
    home = tmp_path / "cuda"
    for f in ("bin/nvcc", "include/cuda_runtime.h", "lib64/libcudart.so"):
        (home / f).parent.mkdir(parents=True, exist_ok=True)
        (home / f).touch()
    (home / "include" / "cuda.h").write_text(f"#define CUDA_VERSION {other}080\n")
    done = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "CUDA_HOME": str(home)})
    assert done.returncode != 0
    assert (f"the CUDA toolkit at {home} is CUDA {other}.8, but torch {torch.__version__} was built with CUDA "
            f"{torch.version.cuda}") in done.stderr, done.stderr[-3000:]
    assert "PYALLREDUCE_SKIP_CUDA=1 pip install --no-build-isolation" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
