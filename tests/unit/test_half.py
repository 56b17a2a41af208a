"""float16 KV rows: the C kernels' own float <-> half conversions (kvserve/ops/csrc/half.h) give
the bits of the x86 F16C instructions (round to nearest even) on every float of the range that
matters and a stride through the rest (tests/unit/csrc/half_check.c), so the portable and NEON
builds store and read the same rows as the x86 ones, and as torch's .half()."""

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kvserve.ops import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]
CC = shutil.which("cc") or shutil.which("gcc")


@pytest.mark.skipif(CC is None, reason="no C compiler")
@pytest.mark.skipif(
    "avx2" not in cpu_kernels.host_isas(), reason="needs an x86 CPU with F16C (the reference)"
)
def test_half_conversions_match_f16c(tmp_path):
    exe = tmp_path / "half_check"
    build = subprocess.run(
        [
            CC,
            "-O2",
            "-mf16c",
            f"-I{ROOT / 'kvserve/ops/csrc'}",
            str(ROOT / "tests/unit/csrc/half_check.c"),
            "-o",
            str(exe),
        ],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "half_check: passed" in run.stdout, run.stdout[-2000:]


def test_torch_half_rounds_like_the_kernels():
    """The PyTorch write path (.to(float16)) rounds to nearest even too: ties go to the even
    half."""
    ties = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 65520.0, 2**-25, 3 * 2**-25])
    assert torch.equal(
        ties.half().float(), torch.tensor([1.0, 1 + 2**-9, float("inf"), 0.0, 2**-23])
    )
