"""Mixed activation parts with planted two-part blocks (tests/unit/csrc/mixed_runs.c): every x86
kernel build the host executes gives the portable kernel's bits, every kind and M = 1..9. The
AVX2, AVX-VNNI and NEON kernels walk runs of one-part blocks (GGUF_BLOCK_RUNS in gguf_gemv.h) and
the AVX-512 VNNI kernel skips a row's zero xb: each must take the two-part products wherever any
row of its pass has them. AVX-VNNI runs through its EVEX twin on AVX-512 VNNI hosts
(test_avxvnni_kernel.py); NEON runs under qemu (test_arm_kernels.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kvserve.ops import cpu_kernels
from tests.unit.test_avxvnni_kernel import EXACT, X86_VNNI_EVEX

CSRC = Path(__file__).resolve().parents[2] / "kvserve" / "ops" / "csrc"
DRIVER = Path(__file__).resolve().parent / "csrc" / "mixed_runs.c"
CC = shutil.which("cc") or shutil.which("gcc")
M_MAX, KINDS = 9, 5


def mixed_runs_outputs(
    cc: str, flags: list[str], kernel: str, exe: Path, runner: list[str] = ()
) -> list[str]:
    """The driver built with `kernel`'s source and run (under `runner`, e.g. qemu): one line of
    output bits per kind and M."""
    p = subprocess.run(
        [
            cc,
            *EXACT,
            *flags,
            f"-I{CSRC}",
            str(DRIVER),
            str(CSRC / "gguf_gemv.c"),
            str(CSRC / f"gguf_gemv_{kernel}.c"),
            "-lm",
            "-o",
            str(exe),
        ],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, f"{kernel} failed to build:\n{p.stderr}"
    run = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and f"mixed_runs: kernel {kernel}" in run.stderr, (
        run.stdout[-2000:] + run.stderr
    )
    lines = run.stdout.splitlines()
    assert len(lines) == KINDS * M_MAX
    return lines


def assert_same_bits(got: list[str], portable: list[str], kernel: str) -> None:
    for a, b in zip(got, portable):
        assert a == b, f"{kernel} differs from portable on {a.split(':')[0]}"


BUILDS = {
    "avx512vnni": ("avx512vnni", cpu_kernels.ISA_FLAGS["avx512vnni"]),
    "avx2": ("avx2", cpu_kernels.ISA_FLAGS["avx2"]),
    "avxvnni-evex": ("avxvnni", X86_VNNI_EVEX),
}


@pytest.mark.skipif(CC is None, reason="no C compiler")
@pytest.mark.parametrize("build", list(BUILDS))
def test_mixed_parts_runs_give_the_portable_bits(build, tmp_path):
    kernel, flags = BUILDS[build]
    needs = "avx512vnni" if build == "avxvnni-evex" else build
    if needs not in cpu_kernels.host_isas():
        pytest.skip(f"this CPU does not execute the {needs} build")
    portable = mixed_runs_outputs(CC, [], "portable", tmp_path / "portable")
    assert_same_bits(mixed_runs_outputs(CC, flags, kernel, tmp_path / build), portable, build)
