"""The CPU reduction is vectorised for every ISA level the build targets: each
target clone of the fp32 reduction holds vector instructions of its width (a
loop left out of line would hold SSE2 code only, whatever the CPU)."""
import shutil
import subprocess

import pytest

import pyallreduce._C as C

CLONES = {"arch_skylake_avx512": ("ymm", "zmm"), "arch_haswell": ("ymm",)}


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump")
def test_every_target_clone_of_the_reduction_is_vectorised():
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", C.__file__], capture_output=True,
                             text=True, check=True, timeout=120).stdout
    for clone, registers in CLONES.items():
        header = f"reduce_f32(float const* const*, int, float*, float*, long, bool) [clone .{clone}]>:"
        start = listing.find(header)
        assert start >= 0, f"no {clone} clone of reduce_f32 in {C.__file__}"
        body = listing[start:listing.find("\n\n", start)]
        assert any(reg in body for reg in registers), f"the {clone} clone has no {registers} instructions"
        assert "reduce_tiles" not in body, f"the {clone} clone calls an out-of-line reduction loop"
