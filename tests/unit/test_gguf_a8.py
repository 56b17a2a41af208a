"""The gguf-a8 format's one-part activations (csrc/gguf_gemv.h, gguf_acts_t.parts GGUF_ONE_PART):
each block of 32 activations as one signed 8-bit part, xa = rint(x 127 / max|x|), the m term
taking the sum of the quantized values (llama.cpp's Q8_1 s); and gguf-mixed's (GGUF_MIXED_PARTS):
that, except the blocks where sum xb^2 >= 4 sum xa^2, which keep both parts and the float sum.
Every ISA build computes exactly that contract, checked against an independent numpy float32
version; one part stays within 2^-8 of a block's max |x| per weight of the dequantized matmul,
mixed parts within that and closer on outlier blocks. (Every build against the portable one:
test_gguf_gemv.py, and csrc/gemv_check.c's cases for NEON and AVX-VNNI.)"""

import shutil

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model.quant import BlockTensor, pack_gguf_rows
from kvserve.ops import cpu_kernels
from tests.unit.test_gguf_gemv import outlier_blocks, quantize_block_np
from tests.unit.test_gguf_kquants import random_blocks

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)
HOST_ISAS = cpu_kernels.host_isas()
f = np.float32


def _lib_or_skip(isa):
    if cpu_kernels.library(isa) is None:
        pytest.skip("C kernels unavailable")


def weights(qtype, n, k, seed):
    """Quantized Gaussian weights (Q4_0, Q4_1, Q8_0), or random K-quant blocks (no Python
    quantizer writes those)."""
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        rng = np.random.default_rng(seed)
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        w[0, :32] += 0.3  # an offset block: Q4_1's m term matters
        bt = BlockTensor(quantize(w, qtype), qtype, (n, k))
    else:
        bt = random_blocks(qtype, n, k, seed)
    packed, kind = pack_gguf_rows(bt)
    return bt, packed, kind


def acts(m, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g).mul(4).add(0.1)
    x[0, 5] = 40.0  # an outlier
    if m > 1:
        x[m - 1, 32:64] = 0.0  # an all-zero block
    return x


def reference_parts(bt: BlockTensor, x: torch.Tensor, parts: str) -> np.ndarray:
    """The contract for Q4_0 / Q4_1 / Q8_0 blocks with one or mixed parts, in numpy float32 (every
    operation rounded to float32 in the contract's order): xa = rint(x 127 / max|x|), dx = max|x| /
    (127 256), xb as quantize_block_np gives it, s = sum q (256 xa + xb) (exact), acc += s (d dx);
    Q4 kinds also acc += m sx, with sx = dx sq, sq = sum 256 xa, for a one-part block and the float
    sum of the block's x, in order, for a two-part one (Q4_0's m is -8 d)."""
    n, k = bt.shape
    qt = bt.qtype
    bs = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34}[qt]
    raw = bt.raw.reshape(n, k // 32, bs)
    d = raw[:, :, :2].copy().view(np.float16).astype(np.float32)[:, :, 0]
    if qt == Q.Q8_0:
        q, m = raw[:, :, 2:].view(np.int8).astype(np.int64), None
    else:
        qs = raw[:, :, bs - 16 :].astype(np.int64)
        q = np.concatenate([qs & 15, qs >> 4], axis=2)  # weights 0..15, 16..31
        m = (
            raw[:, :, 2:4].copy().view(np.float16).astype(np.float32)[:, :, 0]
            if qt == Q.Q4_1
            else (d * f(-8)).astype(np.float32)
        )
    out = np.zeros((x.shape[0], n), dtype=np.float32)
    for r, row in enumerate(x.numpy().astype(np.float32)):
        acc = np.zeros(n, dtype=np.float32)
        for b in range(k // 32):
            block = row[32 * b : 32 * b + 32]
            xa, xb, dx = quantize_block_np(block, parts)
            s = (q[:, b, :] * (256 * xa + xb)).sum(axis=1)
            acc = acc + s.astype(np.float32) * (d[:, b] * dx)
            if m is not None:
                sx = (
                    dx * f(256 * xa.sum())
                    if not xb.any()
                    else np.cumsum(block, dtype=np.float32)[-1]
                )
                acc = acc + m[:, b] * sx
        out[r] = acc
    return out


def outlier_rows(m, k, seed):
    """acts() with an outlier block or two in every row, at different blocks in different rows
    (mixed parts give those blocks two parts, the rest one)."""
    return outlier_blocks(acts(m, k, seed), seed)


@pytest.mark.parametrize("parts", ["one", "mixed"])
@pytest.mark.parametrize("isa", HOST_ISAS)
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_parts_are_the_contract_bit_for_bit(qtype, isa, parts):
    _lib_or_skip(isa)
    bt, packed, kind = weights(qtype, 37, 256, seed=3)
    x = outlier_rows(5, 256, seed=9)
    ties = (
        torch.randint(-126, 126, (1, 256), generator=torch.Generator().manual_seed(2)).float() + 0.5
    )
    ties[:, ::32] = 127.0  # the block max is 127: v = x, every xa a tie
    x = torch.cat([x, ties, torch.zeros(1, 256)])
    if parts == "mixed":  # both kinds of block, in different rows of a pass
        two = [
            [quantize_block_np(r[32 * b : 32 * b + 32].numpy(), "mixed")[1].any() for b in range(8)]
            for r in x
        ]
        assert any(map(any, two)) and not all(map(all, two))
        assert any(two[r][b] != two[r + 1][b] for r in range(len(x) - 1) for b in range(8))
    got = cpu_kernels.gguf_gemv(packed, kind, 37, x, isa=isa, parts=parts)
    assert torch.equal(got, torch.from_numpy(reference_parts(bt, x, parts)))


@pytest.mark.parametrize("parts", ["one", "mixed"])
@pytest.mark.parametrize("isa", HOST_ISAS)
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K])
def test_parts_error_bound(qtype, isa, parts):
    """|error| <= sum_k |w_k| 2^-8 max|x| of k's block (xa's rounding is 2^-8 / 2 of it, float32
    rounding far below): the same bound as llama.cpp's 8-bit activations. Mixed parts: inside it,
    and with less squared error than one part where rows have outlier blocks."""
    _lib_or_skip(isa)
    n, k = 40, 256
    bt, packed, kind = weights(qtype, n, k, seed=5)
    W = torch.from_numpy(dequantize(bt.raw, qtype)).reshape(n, k).double()
    for m in (1, 2, 3, 8, 9, 17):
        x = outlier_rows(m, k, seed=m)
        got = cpu_kernels.gguf_gemv(packed, kind, n, x, isa=isa, parts=parts).double()
        block_max = x.abs().reshape(m, -1, 32).amax(-1).repeat_interleave(32, 1).double()
        bound = block_max @ W.abs().t() * 2**-8
        err = (got - x.double() @ W.t()).abs()
        assert (err <= bound + 1e-6).all(), (m, err.max())
        two = cpu_kernels.gguf_gemv(packed, kind, n, x, isa=isa).double()
        assert not torch.equal(got, two)  # the parts differ: parts reached the kernel
        if parts == "mixed":
            one = cpu_kernels.gguf_gemv(packed, kind, n, x, isa=isa, parts="one").double()
            assert err.square().sum() < (one - x.double() @ W.t()).square().sum()


def test_parts_are_for_the_integer_gemv_only():
    _lib_or_skip(None)
    _, packed, kind = weights(Q.Q4_1, 16, 64, seed=1)
    with pytest.raises(ValueError, match="parts"):
        cpu_kernels.gguf_gemv(packed, kind, 16, torch.randn(2, 64), f32=True, parts="one")
    with pytest.raises(ValueError, match="parts"):
        cpu_kernels.gguf_gemv(packed, kind, 16, torch.randn(2, 64), parts="three")


_block = st.lists(st.floats(-4.0, 4.0, width=32), min_size=32, max_size=32)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(_block, _block, st.integers(0, 63), st.floats(0.0, 200.0, width=32)),
        min_size=1,
        max_size=3,
    )
)
def test_mixed_parts_match_the_contract_on_any_blocks(rows):
    """Fuzzed rows of two blocks, each with one value set to an outlier of any size (0: none): the
    mixed quantizer's per-block choice and the GEMV give numpy's contract bit for bit on every
    build, whichever side of the 4 sum xa^2 line a block falls."""
    bt, packed, kind = weights(Q.Q4_1, 16, 64, seed=11)
    x = torch.tensor([a + b for a, b, _, _ in rows], dtype=torch.float32)
    for r, (_, _, at, big) in enumerate(rows):
        x[r, at] = big
    want = torch.from_numpy(reference_parts(bt, x, "mixed"))
    for isa in HOST_ISAS:
        _lib_or_skip(isa)
        assert torch.equal(
            cpu_kernels.gguf_gemv(packed, kind, 16, x, isa=isa, parts="mixed"), want
        ), isa
