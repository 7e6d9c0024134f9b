"""The CPU reduction is vectorised: each ISA's fp32 kernel holds vector
instructions of its width (a loop left out of line would hold SSE2 code only,
whatever the CPU), and the fp16/bf16 kernels convert 8 lanes at a time (GCC
leaves _Float16 conversions scalar, ~20x slower per byte)."""
import re
import shutil
import subprocess

import pytest

import pyallreduce._C as C

pytestmark = pytest.mark.quick

# function (as objdump -C prints it, up to the opening parenthesis) -> instructions its body must hold
VECTORISED = {
    "reduce_f32_avx512(": ("vaddps", "%zmm", "vmovups %zmm"),
    "reduce_f32_avx2(": ("vaddps", "%ymm", "vmovups %ymm"),
    "reduce_f16_f16c(": ("vcvtph2ps %xmm", "vcvtps2ph $0x", "ymm"),
    "reduce_bf16_avx2(": ("vpmovzxwd", "vpackusdw", "ymm"),
}


@pytest.fixture(scope="module")
def listing():
    if shutil.which("objdump") is None:
        pytest.skip("needs binutils' objdump")
    return subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", C.__file__], capture_output=True,
                          text=True, check=True, timeout=120).stdout


def body_of(listing, name):
    """The disassembly of the function whose header line names `name`."""
    header = re.search(r"^[0-9a-f]+ <[^\n]*::" + re.escape(name) + r"[^\n]*>:$", listing, re.MULTILINE)
    assert header, f"no {name} in {C.__file__}"
    return listing[header.end():listing.find("\n\n", header.end())]


@pytest.mark.parametrize("name", sorted(VECTORISED))
def test_reduction_is_vectorised(listing, name):
    body = body_of(listing, name)
    for instruction in VECTORISED[name]:
        assert instruction in body, f"{name}: no {instruction!r} in its code"
    assert "reduce_tiles" not in body, f"{name} calls an out-of-line reduction loop"
