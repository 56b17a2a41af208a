"""The C repack of GGUF blocks (kvserve/ops/csrc/gguf_repack.c, kvserve.ops.gguf_repack) gives
byte for byte what the numpy packer kvserve.ops.gguf_blocks.pack_gguf_parts_numpy gives: every
type it packs (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, IQ4_XS and the K-quants), random blocks with
fp16 scales of any sign and finite magnitude, row counts that do not fill a group of 16, fused
parts packed each from a group boundary or joined; in every ISA build the host runs, with gcc and
with clang. What it does not cover it leaves to
the numpy path (None)."""

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
import torch

from kvserve.model.quant import BlockTensor
from kvserve.ops import cpu_kernels
from kvserve.ops.cpu_kernels import _CSRC
from kvserve.ops.gguf_blocks import pack_gguf_parts_numpy
from kvserve.ops.gguf_repack import repack_parts
from kvserve.ops.gguf_types import GGML_QUANT_SIZES
from kvserve.ops.gguf_types import GGMLQuantizationType as Q

HOST_ISAS = cpu_kernels.host_isas()
CLANG = shutil.which("clang")
pytestmark = pytest.mark.skipif(cpu_kernels._compiler() is None, reason="no C compiler")

TYPES = [
    Q.Q4_0,
    Q.Q4_1,
    Q.Q8_0,
    Q.Q5_0,
    Q.IQ4_NL,
    Q.Q5_1,
    Q.Q4_K,
    Q.Q5_K,
    Q.Q6_K,
    Q.Q3_K,
    Q.IQ4_XS,
    Q.Q2_K,
]
# Byte offsets of each block's fp16 fields.
HALVES = {
    Q.Q4_0: [0],
    Q.Q4_1: [0, 2],
    Q.Q8_0: [0],
    Q.Q5_0: [0],
    Q.IQ4_NL: [0],
    Q.Q5_1: [0, 2],
    Q.Q4_K: [0, 2],
    Q.Q5_K: [0, 2],
    Q.Q6_K: [208],
    Q.Q3_K: [108],
    Q.IQ4_XS: [0],
    Q.Q2_K: [80, 82],
}
# Row counts of the parts of one weight: one part (a whole group, less, more), parts that each
# start a group (the last one short), parts joined because an earlier one ends inside a group.
ROWS = [[16], [5], [40], [32, 16, 9], [5, 19, 7], [48, 21], [16, 3, 16]]


def random_blocks(qtype, n, k, seed):
    """Random bytes for every integer and sub-scale; fp16 scales of either sign and any finite
    magnitude (a quarter subnormal, some beyond 8192, where Q4_0's -8 d overflows to infinity)."""
    rng = np.random.default_rng(seed)
    per, bs = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // per, bs), dtype=np.uint8)
    for at in HALVES[qtype]:
        h = rng.integers(0, 0x7C00, raw.shape[:2], dtype=np.uint16)
        h[:, ::4] &= 0x03FF
        h |= rng.integers(0, 2, raw.shape[:2], dtype=np.uint16) << 15
        raw[..., at : at + 2] = h.view(np.uint8).reshape(*raw.shape[:2], 2)
    return BlockTensor(raw.reshape(n, -1), qtype, (n, k))


def check_same_bytes(parts, isa=None):
    with np.errstate(over="ignore"):  # numpy's Q4_0 -8 d overflowing to infinity, on purpose
        want, kind = pack_gguf_parts_numpy(parts)
    got = repack_parts(parts, isa=isa)
    assert got is not None
    assert got[1] == kind
    assert got[0].dtype == torch.uint8 and got[0].shape == want.shape
    assert torch.equal(got[0], want), (got[0] != want).nonzero()[:8].ravel().tolist()


def _library_or_skip(isa):
    if cpu_kernels.library(isa) is None:
        pytest.skip("C kernels unavailable")


@pytest.mark.parametrize("isa", HOST_ISAS)
@pytest.mark.parametrize("qtype", TYPES)
def test_repack_gives_the_numpy_packers_bytes(qtype, isa):
    _library_or_skip(isa)
    k = 512
    for j, rows in enumerate(ROWS):
        parts = [random_blocks(qtype, n, k, seed=100 * j + i) for i, n in enumerate(rows)]
        check_same_bytes(parts, isa)


def test_q4_0_and_q4_1_parts_share_kind_4():
    """Fused shards of both 4-bit types (kind 4), apart and joined."""
    _library_or_skip(None)
    for rows in ([16, 16], [9, 16], [16, 7, 32]):
        parts = [
            random_blocks(Q.Q4_0 if i % 2 else Q.Q4_1, n, 256, seed=7 + i)
            for i, n in enumerate(rows)
        ]
        check_same_bytes(parts)


def test_row_slices_of_a_tensor():
    """Parts that are views of one tensor's rows (fused tensors split at load)."""
    _library_or_skip(None)
    whole = random_blocks(Q.Q4_K, 60, 768, seed=3)
    parts = [BlockTensor(whole.raw[a:b], Q.Q4_K, (b - a, 768)) for a, b in ((0, 24), (24, 60))]
    check_same_bytes(parts)


def test_what_it_leaves_to_numpy():
    _library_or_skip(None)
    q5 = random_blocks(Q.Q5_K, 16, 256, seed=1)
    iq2 = BlockTensor(np.zeros((16, 66), np.uint8), Q.IQ2_XXS, (16, 256))
    assert repack_parts([iq2]) is None  # a type without a packed kind
    assert repack_parts([]) is None
    assert repack_parts([q5, random_blocks(Q.Q4_K, 16, 256, seed=2)]) is None  # two kinds
    assert repack_parts([q5, random_blocks(Q.Q5_K, 16, 512, seed=2)]) is None  # two widths
    odd = BlockTensor(np.zeros((4, 5 * 34), np.uint8), Q.Q8_0, (4, 160))
    assert (
        repack_parts([BlockTensor(odd.raw, Q.Q4_K, (4, 160))]) is None
    )  # K not whole super-blocks
    q4 = random_blocks(Q.Q4_0, 16, 64, seed=4)
    assert repack_parts([BlockTensor(q4.raw[:, :-1], Q.Q4_0, (16, 64))]) is None  # short rows
    nan = q4.raw.copy()
    nan[3, 18:20] = np.array([0x7E01], np.uint16).view(np.uint8)  # a NaN d in block 1 of row 3
    assert repack_parts([BlockTensor(nan, Q.Q4_0, (16, 64))]) is None
    q5_1 = random_blocks(Q.Q5_1, 16, 64, seed=5).raw.copy()
    q5_1[7, 24 + 2 : 24 + 4] = np.array([0xFE01], np.uint16).view(np.uint8)  # a NaN m
    assert repack_parts([BlockTensor(q5_1, Q.Q5_1, (16, 64))]) is None


def test_q5_0_iq4_nl_and_q8_0_parts_share_kind_8():
    """Fused shards of the three kind-8 types (Q4_K_M files keep some Q5_0 beside Q8_0), apart
    and joined."""
    _library_or_skip(None)
    types = [Q.Q8_0, Q.Q5_0, Q.IQ4_NL]
    for rows in ([16, 16, 32], [9, 16, 5], [16, 7, 32]):
        parts = [random_blocks(types[i], n, 256, seed=11 + i) for i, n in enumerate(rows)]
        check_same_bytes(parts)


def _clang_repack(isa, tmp_path):
    """gguf_repack.c alone, built by clang with the ISA's flags (and OpenMP when it links)."""
    flags = [
        *cpu_kernels._BASE_FLAGS,
        *cpu_kernels._openmp_flags(CLANG),
        *cpu_kernels.ISA_FLAGS[isa],
    ]
    out = tmp_path / f"repack-{isa}.so"
    res = subprocess.run(
        [CLANG, *flags, str(_CSRC / "gguf_repack.c"), "-o", str(out)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    lib = ctypes.CDLL(str(out))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.gguf_repack.restype = ctypes.c_int
    lib.gguf_repack.argtypes = [i64, p, p, p, p, i64, i64, p, i64, i64]
    return lib


@pytest.mark.skipif(CLANG is None, reason="needs clang")
@pytest.mark.parametrize("isa", HOST_ISAS)
def test_clang_build_gives_the_same_bytes(monkeypatch, tmp_path, isa):
    lib = _clang_repack(isa, tmp_path)
    monkeypatch.setattr(cpu_kernels, "library", lambda isa=None: lib)
    for qtype in TYPES:
        parts = [random_blocks(qtype, n, 256, seed=n) for n in (16, 5, 11)]
        check_same_bytes(parts)
