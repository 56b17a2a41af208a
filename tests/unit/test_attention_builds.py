"""The C paged attention built for each ISA this CPU executes gives the portable build's bits and
stays within 1e-4 of a double-precision reference: tests/unit/csrc/attention_check.c, built with
the library's float flags and each ISA's target flags (cpu_kernels). The Arm builds
run under qemu in tests/unit/test_arm_kernels.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kvserve.ops import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "kvserve" / "ops" / "csrc"
CHECK = Path(__file__).resolve().parent / "csrc" / "attention_check.c"
CC = shutil.which("cc") or shutil.which("gcc")
# cpu_kernels._BASE_FLAGS' float flags, at -O1: without contraction or fast-math the bits do not
# depend on the optimization level, and -O3 takes ~50 s to compile this file here (-O1: ~9 s).
EXACT = ["-O1", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno", "-fno-trapping-math"]


def attention_check_output(cc: str, flags: list[str], exe: Path, runner: list[str] = ()) -> str:
    """attention_check built with `flags` and run (under `runner`, e.g. qemu): its whole output,
    after checking that every case passed the reference."""
    p = subprocess.run(
        [
            cc,
            *EXACT,
            *flags,
            f"-I{CSRC}",
            str(CHECK),
            str(CSRC / "paged_attention.c"),
            "-lm",
            "-o",
            str(exe),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, f"{cc} {flags} failed:\n{p.stderr}"
    run = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=300)
    last = run.stdout.splitlines()[-1] if run.stdout else ""
    assert run.returncode == 0 and last.startswith("reference check of 144 cases: passed"), (
        run.stdout[-3000:] + run.stderr
    )
    return run.stdout


def first_difference(a: str, b: str) -> str:
    for la, lb in zip(a.splitlines(), b.splitlines()):
        if la != lb:
            return f"\n  {la}\n  {lb}"
    return " (different lengths)"


@pytest.mark.skipif(CC is None, reason="no C compiler")
@pytest.mark.parametrize("isa", [i for i in cpu_kernels.ISAS if i not in ("portable", "neon")])
def test_attention_gives_the_portable_bits_on_every_host_build(isa, tmp_path):
    if isa not in cpu_kernels.host_isas():
        pytest.skip(f"this CPU does not execute the {isa} build")
    portable = attention_check_output(CC, [], tmp_path / "portable")
    got = attention_check_output(CC, cpu_kernels.ISA_FLAGS[isa], tmp_path / isa)
    assert got == portable, f"{isa} and portable attention differ:" + first_difference(
        got, portable
    )
