"""Installing as a user does (README, "Installing into your own environment"):
a wheel built with `pip wheel --no-build-isolation` from this tree, installed
into a fresh virtual environment that has the same torch, imported and used
outside the source tree. The build reuses the objects in build/temp (setup.py),
so after scripts/setup.sh it compiles nothing."""
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

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
