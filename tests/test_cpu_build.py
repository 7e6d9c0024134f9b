"""The CPU reduction is vectorised: each ISA's fp32 kernel holds vector
instructions of its width (a loop left out of line would hold SSE2 code only,
whatever the CPU), and the fp16/bf16 kernels convert 8 lanes at a time (GCC
leaves _Float16 conversions scalar, ~20x slower per byte)."""
import ast
import re
import shutil
import subprocess
from pathlib import Path

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


def dynamic_section(path):
    """(the libraries `path` needs, the libstdc++ functions it defines itself)."""
    if shutil.which("readelf") is None or shutil.which("nm") is None:
        pytest.skip("needs binutils' readelf and nm")
    needed = re.findall(r"\(NEEDED\).*\[(.+)\]",
                        subprocess.run(["readelf", "-dW", path], capture_output=True, text=True, check=True).stdout)
    symbols = subprocess.run(["nm", "-DC", "--defined-only", path], capture_output=True, text=True, check=True).stdout
    return needed, re.findall(r"^[0-9a-f]+ T (std::.*)$", symbols, re.MULTILINE)


def test_the_extension_shares_the_process_libstdcxx():
    """A _C carrying its own copy of libstdc++ (a toolchain that finds only
    libstdc++.a links one in) segfaulted on the first GPU machines, on every
    rank, in the first error message that formatted a number: its iostream and
    locale code mixed with the process's copy, which torch loaded."""
    needed, own = dynamic_section(C.__file__)
    assert "libstdc++.so.6" in needed, needed
    assert not own, f"_C defines {len(own)} libstdc++ functions itself, e.g. {own[:3]}"


def test_setup_links_the_shared_libstdcxx_where_gxx_finds_only_the_archive(tmp_path):
    """setup.py's link flag against the GPU image's compiler (a g++ whose -B
    directory holds libstdc++.a and no libstdc++.so): without the flag the
    library carries the archive's copy (so this mimics that compiler), with it
    it needs the shared one."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("needs g++")
    archive = subprocess.run([cxx, "-print-file-name=libstdc++.a"], capture_output=True, text=True).stdout.strip()
    if not archive.startswith("/"):
        pytest.skip("g++ has no libstdc++.a")
    (tmp_path / "only-archive").mkdir()
    (tmp_path / "only-archive" / "libstdc++.a").symlink_to(archive)
    source = tmp_path / "format.cpp"
    source.write_text("#include <sstream>\n#include <string>\n"
                      "std::string format(long v) { std::ostringstream s; s << v; return s.str(); }\n")
    setup = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    flags = ast.literal_eval(re.search(r"^SHARED_LIBSTDCXX = (.*)$", setup, re.MULTILINE).group(1))
    built = {}
    for name, extra in (("without", []), ("with", flags)):
        out = tmp_path / f"{name}.so"
        subprocess.run([cxx, "-shared", "-fPIC", f"-B{tmp_path / 'only-archive'}", str(source), "-o", str(out),
                        *extra], check=True, timeout=120)
        built[name] = dynamic_section(str(out))
    assert "libstdc++.so.6" not in built["without"][0] and built["without"][1], built["without"]
    assert "libstdc++.so.6" in built["with"][0] and not built["with"][1], built["with"]
