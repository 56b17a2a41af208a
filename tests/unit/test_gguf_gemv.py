"""The GGUF block GEMV (kvserve/ops/csrc/gguf_gemv*.c) and its packed layout (pack_gguf_rows):
packing keeps the file's values bit for bit; every ISA build the host can execute matches the
dequantized weights times x within its activation rounding (two 8-bit parts: ~2^-15 of a block's
max |x|) and gives the portable build's bits exactly (csrc/gguf_gemv.h), independently of the
thread count and of the other rows of the batch."""

import shutil

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from kvserve.model.layers import Linear
from kvserve.model.quant import BlockTensor, GgufMethod, pack_gguf_rows, unpack_gguf_rows
from kvserve.ops import cpu_kernels

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]
HOST_ISAS = cpu_kernels.host_isas()
SIMD_ISAS = [i for i in HOST_ISAS if i != "portable"]


def blocks(qtype, n, k, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    w[0, :32] += 0.3  # a block with an offset (Q4_1's m matters)
    return BlockTensor(quantize(w, qtype), qtype, (n, k))


def acts(m, k, seed=1):
    """Activations with varied magnitudes, an outlier and an all-zero block (scale 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g).mul(4).add(0.1)
    x[0, min(5, k - 1)] = 40.0  # an outlier only costs precision inside its block
    if m > 1 and k >= 64:
        x[m - 1, 32:64] = 0.0
    return x


def outlier_blocks(x, seed):
    """x with an outlier in two blocks of every row, at different blocks in different rows (mixed
    parts give those blocks two parts, the rest one); in place, returned."""
    g = torch.Generator().manual_seed(seed)
    for r in range(x.shape[0]):
        for b in torch.randint(0, x.shape[1] // 32, (2,), generator=g).tolist():
            x[r, 32 * b + (7 * r) % 32] = 25.0 * (1 + r % 3)
    return x


def weights(qtype, n, k, seed=0):
    bt = blocks(qtype, n, k, seed)
    packed, kind = pack_gguf_rows(bt)
    return bt, packed, kind


def _lib_or_skip(isa):
    if cpu_kernels.library(isa) is None:
        pytest.skip("C kernels unavailable")


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n", [16, 40, 3])
def test_pack_keeps_the_files_values(qtype, n):
    bt = blocks(qtype, n, 96)
    packed, kind = pack_gguf_rows(bt)
    assert kind == (8 if qtype == Q.Q8_0 else 4)
    ref = torch.from_numpy(dequantize(bt.raw, qtype)).reshape(n, 96)
    assert torch.equal(unpack_gguf_rows(packed, kind, (n, 96)), ref)
    assert packed.numel() == -(-n // 16) * 3 * (544 if kind == 8 else 320)


def test_host_builds_report_their_isa():
    for isa in HOST_ISAS:
        _lib_or_skip(isa)
        assert cpu_kernels.library(isa).gguf_gemv_isa().decode() == isa


@pytest.mark.parametrize("isa", HOST_ISAS)
@pytest.mark.parametrize("qtype", TYPES)
def test_gemv_matches_dequantized_matmul(qtype, isa):
    """|error| per output <= sum over k of |w_k| * dx of k's block, dx = max|x| / (127 * 256) about
    2^-15 max|x| (xb's rounding is half of that; the +-127 clamp at most one step), plus float32
    rounding: the bound takes 2^-14 max|x| per weight."""
    _lib_or_skip(isa)
    n, k = 40, 160
    bt, packed, kind = weights(qtype, n, k)
    W = torch.from_numpy(dequantize(bt.raw, qtype)).reshape(n, k).double()
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 40):  # tiles of 8 rows (AVX2: 4) and their edges
        x = acts(m, k, seed=m)
        ref = x.double() @ W.t()
        got = cpu_kernels.gguf_gemv(packed, kind, n, x, isa=isa).double()
        assert got.shape == (m, n)
        block_max = x.abs().reshape(m, -1, 32).amax(-1).repeat_interleave(32, 1).double()  # [m, k]
        bound = block_max @ W.abs().t() * 2**-14
        assert ((got - ref).abs() <= bound + 1e-6).all(), (m, (got - ref).abs().max())


def quantize_block_np(xb32: np.ndarray, parts: str = "two"):
    """One block of 32 float32 activations as the contract quantizes it, in numpy: xa, xb (int64;
    all 0 with parts "one", and with "mixed" unless sum xb^2 >= 4 sum xa^2) and dx (float32)."""
    f = np.float32
    amax = f(np.abs(xb32).max())
    amax = amax if amax >= f(1e-30) else f(0)
    inv = f(127) / amax if amax > 0 else f(0)
    v = xb32 * inv
    xa = np.rint(v).astype(np.int64)
    xb = np.clip(np.rint((v - xa) * f(256)), -127, 127).astype(np.int64)
    if parts == "one" or (parts == "mixed" and (xb * xb).sum() < 4 * (xa * xa).sum()):
        xb = np.zeros(32, dtype=np.int64)
    return xa, xb, amax / f(127 * 256)


def reference_q8_0_gemv(bt: BlockTensor, x: torch.Tensor) -> np.ndarray:
    """The contract of csrc/gguf_gemv.h for Q8_0 weights, in numpy float32 (each operation rounded
    to float32, in the order the contract gives): each block of 32 activations becomes two signed
    8-bit parts, xa = rint(x 127 / max|x|), xb = rint((that - xa) 256) clamped to +-127, with scale
    dx = max|x| / (127 256); the integer sum s = sum q (256 xa + xb) is exact; acc += s (d dx)."""
    n, k = bt.shape
    raw = bt.raw.reshape(n, k // 32, 34)
    d = raw[:, :, :2].copy().view(np.float16).astype(np.float32)[:, :, 0]  # [n, blocks]
    q = raw[:, :, 2:].view(np.int8).astype(np.int64)  # [n, blocks, 32]
    out = np.zeros((x.shape[0], n), dtype=np.float32)
    for r, row in enumerate(x.numpy().astype(np.float32)):
        acc = np.zeros(n, dtype=np.float32)
        for b in range(k // 32):
            xa, xb, dx = quantize_block_np(row[32 * b : 32 * b + 32])
            s = (q[:, b, :] * (256 * xa + xb)).sum(axis=1)
            acc = acc + s.astype(np.float32) * (d[:, b] * dx)
        out[r] = acc
    return out


@pytest.mark.parametrize("isa", HOST_ISAS)
def test_q8_0_gemv_is_the_contract_bit_for_bit(isa):
    """Every build computes exactly what gguf_gemv.h writes down (activation quantization
    included: round half to even at ties, the +-127 clamp, all-zero blocks), checked against an
    independent numpy float32 version, not only against the portable build."""
    _lib_or_skip(isa)
    bt, packed, kind = weights(Q.Q8_0, 37, 256, seed=3)
    x = acts(4, 256, seed=9)
    ties = torch.randint(-126, 126, (2, 256), generator=torch.Generator().manual_seed(2)).float()
    ties[0] += 0.5  # v = x (the block max is 127): xa ties
    ties[1] += (torch.arange(256) % 64 * 2 + 1).float() / 512 - 0.125  # xb ties and clamps
    ties[:, ::32] = 127.0
    x = torch.cat([x, ties, torch.zeros(1, 256)])
    got = cpu_kernels.gguf_gemv(packed, kind, 37, x, isa=isa)
    assert torch.equal(got, torch.from_numpy(reference_q8_0_gemv(bt, x)))


@pytest.mark.parametrize("parts", ["two", "one", "mixed"])  # gguf, gguf-a8, gguf-mixed
@pytest.mark.parametrize("isa", SIMD_ISAS)
@pytest.mark.parametrize("qtype", TYPES)
def test_every_isa_gives_the_portable_bits(qtype, isa, parts):
    _lib_or_skip(isa)
    _lib_or_skip("portable")
    for n, k, m in ((37, 32, 9), (5, 64, 17), (100, 576, 8), (21, 1536, 5), (16, 576, 3)):
        _, packed, kind = weights(qtype, n, k, seed=n + k)
        x = acts(m, k, seed=k)
        if parts == "mixed":
            outlier_blocks(x, seed=m + k)
        want = cpu_kernels.gguf_gemv(packed, kind, n, x, isa="portable", parts=parts)
        got = cpu_kernels.gguf_gemv(packed, kind, n, x, isa=isa, parts=parts)
        assert torch.equal(got, want), (n, k, m, (got - want).abs().max())


def random_blocks(qtype, n, k, seed):
    """Blocks no quantizer writes but a file may hold: every integer value (Q8_0's -128 too) and
    fp16 scales / offsets of any finite magnitude, subnormals included."""
    from gguf.constants import GGML_QUANT_SIZES

    rng = np.random.default_rng(seed)
    bs = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (n, k // 32, bs), dtype=np.uint8)
    nh = 2 if qtype == Q.Q4_1 else 1  # fp16 fields at the block's start
    half = rng.integers(0, 1 << 15, (n, k // 32, nh), dtype=np.uint16)
    half = np.where((half >> 10) == 31, half & 0x83FF, half)  # no inf / NaN
    half[:, ::3] &= 0x83FF  # subnormal scales
    half[..., 0] = np.minimum(half[..., 0], 0x5800)  # |d| <= 128: sums stay finite
    half |= rng.integers(0, 2, half.shape, dtype=np.uint16) << 15  # either sign
    raw[..., : 2 * nh] = half.view(np.uint8).reshape(n, k // 32, 2 * nh)
    if qtype == Q.Q8_0:
        raw[0, :, 2:] = 0x80  # a row of -128s
    return BlockTensor(raw.reshape(n, -1), qtype, (n, k))


@pytest.mark.parametrize("isa", SIMD_ISAS)
@pytest.mark.parametrize("qtype", TYPES)
def test_every_isa_gives_the_portable_bits_on_arbitrary_blocks(qtype, isa):
    _lib_or_skip(isa)
    _lib_or_skip("portable")
    n, k = 45, 192
    packed, kind = pack_gguf_rows(random_blocks(qtype, n, k, seed=11))
    x = acts(13, k, seed=12)
    x[1] = 127.0  # xa = 127 everywhere (extreme integer sums)
    x[2, :32] = -1e-30  # tiny values
    want = cpu_kernels.gguf_gemv(packed, kind, n, x, isa="portable")
    assert want.isfinite().all()
    got = cpu_kernels.gguf_gemv(packed, kind, n, x, isa=isa)
    assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("f32", [False, True])
@pytest.mark.parametrize("isa", HOST_ISAS)
def test_gemv_bias_accumulate_and_strided_rows(isa, f32):
    """Both kernels (the integer GEMV and the float32 GEMM of prompt tokens)."""
    _lib_or_skip(isa)
    n, k = 24, 64
    bt, packed, kind = weights(Q.Q4_1, n, k)
    W = torch.from_numpy(dequantize(bt.raw, Q.Q4_1)).reshape(n, k)
    g = torch.Generator().manual_seed(2)
    x_wide = torch.randn(11, k + 32, generator=g)
    x = x_wide[:, 16 : 16 + k]  # rows with a leading dimension larger than k
    assert not x.is_contiguous()
    bias = torch.randn(n, generator=g)
    plain = cpu_kernels.gguf_gemv(packed, kind, n, x.contiguous(), isa=isa, f32=f32)
    assert torch.allclose(plain, x @ W.t(), atol=1e-3)
    out_wide = torch.full((11, n + 8), 7.0)
    out = out_wide[:, :n]
    ret = cpu_kernels.gguf_gemv(
        packed, kind, n, x, out=out, bias=bias, accumulate=True, isa=isa, f32=f32
    )
    assert ret.data_ptr() == out.data_ptr()
    assert torch.equal(out, (7.0 + plain) + bias)  # the kernel's own sum: acc + y, then + bias
    assert torch.equal(out_wide[:, n:], torch.full((11, 8), 7.0))  # nothing written past n
    out2 = torch.full((11, n), 3.0)
    cpu_kernels.gguf_gemv(
        packed, kind, n, x, out=out2, bias=bias, isa=isa, f32=f32
    )  # accumulate off: overwritten
    assert torch.equal(out2, plain + bias)


@pytest.mark.parametrize("isa", HOST_ISAS)
def test_gemv_rejects_k_not_a_multiple_of_32(isa):
    _lib_or_skip(isa)
    _, packed, kind = weights(Q.Q8_0, 16, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_kernels.gguf_gemv(packed, kind, 16, torch.randn(2, 48), isa=isa)


@pytest.mark.parametrize("isa", HOST_ISAS)
def test_gemv_bits_do_not_depend_on_threads_or_other_rows(isa, threads):
    _lib_or_skip(isa)
    for qtype in TYPES:
        n, k = 200, 128  # 13 row groups: both threads get work
        _, packed, kind = weights(qtype, n, k, seed=7)
        x = acts(17, k, seed=9)
        threads(1)
        one = cpu_kernels.gguf_gemv(packed, kind, n, x, isa=isa)
        threads(2)
        two = cpu_kernels.gguf_gemv(packed, kind, n, x, isa=isa)
        assert torch.equal(one, two), qtype
        for r in range(17):  # each row alone: another tile, another AVX2 sub-tile
            alone = cpu_kernels.gguf_gemv(packed, kind, n, x[r : r + 1].clone(), isa=isa)
            assert torch.equal(alone[0], two[r]), (qtype, r)


def _gguf_linear(qtype, shards, k, bias=None, seed=4):
    n = sum(shards)
    bt = blocks(qtype, n, k, seed=seed)
    rows = bt.raw.reshape(n, -1)
    lin = Linear(k, shards, bias=bias is not None, quant_method=GgufMethod())
    start = 0
    for i, s in enumerate(shards):
        lin.load_weight(BlockTensor(rows[start : start + s], qtype, (s, k)), i)
        if bias is not None:
            lin.load_bias(bias[start : start + s], i)
        start += s
    return lin, torch.from_numpy(dequantize(bt.raw, qtype)).reshape(n, k)


@pytest.mark.parametrize("qtype", TYPES)
def test_gguf_method_rows_are_the_same_in_any_batch(qtype):
    """GgufMethod runs the C kernel at every batch size: a row's output is bitwise the same in a
    1-row and a 100-row batch, and close to the dequantized weight's product."""
    _lib_or_skip(None)
    b = torch.randn(96)
    lin, W = _gguf_linear(qtype, [40, 56], 64, bias=b)
    assert lin.gguf_packed is not None and lin.dense_weight is None
    assert torch.equal(lin.quant_method.dequantized(lin), W)
    x = acts(100, 64, seed=3)
    big = lin(x)
    assert big.shape == (100, 96) and big.dtype == torch.float32
    assert torch.allclose(big, x @ W.t() + b, atol=3e-3, rtol=1e-3)
    for r in (0, 1, 7, 8, 50, 99):
        assert torch.equal(lin(x[r : r + 1].clone())[0], big[r]), r
    # leading dimensions are flattened and restored: [2, 50, 64] -> [2, 50, 96], the same bits
    assert torch.equal(lin(x.view(2, 50, 64)), big.view(2, 50, 96))


def test_gguf_method_keeps_dense_weights_float32():
    """A weight that is not blocks of a packed kind (already dequantized, or a GGUF type without
    a kind such as Q5_1) stays a dense float32 weight: no packed copy, y = x W^T."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 64, generator=g)
    for w in (
        torch.randn(32, 64, generator=g) * 0.1,
        (torch.randn(32, 64, generator=g) * 0.1).bfloat16(),
    ):
        lin = Linear(64, 32, quant_method=GgufMethod())
        lin.load_weight(w)
        assert lin.gguf_packed is None
        assert lin.dense_weight.dtype == torch.float32 and torch.equal(lin.dense_weight, w.float())
        assert torch.allclose(lin(x), x @ w.float().t(), atol=1e-5, rtol=1e-5)
    # IQ2_XXS blocks (no packed kind): dequantized into the dense weight
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (32, 66), dtype=np.uint8)  # one 256-weight block a row
    raw[:, 0:2] = np.array([0.01], np.float16).view(np.uint8)
    W2 = torch.from_numpy(dequantize(raw, Q.IQ2_XXS)).reshape(32, 256)
    x2 = torch.randn(5, 256, generator=g)
    lin = Linear(256, 32, quant_method=GgufMethod())
    lin.load_weight(BlockTensor(raw, Q.IQ2_XXS, (32, 256)))
    assert lin.gguf_packed is None and lin.dense_weight.dtype == torch.float32
    assert torch.equal(lin.dense_weight, W2)
    assert torch.allclose(lin(x2), x2 @ W2.t(), atol=1e-5, rtol=1e-5)
    assert "IQ2_XXS has no packed kind" in lin.dense_reason
    # fused shards of two kinds (4 and 8): two packed parts side by side, no dense copy
    a = blocks(Q.Q4_0, 16, 64, seed=2)
    b = blocks(Q.Q8_0, 16, 64, seed=3)
    lin = Linear(64, [16, 16], quant_method=GgufMethod())
    lin.load_weight(a, 0)
    lin.load_weight(b, 1)
    W = torch.cat([torch.from_numpy(dequantize(t.raw, t.qtype)).reshape(16, 64) for t in (a, b)])
    assert lin.dense_weight is None and [k for _, k, _ in lin.gguf_parts] == [4, 8]
    assert torch.equal(lin.quant_method.dequantized(lin), W)
    assert torch.allclose(lin(x), x @ W.t(), atol=1e-3, rtol=1e-3)


# ---- The float32 GEMM of prompt tokens (gguf_gemm_f32_team, gguf_gemv.h) ----

F32_SHAPES = ((37, 32, 9), (5, 64, 17), (48, 288, 13), (100, 576, 200), (21, 1536, 5), (64, 544, 1))


@pytest.mark.parametrize("isa", HOST_ISAS)
@pytest.mark.parametrize("qtype", TYPES)
def test_f32_gemm_matches_dequantized_matmul(qtype, isa):
    """Exactly dequantized weights (d q + m rounds once) times float32 x, summed by a chain of K
    fused multiply-adds: |error| <= K 2^-24 sum_k |w_k x_k| (the chain's rounding bound)."""
    _lib_or_skip(isa)
    for n, k, m in F32_SHAPES[:4]:
        bt, packed, kind = weights(qtype, n, k, seed=n)
        W = torch.from_numpy(dequantize(bt.raw, qtype)).reshape(n, k).double()
        x = acts(m, k, seed=m)
        got = cpu_kernels.gguf_gemv(packed, kind, n, x, isa=isa, f32=True).double()
        ref = x.double() @ W.t()
        bound = (x.double().abs() @ W.abs().t()) * k * 2**-24
        assert ((got - ref).abs() <= bound + 1e-30).all(), (n, k, m, (got - ref).abs().max())


@pytest.mark.parametrize("isa", SIMD_ISAS)
@pytest.mark.parametrize("qtype", TYPES)
def test_f32_gemm_every_isa_gives_the_portable_bits(qtype, isa):
    """Row counts across tiles and chunks (200 > 192 rows a chunk), K across slices (1536 > 256),
    an odd number of row groups (the last pair half empty)."""
    _lib_or_skip(isa)
    _lib_or_skip("portable")
    for n, k, m in F32_SHAPES:
        _, packed, kind = weights(qtype, n, k, seed=n + k)
        x = acts(m, k, seed=k)
        want = cpu_kernels.gguf_gemv(packed, kind, n, x, isa="portable", f32=True)
        got = cpu_kernels.gguf_gemv(packed, kind, n, x, isa=isa, f32=True)
        assert torch.equal(got, want), (n, k, m, (got - want).abs().max())
    packed, kind = pack_gguf_rows(random_blocks(qtype, 45, 192, seed=11))
    x = acts(13, 192, seed=12)
    want = cpu_kernels.gguf_gemv(packed, kind, 45, x, isa="portable", f32=True)
    assert want.isfinite().all()
    assert torch.equal(cpu_kernels.gguf_gemv(packed, kind, 45, x, isa=isa, f32=True), want)


@pytest.mark.parametrize("isa", HOST_ISAS)
def test_f32_gemm_bits_do_not_depend_on_threads_or_other_rows(isa, threads):
    _lib_or_skip(isa)
    for qtype in TYPES:
        n, k = 200, 320  # 13 row groups (7 pairs), two k slices
        _, packed, kind = weights(qtype, n, k, seed=7)
        x = acts(29, k, seed=9)
        threads(1)
        one = cpu_kernels.gguf_gemv(packed, kind, n, x, isa=isa, f32=True)
        threads(2)
        two = cpu_kernels.gguf_gemv(packed, kind, n, x, isa=isa, f32=True)
        assert torch.equal(one, two), qtype
        for r in (0, 5, 12, 13, 28):  # each row alone: another tile, another tile row
            alone = cpu_kernels.gguf_gemv(packed, kind, n, x[r : r + 1].clone(), isa=isa, f32=True)
            assert torch.equal(alone[0], two[r]), (qtype, r)
