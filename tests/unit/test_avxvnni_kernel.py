"""The AVX-VNNI kernel (kvserve/ops/csrc/gguf_gemv_avxvnni.c) gives the portable kernel's bits.

CPUs with AVX-VNNI (Intel Alder Lake and later client chips) run its VEX build (-mavxvnni), and
the test suite runs that build like every other the host executes. A host with AVX-512 VNNI and
AVX-512VL executes the same source through the EVEX encoding of the same instruction
(-mavx512vnni -mavx512vl): this file builds tests/unit/csrc/gemv_check.c that way and compares
every output bit with the portable kernel's, and checks that the VEX build compiles (qemu-user
7.2 lists avx-vnni but does not implement it, so nothing here can execute the VEX encoding).
tests/unit/test_mixed_parts_runs.py runs the EVEX build on mixed parts' runs of one-part blocks.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kvserve.ops import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "kvserve" / "ops" / "csrc"
CHECK = Path(__file__).resolve().parent / "csrc" / "gemv_check.c"
EXACT = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno", "-fno-trapping-math"]
CC = shutil.which("cc") or shutil.which("gcc")
X86_VNNI_EVEX = ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512vl", "-mavx512vnni"]

pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler")


def _build(flags: list[str], kernel: str, out: Path) -> Path:
    p = subprocess.run(
        [
            CC,
            *EXACT,
            *flags,
            f"-I{CSRC}",
            str(CHECK),
            str(CSRC / "gguf_gemv.c"),
            str(CSRC / kernel),
            "-lm",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, f"{kernel} failed to build:\n{p.stderr}"
    return out


def _run(exe: Path) -> subprocess.CompletedProcess:
    p = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and ": passed," in p.stdout.splitlines()[-1], (
        p.stdout[-2000:] + p.stderr
    )
    return p


@pytest.mark.skipif(
    "avx512vnni" not in cpu_kernels.host_isas(),
    reason="needs AVX-512 VNNI + VL to execute the EVEX form",
)
def test_avxvnni_kernel_gives_the_portable_bits(tmp_path):
    vnni = _run(_build(X86_VNNI_EVEX, "gguf_gemv_avxvnni.c", tmp_path / "check_avxvnni"))
    portable = _run(_build([], "gguf_gemv_portable.c", tmp_path / "check_portable"))
    assert "gemv_check: kernel avxvnni" in vnni.stderr, vnni.stderr
    assert vnni.stdout == portable.stdout, next(
        (
            f"first difference:\n  {a}\n  {b}"
            for a, b in zip(vnni.stdout.splitlines(), portable.stdout.splitlines())
            if a != b
        ),
        "different lengths",
    )


def test_avxvnni_vex_build_compiles(tmp_path):
    """The build AVX-VNNI CPUs run: the library's flags for it, every common source with it."""
    probe = subprocess.run(
        [CC, "-mavxvnni", "-x", "c", "-c", "-", "-o", str(tmp_path / "probe.o")],
        input="int f(void){return 0;}\n",
        capture_output=True,
        text=True,
    )
    if probe.returncode:
        pytest.skip(f"{CC} has no -mavxvnni (GCC 11+ / clang 12+)")
    sources = [
        CSRC / n
        for n in ("gguf_gemv.c", "paged_attention.c", "layer_stack.c", "gguf_gemv_avxvnni.c")
    ]
    flags = cpu_kernels.ISA_FLAGS["avxvnni"]
    assert "-mavxvnni" in flags
    p = subprocess.run(
        [
            CC,
            *EXACT,
            *flags,
            "-fPIC",
            "-shared",
            f"-I{CSRC}",
            *map(str, sources),
            "-lm",
            "-o",
            str(tmp_path / "libavxvnni.so"),
        ],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    nm = (
        subprocess.run(
            ["objdump", "-d", str(tmp_path / "libavxvnni.so")], capture_output=True, text=True
        )
        if shutil.which("objdump")
        else None
    )
    if nm is not None:
        assert "vpdpbusd" in nm.stdout and "zmm" not in nm.stdout
