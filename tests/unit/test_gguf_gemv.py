"""The GGUF block GEMV (kvserve/ops/csrc/gguf_gemv.c) and its packed layout (quant.pack_gguf_rows):
packing keeps the file's values bit for bit, and the kernel (SIMD and portable builds) matches the
dequantized weights times x within its activation rounding (two 8-bit parts: ~2^-15 of a block)."""
import shutil

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from kvserve.model.layers import Linear
from kvserve.model.quant import BlockTensor, GgufMethod, pack_gguf_rows, unpack_gguf_rows
from kvserve.ops import cpu_kernels

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler")
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]


def blocks(qtype, n, k, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    w[0, :32] += 0.3                        # a block with an offset (Q4_1's m matters)
    return BlockTensor(quantize(w, qtype), qtype, (n, k))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n", [16, 40, 3])
def test_pack_keeps_the_files_values(qtype, n):
    bt = blocks(qtype, n, 96)
    packed, kind = pack_gguf_rows(bt)
    assert kind == (8 if qtype == Q.Q8_0 else 4)
    ref = torch.from_numpy(dequantize(bt.raw, qtype)).reshape(n, 96)
    assert torch.equal(unpack_gguf_rows(packed, kind, (n, 96)), ref)
    assert packed.numel() == -(-n // 16) * 3 * (544 if kind == 8 else 320)


def _lib_or_skip(portable):
    if cpu_kernels._library(portable) is None:
        pytest.skip("C kernels unavailable")


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize("qtype", TYPES)
def test_gemv_matches_dequantized_matmul(qtype, portable):
    _lib_or_skip(portable)
    n, k = 40, 160
    bt = blocks(qtype, n, k)
    packed, kind = pack_gguf_rows(bt)
    W = torch.from_numpy(dequantize(bt.raw, qtype)).reshape(n, k).double()
    g = torch.Generator().manual_seed(1)
    for m in (1, 2, 3, 4, 5, 9):           # one and several passes of MAX_M = 4 rows
        x = torch.randn(m, k, generator=g) * 2
        x[0, 5] = 40.0                      # an outlier only costs precision inside its block
        ref = x.double() @ W.t()
        got = cpu_kernels.gguf_gemv(packed, kind, n, x, portable=portable).double()
        # per output: |error| <= sum over blocks of |w| * (block max |x|) * 2^-15, with margin
        bound = (W.abs() @ x.abs().reshape(m, -1, 32).amax(-1).repeat_interleave(32, 1).double().t()).t() * 2 ** -14
        assert ((got - ref).abs() <= bound + 1e-6).all(), (got - ref).abs().max()


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_gemv_bias_accumulate_and_strided_rows(portable):
    _lib_or_skip(portable)
    n, k = 24, 64
    bt = blocks(Q.Q4_1, n, k)
    packed, kind = pack_gguf_rows(bt)
    W = torch.from_numpy(dequantize(bt.raw, Q.Q4_1)).reshape(n, k)
    x_wide = torch.randn(3, k + 32)
    x = x_wide[:, 16:16 + k]                # rows with a leading dimension larger than k
    bias = torch.randn(n)
    out = torch.full((3, n + 8), 7.0)[:, :n]
    cpu_kernels.gguf_gemv(packed, kind, n, x, out=out, bias=bias, accumulate=True, portable=portable)
    assert torch.allclose(out, 7.0 + x @ W.t() + bias, atol=1e-3)


def test_native_and_portable_builds_agree():
    _lib_or_skip(False)
    _lib_or_skip(True)
    for qtype in TYPES:
        bt = blocks(qtype, 48, 128, seed=3)
        packed, kind = pack_gguf_rows(bt)
        x = torch.randn(6, 128)
        a = cpu_kernels.gguf_gemv(packed, kind, 48, x)
        b = cpu_kernels.gguf_gemv(packed, kind, 48, x, portable=True)
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)     # same integers; float sums in another order


def test_gguf_method_small_and_large_batches():
    """GgufMethod: up to C_ROWS rows run the C kernel, more rows fbgemm fp16 on the same values."""
    if not cpu_kernels.gguf_gemv_fast():
        pytest.skip("no SIMD build of the GEMV here")
    bt = blocks(Q.Q4_1, 96, 64)
    lin = Linear(64, [40, 56], bias=True, quant_method=GgufMethod())
    lin.load_weight(BlockTensor(bt.raw[:40], Q.Q4_1, (40, 64)), 0)
    lin.load_weight(BlockTensor(bt.raw[40:], Q.Q4_1, (56, 64)), 1)
    b = torch.randn(96)
    lin.load_bias(b[:40], 0)
    lin.load_bias(b[40:], 1)
    W = torch.from_numpy(dequantize(bt.raw, Q.Q4_1)).reshape(96, 64)
    assert torch.equal(lin.quant_method.dequantized(lin), W)
    for rows in (1, GgufMethod.C_ROWS, GgufMethod.C_ROWS + 1, 33):
        x = torch.randn(rows, 64)
        ref = x @ W.t() + b
        assert torch.allclose(lin(x), ref, atol=2e-3, rtol=1e-3), rows


def test_gguf_method_takes_dense_weights_as_fp16():
    """A weight the loader already dequantized (another GGUF type) has no packed copy: fp16 path."""
    w = torch.randn(32, 64) * 0.1
    lin = Linear(64, 32, quant_method=GgufMethod())
    lin.load_weight(w)
    assert lin.gguf_packed is None
    x = torch.randn(2, 64)
    assert torch.allclose(lin(x), x @ w.half().float().t(), atol=1e-4)


def test_batch_weights_are_built_on_first_need_or_ahead():
    """The fp16 copy does not exist until a large batch (or prepare_batch_weights) needs it; the
    kernel choice depends only on rows, so the outputs are the same either way."""
    from torch import nn

    from kvserve.model.quant import prepare_batch_weights
    if not cpu_kernels.gguf_gemv_fast():
        pytest.skip("no SIMD build of the GEMV here")

    def make():
        bt = blocks(Q.Q8_0, 48, 64, seed=5)
        lin = Linear(64, 48, quant_method=GgufMethod())
        lin.load_weight(bt)
        return lin
    lazy, ahead = make(), make()
    assert lazy._fp16 is None and ahead._fp16 is None
    assert prepare_batch_weights(nn.Sequential(ahead)) == 1 and ahead._fp16 is not None
    assert prepare_batch_weights(nn.Sequential(ahead)) == 0
    small, big = torch.randn(3, 64), torch.randn(GgufMethod.C_ROWS + 5, 64)
    assert torch.equal(lazy(small), ahead(small)) and lazy._fp16 is None
    assert torch.equal(lazy(big), ahead(big)) and lazy._fp16 is not None
