"""Builds pyallreduce._C with torch.utils.cpp_extension.

CUDA sources are compiled whenever torch is a CUDA build and a CUDA toolkit is
found; nothing here asks whether a GPU is present. Switches (environment):

  PYALLREDUCE_SKIP_CUDA=1            build the CPU backend only
  PYALLREDUCE_CUDA_ARCH_LIST="9.0"   GPU archs (default below; "+PTX" adds PTX)
  CUDA_HOME=/path                    the toolkit (the folder with bin/nvcc)
  NVCC_THREADS=N                     nvcc --threads (default 2)
  MAX_JOBS=N                         parallel compile jobs (ninja)
"""
import os
import re
import shutil
import sys
from pathlib import Path

import setuptools
from setuptools import setup

# pyproject.toml's license is an SPDX string (PEP 639), which setuptools reads from 77 on.
if int(setuptools.__version__.split(".")[0]) < 77:
    sys.exit(f"pyallreduce: building needs setuptools>=77 (found {setuptools.__version__}): "
             "pip install -U 'setuptools>=77', then build again")

ROOT = Path(__file__).parent.resolve()
# Hopper (H100/H200) is the target; Ampere runs the same kernels; PTX for the
# newest arch lets later GPUs JIT it.
DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"
# The extension shares torch's libstdc++ (the shared one) rather than carrying a
# copy of its own: a toolchain whose g++ finds only libstdc++.a links a second
# copy into _C, whose exported iostream and locale symbols then mix with the
# process's copy, and formatting a number in an error message segfaulted (every
# rank, on the first GPU runs). Named before the driver's own -lstdc++, the
# shared library satisfies every reference and the archive adds nothing.
SHARED_LIBSTDCXX = ["-l:libstdc++.so.6"]


def is_cuda_home(path):
    p = Path(path)
    return all((p / f).exists() for f in ("bin/nvcc", "include/cuda_runtime.h", "lib64/libcudart.so"))


def find_cuda_home():
    """The toolkit folder itself, also when the `nvcc` on PATH is a wrapper script."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(nvcc).resolve()
        candidates.append(real.parent.parent)
        try:  # a wrapper script names the real nvcc inside it
            text = real.read_text(errors="ignore")[:4096]
            candidates += [Path(m) for m in re.findall(r"(/\S+?)/bin/nvcc", text)]
        except OSError:
            pass
    candidates += ["/usr/local/cuda"]
    for c in candidates:
        if c and is_cuda_home(c):
            return str(Path(c).resolve())
    return None


def toolkit_version(home):
    """(major, minor) of the toolkit at home, from its cuda.h."""
    found = re.search(r"#define CUDA_VERSION (\d+)", (Path(home) / "include" / "cuda.h").read_text(errors="ignore"))
    version = int(found.group(1)) if found else 0
    return version // 1000, version % 1000 // 10


def want_cuda():
    if os.environ.get("PYALLREDUCE_SKIP_CUDA", "0") == "1":
        return False, "PYALLREDUCE_SKIP_CUDA=1"
    import torch

    if torch.version.cuda is None:
        return False, "torch is a CPU-only build"
    home = find_cuda_home()
    if home is None:
        return False, "no CUDA toolkit found (set CUDA_HOME to the folder holding bin/nvcc)"
    # torch refuses to build with a toolkit of another major version, with a
    # traceback that pip then buries: say it here, with the ways out.
    major, minor = toolkit_version(home)
    torch_major = torch.version.cuda.split(".")[0]
    if str(major) != torch_major:
        sys.exit(f"pyallreduce: the CUDA toolkit at {home} is CUDA {major}.{minor}, but torch {torch.__version__} "
                 f"was built with CUDA {torch.version.cuda}, and CUDA kernels must be built with the major "
                 f"version torch uses. Either set CUDA_HOME to a CUDA {torch_major}.x toolkit (the folder with "
                 f"bin/nvcc, include/ and lib64/: NVIDIA's installer, conda's cuda-toolkit={torch_major}, or "
                 f"NVIDIA's PyPI wheels assembled as scripts/check_old_cuda.sh does), or build the CPU backend "
                 f"only: PYALLREDUCE_SKIP_CUDA=1 pip install --no-build-isolation ...")
    # torch.utils.cpp_extension reads CUDA_HOME when it is first imported.
    os.environ["CUDA_HOME"] = home
    return True, f"CUDA toolkit {home}, torch CUDA {torch.version.cuda}"


def extensions():
    with_cuda, why = want_cuda()
    print(f"pyallreduce: {'building' if with_cuda else 'skipping'} CUDA kernels: {why}", file=sys.stderr)
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    # -g1 overrides the -g in Python's own CFLAGS: line tables keep backtraces
    # readable; full debug info of torch's headers made each file build 1.6x slower.
    cxx = ["-O3", "-g1", "-std=c++20", "-ffp-contract=off", "-fvisibility=hidden"]
    sources = ["csrc/module.cpp", "csrc/backend.cpp", "csrc/cpu/shm.cpp", "csrc/cpu/all_reduce.cpp"]
    if not with_cuda:
        # _C.CUDA_SKIPPED_ON_REQUEST: the CPU-only flavour was asked for (tests say so when they skip).
        macros = [("PYALLREDUCE_CUDA_SKIPPED_ON_REQUEST", None)] if why == "PYALLREDUCE_SKIP_CUDA=1" else []
        return [CppExtension("pyallreduce._C", sources, define_macros=macros, extra_compile_args={"cxx": cxx},
                             libraries=["rt"], extra_link_args=SHARED_LIBSTDCXX)]
    os.environ["TORCH_CUDA_ARCH_LIST"] = os.environ.get("PYALLREDUCE_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
    nvcc = [
        "-O3",
        "-std=c++20",
        "--threads", os.environ.get("NVCC_THREADS", "2"),
        # The report CI checks (tests/test_cuda_build.py): registers, spills.
        "-Xptxas=-v",
        "-fmad=false",  # sums only; keep the bits identical to the CPU and Triton kernels
    ]
    return [
        CUDAExtension(
            "pyallreduce._C",
            # kernels.cu is the only file nvcc compiles (once per GPU
            # architecture); the host glue and IPC are plain C++ for g++.
            sources + ["csrc/cuda/adapter.cpp", "csrc/cuda/glue.cpp", "csrc/cuda/runtime.cpp", "csrc/cuda/kernels.cu"],
            define_macros=[("PYALLREDUCE_WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx + ["-DPYALLREDUCE_WITH_CUDA"], "nvcc": nvcc},
            libraries=["rt"],
            extra_link_args=SHARED_LIBSTDCXX,
        )
    ]


# Objects and ninja's log live here between builds, so a rebuild compiles only
# what changed: pip's editable and wheel builds hand build_ext a new temporary
# build_temp each time, where ninja would find nothing to reuse. Ignored by git.
PERSISTENT_BUILD_TEMP = ROOT / "build" / "temp"


def cmdclass():
    from torch.utils.cpp_extension import BuildExtension

    class Build(BuildExtension.with_options(use_ninja=True)):
        def finalize_options(self):
            super().finalize_options()
            self.build_temp = str(PERSISTENT_BUILD_TEMP)

    return {"build_ext": Build}


setup(
    # Every package by name (tests/test_install.py imports a wheel outside the tree:
    # an editable install would hide one that is missing here).
    packages=["pyallreduce", "pyallreduce.engines", "pyallreduce.transport", "pyallreduce.triton_kernels"],
    package_dir={"pyallreduce": "pyallreduce", "pyallreduce.triton_kernels": "triton_kernels"},
    package_data={"pyallreduce": ["crossovers.json"]},
    ext_modules=extensions(),
    cmdclass=cmdclass(),
)
