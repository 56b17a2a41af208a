"""Packed weight formats (kvserve.model.quant) against dequantized references."""

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from kvserve.model.layers import Linear
from kvserve.model.quant import BlockTensor, Fp16Method, Int4Method, Int8Method, quantize_int4_rows
from kvserve.model.quant import int8 as int8_mod


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fused(method, w, b=None, shards=(40, 56)):
    lin = Linear(w.shape[1], list(shards), bias=b is not None, quant_method=method)
    start = 0
    for i, n in enumerate(shards):
        lin.load_weight(w[start : start + n], i)
        if b is not None:
            lin.load_bias(b[start : start + n], i)
        start += n
    return lin


def fbgemm_activation(x, reduce_range):
    """What Int8Method(fbgemm) feeds the GEMM: each row scaled by its absmax, then fbgemm's dynamic
    quantization (per tensor, asymmetric uint8, 7 bits with reduce_range), then the scale undone."""
    r = x.abs().amax(-1, keepdim=True)
    return _fbgemm_per_tensor(x / r, reduce_range) * r


def _fbgemm_per_tensor(x, reduce_range):
    lo, hi = min(x.min().item(), 0.0), max(x.max().item(), 0.0)
    qmax = 127 if reduce_range else 255
    s = torch.tensor((hi - lo) / qmax, dtype=torch.float32).item()
    zp = round(-lo / s)
    return ((torch.round(x / s) + zp).clamp(0, qmax) - zp) * s


@pytest.mark.parametrize("reduce_range", [False, True])
def test_int8_linear_matches_dequantized_matmul(reduce_range):
    if not reduce_range and not int8_mod._has_vnni():
        with pytest.raises(ValueError, match="reduce_range=False needs a CPU with VNNI"):
            Int8Method(kernel="fbgemm", reduce_range=False)
        pytest.skip(
            "no VNNI on this CPU: fbgemm's AVX2 int16 path saturates without reduce_range, "
            "so Int8Method refuses reduce_range=False (checked above)"
        )
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    lin = fused(Int8Method(kernel="fbgemm", reduce_range=reduce_range), w, b)
    W = lin.quant_method.dequantized(lin)
    assert (W - w).abs().max() <= (w.abs().amax(1) / 254).max() + 1e-6  # half a step per row
    for rows in (1, 7, 64):
        x = torch.randn(rows, 64, generator=g) * 3
        x[0] *= 1000  # one outlier token must not flatten the others
        ref = fbgemm_activation(x, reduce_range) @ W.t() + b
        assert (lin(x) - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
        exact = x @ W.t() + b  # per-token 8-bit: every row within ~1% of its own range
        err = (lin(x) - exact).abs().amax(1) / exact.abs().amax(1)
        assert err.max().item() < 0.05, err


def test_int8_refuses_full_range_without_vnni(monkeypatch):
    monkeypatch.setattr(int8_mod, "_has_vnni", lambda: False)
    with pytest.raises(ValueError, match="use reduce_range=True"):
        Int8Method(kernel="fbgemm", reduce_range=False)
    assert Int8Method(kernel="fbgemm").reduce_range is True  # the default on such a CPU
    monkeypatch.setattr(int8_mod, "_has_vnni", lambda: True)
    assert Int8Method(kernel="fbgemm", reduce_range=False).reduce_range is False


def test_int8_weight_only_matches_dequantized_matmul():
    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    lin = fused(Int8Method(kernel="int8pack"), w, b)
    W = lin.quant_method.dequantized(lin)
    for rows in (1, 7, 64):
        x = torch.randn(rows, 64, generator=g)
        ref = (
            x.bfloat16().float()
            @ (lin.qweight.float() * lin.wscale.bfloat16().float()[:, None]).t()
            + b
        )
        assert (lin(x) - ref).abs().max().item() < 1e-2 * ref.abs().max().item()
        assert (lin(x) - (x @ W.t() + b)).abs().max().item() < 2e-2 * ref.abs().max().item()


def test_int4_dense_quantizer_and_kernel():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    lin = fused(Int4Method(), w, b)
    q, d, m = quantize_int4_rows(w)
    ref_w = q.float() * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)
    W = lin.quant_method.dequantized(lin)
    assert torch.equal(W, ref_w)  # packing loses nothing
    assert (W - w).abs().max() <= (d.max() / 2) * 1.001
    x = torch.randn(5, 64, generator=g)
    ref = x.bfloat16().float() @ W.t() + b  # bf16 activations, fp32 weights
    assert (lin(x) - ref).abs().max().item() < 1e-2 * ref.abs().max().item()


def test_int4pack_convention_fp32_is_exact():
    """The kernel's fp32 path reproduces (q - 8) * scale + zero: Q4_1's d * q + m with
    zero = m + 8d."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 96, generator=g)
    lin = fused(Int4Method(compute_dtype=torch.float32), w, shards=(64,))
    W = lin.quant_method.dequantized(lin)
    out = lin(torch.eye(96)).t()
    assert (out - W).abs().max().item() < 1e-5 * W.abs().max().item()


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_gguf_blocks_load_bit_exact(qtype):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((48, 128)).astype(np.float32)
    raw = quantize(w, qtype)  # [48, bytes per row]
    ref = torch.from_numpy(dequantize(raw, qtype))
    bt = BlockTensor(raw, qtype, (48, 128))
    assert torch.equal(bt.dequantize(), ref)
    lin = Linear(128, [16, 32], quant_method=Int4Method())
    lin.load_weight(BlockTensor(raw[:16], qtype, (16, 128)), 0)
    lin.load_weight(BlockTensor(raw[16:], qtype, (32, 128)), 1)
    assert torch.equal(
        lin.quant_method.dequantized(lin), ref
    )  # nibbles and scales kept as they are
    x = torch.randn(3, 128)
    ref_y = x.bfloat16().float() @ ref.t()
    assert (lin(x) - ref_y).abs().max().item() < 1e-2 * ref_y.abs().max().item()


def test_gguf_q4_1_of_default_model_bit_exact():
    from kvserve.model.gguf_loader import GGUFFile, gguf_arch, iter_gguf_weights
    from tests.conftest import default_model_or_skip

    path = default_model_or_skip()
    g = GGUFFile(path)
    arch = gguf_arch(g)
    seen = 0
    for name, bt in iter_gguf_weights(g, arch, keep_blocks=(Q.Q4_1,)):
        if not isinstance(bt, BlockTensor) or not name.startswith("model.layers.0."):
            continue
        ref = torch.from_numpy(dequantize(bt.raw, bt.qtype)).reshape(bt.shape)
        lin = Linear(bt.shape[1], bt.shape[0], quant_method=Int4Method())
        lin.load_weight(bt)
        assert torch.equal(lin.quant_method.dequantized(lin), ref), name
        seen += 1
    assert seen == 7


def test_fp16_method_is_fp32_math_on_fp16_weights():
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    lin = fused(Fp16Method(), w, b)
    assert torch.equal(lin.quant_method.dequantized(lin), w.half().float())
    for rows in (1, 3, 64):
        x = torch.randn(rows, 64, generator=g)
        ref = x @ w.half().float().t() + b
        assert (lin(x) - ref).abs().max().item() < 1e-4 * ref.abs().max().item()


def test_int4_batch_fp16_path_uses_the_same_weights():
    """Rows <= SMALL_BATCH run int4pack (bf16 activations), more rows run fbgemm fp16 on the same
    int4 values: both match the dequantized matmul, the fp16 path to fp32 accuracy."""
    g = torch.Generator().manual_seed(8)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    lin = fused(Int4Method(batch_fp16=True), w, b)
    W = lin.quant_method.dequantized(lin)
    small, big = Int4Method.SMALL_BATCH, Int4Method.SMALL_BATCH + 1
    x = torch.randn(big, 64, generator=g)
    exact = x @ W.t() + b
    y_big = lin(x)  # fbgemm fp16 path
    assert (y_big - exact).abs().max().item() < 2e-3 * exact.abs().max().item()
    y_small = lin(x[:small])  # int4pack path
    assert (y_small - exact[:small]).abs().max().item() < 1e-2 * exact.abs().max().item()
    assert (y_big - exact).abs().max() < (y_small - exact[:small]).abs().max() + 1e-6
