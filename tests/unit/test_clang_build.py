"""The C kernels with clang (Apple's compiler on macOS is clang): every build the host runs
compiles with it and gives gcc's bits, and the sources compile for aarch64 (the NEON build).
Skipped where clang is not installed (.ci/run installs it)."""

import ctypes
import random
import shutil
import subprocess

import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from test_attention import make_batch, run_kernel, token_rows
from test_gguf_gemv import acts, weights
from test_gguf_kquants import random_blocks

from kvserve.ops import cpu_kernels
from kvserve.ops.cpu_kernels import _CSRC
from kvserve.ops.gguf_blocks import pack_gguf_rows

CLANG = shutil.which("clang")
pytestmark = pytest.mark.skipif(
    CLANG is None or shutil.which("gcc") is None, reason="needs clang and gcc"
)


def _gcc_and_clang(monkeypatch, tmp_path, isa):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    gcc, clang = (ctypes.CDLL(str(cpu_kernels.build(cc, isa))) for cc in ("gcc", CLANG))
    for lib in (gcc, clang):
        cpu_kernels._signatures(lib)
    return gcc, clang


@pytest.mark.parametrize("isa", cpu_kernels.host_isas())
def test_clang_builds_give_gccs_bits(monkeypatch, tmp_path, isa):
    libs = _gcc_and_clang(monkeypatch, tmp_path, isa)
    _, packed, kind = weights(Q.Q4_1, 40, 576, seed=2)
    x = acts(9, 576, seed=4)
    compact = [pack_gguf_rows(random_blocks(t, 40, 512, seed=5)) for t in (Q.Q3_K, Q.IQ4_XS)]
    xk = acts(9, 512, seed=6)
    q, _, _, kc, vc, meta = make_batch(
        random.Random(3), [(40, 3), (5, 1), (0, 9)], 16, 12, 9, 3, 64
    )
    rows = token_rows(meta)
    outs = []
    for lib in libs:
        monkeypatch.setattr(cpu_kernels, "library", lambda isa=None, lib=lib: lib)
        outs.append(
            (
                cpu_kernels.gguf_gemv(packed, kind, 40, x),
                cpu_kernels.gguf_gemv(packed, kind, 40, x, f32=True),
                run_kernel(q, kc.half(), vc.half(), meta, rows, 0.125, None),
                *(cpu_kernels.gguf_gemv(w, k, 40, xk) for w, k in compact),
            )
        )
    for got, want in zip(outs[1], outs[0]):
        assert torch.equal(got, want), isa


def test_sources_compile_for_aarch64_with_clang():
    srcs = [str(_CSRC / n) for n in (*cpu_kernels._COMMON, "gguf_gemv_neon.c")]
    res = subprocess.run(
        [
            CLANG,
            "--target=aarch64-linux-gnu",
            "-march=armv8.2-a+dotprod",
            "-O3",
            "-ffp-contract=off",
            "-fsyntax-only",
            *srcs,
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-3000:]
