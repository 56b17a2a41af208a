# The Arm NEON GEMV kernel, cross-compiled and run under qemu-user against the portable reference.
#
# Needs the Debian/Ubuntu packages gcc-aarch64-linux-gnu, libc6-dev-arm64-cross (its C library
# and headers, only a Recommends of the compiler) and qemu-user (skipped without them; .ci/run
# installs them when it can). By hand, from the repository root:
#
#   sudo apt-get install -y --no-install-recommends gcc-aarch64-linux-gnu libc6-dev-arm64-cross \
#       qemu-user
#   S=kvserve/ops/csrc
#   F="-O3 -ffp-contract=off -fno-fast-math -fno-math-errno -fno-trapping-math -static -I$S"
#   aarch64-linux-gnu-gcc $F -march=armv8.2-a+dotprod tests/unit/csrc/gemv_check.c $S/gguf_gemv.c \
#       $S/gguf_gemv_neon.c -lm -o /tmp/gemv_neon
#   aarch64-linux-gnu-gcc $F -march=armv8-a tests/unit/csrc/gemv_check.c $S/gguf_gemv.c \
#       $S/gguf_gemv_portable.c -lm -o /tmp/gemv_portable
#   qemu-aarch64 -cpu max /tmp/gemv_neon > /tmp/neon.txt &&
#       qemu-aarch64 -cpu max /tmp/gemv_portable > /tmp/portable.txt
#   diff /tmp/neon.txt /tmp/portable.txt && tail -1 /tmp/neon.txt
#   (no diff; the last line of neon.txt reads "reference check ...: passed")
#   (gemv_check --all prints every output's bits, to find the first differing value.)
#
# or just: python3 -m pytest -q -p no:cacheprovider tests/unit/test_arm_kernels.py
"""The NEON kernel (kvserve/ops/csrc/gguf_gemv_neon.c) gives the portable kernel's bits on
aarch64 (under qemu-aarch64 -cpu max), also on mixed parts' runs of one-part blocks
(tests/unit/csrc/mixed_runs.c), both give the bits of a native x86/host build, so does the paged
attention's NEON build (tests/unit/csrc/attention_check.c), and the whole C kernel library
cross-compiles for aarch64 with the NEON kernel."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.unit.test_attention_builds import attention_check_output, first_difference
from tests.unit.test_mixed_parts_runs import assert_same_bits, mixed_runs_outputs

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "kvserve" / "ops" / "csrc"
CHECK = Path(__file__).resolve().parent / "csrc" / "gemv_check.c"
CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
# The float flags of every GGUF GEMV library (cpu_kernels._BASE_FLAGS; gguf_gemv.h: identical bits).
EXACT = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno", "-fno-trapping-math"]
NEON_ARCH = "-march=armv8.2-a+dotprod"


def _cross_libc_missing() -> bool:
    """The cross compiler is there but cannot build a static C program (no aarch64 C library)."""
    if shutil.which(CROSS_CC) is None:
        return False
    p = subprocess.run(
        [CROSS_CC, "-static", "-x", "c", "-", "-o", "/dev/null"],
        input="#include <stdint.h>\nint main(void){return 0;}\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    return p.returncode != 0


pytestmark = [
    pytest.mark.skipif(
        shutil.which(CROSS_CC) is None or shutil.which(QEMU) is None,
        reason=f"needs {CROSS_CC} and {QEMU} (Debian packages gcc-aarch64-linux-gnu and qemu-user)",
    ),
    pytest.mark.skipif(
        _cross_libc_missing(),
        reason=f"{CROSS_CC} has no aarch64 C library (Debian package libc6-dev-arm64-cross)",
    ),
]


def _run(cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)


def _build(cc: str, arch: list[str], kernel: str, out: Path, static: bool) -> Path:
    p = _run(
        [
            cc,
            *EXACT,
            *arch,
            *(["-static"] if static else []),
            f"-I{CSRC}",
            CHECK,
            CSRC / "gguf_gemv.c",
            CSRC / kernel,
            "-lm",
            "-o",
            out,
        ]
    )
    assert p.returncode == 0, f"{cc} {kernel} failed:\n{p.stderr}"
    return out


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """gemv_check's output for the NEON and the portable kernel under qemu-aarch64."""
    tmp = tmp_path_factory.mktemp("arm")
    runs = {}
    for kernel, arch in (("neon", NEON_ARCH), ("portable", "-march=armv8-a")):
        exe = _build(
            CROSS_CC, [arch], f"gguf_gemv_{kernel}.c", tmp / f"gemv_check_{kernel}", static=True
        )
        runs[kernel] = _run([QEMU, "-cpu", "max", exe])
    return runs


def _assert_ran(run: subprocess.CompletedProcess, kernel: str) -> None:
    assert f"gemv_check: kernel {kernel}" in run.stderr, run.stderr
    assert run.returncode == 0 and run.stdout.splitlines()[-1].startswith("reference check"), (
        run.stdout[-3000:] + run.stderr
    )
    assert ": passed," in run.stdout.splitlines()[-1], run.stdout.splitlines()[-1]


def test_neon_kernel_gives_the_portable_bits_under_qemu(outputs):
    _assert_ran(outputs["portable"], "portable")
    _assert_ran(outputs["neon"], "neon")
    neon, portable = outputs["neon"].stdout, outputs["portable"].stdout
    assert neon == portable, "NEON and portable outputs differ:" + first_difference(neon, portable)


def test_neon_mixed_parts_runs_give_the_portable_bits_under_qemu(tmp_path):
    """Mixed parts, one-part blocks skipping the xb products in runs: the portable bits, every kind
    and M = 1..9 (passes of 4 rows and the rest), with two-part blocks planted at different blocks
    in different rows."""
    outs = {
        kernel: mixed_runs_outputs(
            CROSS_CC,
            [arch, "-static"],
            kernel,
            tmp_path / f"mixed_runs_{kernel}",
            [QEMU, "-cpu", "max"],
        )
        for kernel, arch in (("neon", NEON_ARCH), ("portable", "-march=armv8-a"))
    }
    assert_same_bits(outs["neon"], outs["portable"], "NEON")


def test_native_build_gives_the_aarch64_bits(outputs, tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no host C compiler")
    run = _run([_build(cc, [], "gguf_gemv_portable.c", tmp_path / "gemv_check_host", static=False)])
    _assert_ran(run, "portable")
    assert run.stdout == outputs["portable"].stdout, (
        "host and aarch64 outputs differ:"
        + first_difference(run.stdout, outputs["portable"].stdout)
    )


def test_neon_attention_gives_the_portable_and_host_bits_under_qemu(tmp_path):
    """The paged attention (tests/unit/csrc/attention_check.c) built for NEON and for portable
    aarch64, under qemu, and natively for this host: the same bits (fused multiply-adds in one
    order: NEON's vfmaq, C's fmaf), each within the double-precision reference."""
    outs = {
        name: attention_check_output(
            CROSS_CC, [arch, "-static"], tmp_path / f"attention_{name}", [QEMU, "-cpu", "max"]
        )
        for name, arch in (("neon", NEON_ARCH), ("portable", "-march=armv8-a"))
    }
    assert outs["neon"] == outs["portable"], (
        "NEON and portable attention differ:" + first_difference(outs["neon"], outs["portable"])
    )
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is not None:
        host = attention_check_output(cc, [], tmp_path / "attention_host")
        assert host == outs["portable"], "host and aarch64 attention differ:" + first_difference(
            host, outs["portable"]
        )


def test_kernel_library_cross_compiles_for_aarch64(tmp_path):
    """Every C source of the library, with the NEON kernel and not another ISA's, compiles for
    aarch64 with the library's flags, and the objects link into one shared library."""
    sources = sorted(
        p
        for p in CSRC.glob("*.c")
        if not (p.name.startswith("gguf_gemv_") and p.name != "gguf_gemv_neon.c")
    )
    assert CSRC / "gguf_gemv_neon.c" in sources and CSRC / "gguf_gemv.c" in sources
    flags = ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", NEON_ARCH]
    objects, errors = [], []
    for src in sources:
        obj = tmp_path / (src.stem + ".o")
        p = _run([CROSS_CC, *flags, f"-I{CSRC}", "-c", src, "-o", obj])
        if p.returncode:
            errors.append(f"{src.name}:\n{p.stderr}")
        objects.append(obj)
    assert not errors, "aarch64 compile failed:\n" + "\n".join(errors)
    p = _run([CROSS_CC, *flags, *objects, "-lm", "-o", tmp_path / "libkvserve_neon.so"])
    assert p.returncode == 0, "aarch64 link failed:\n" + p.stderr
