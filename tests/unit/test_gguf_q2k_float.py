"""Kinds 10 (Q2_K), 32 (float weights: F32, F16, BF16) and 33, 34 (F16, BF16 in 16 bits) of
kvserve/ops/csrc/gguf_gemv.h: every build computes exactly the arithmetic the header writes down,
checked against independent numpy float32 versions that read the file's own bytes (not the packed
layout); packing float weights keeps their values; kinds 33 and 34 give kind 32's bits; GgufMethod
packs F16/BF16 tensors of a GGUF file as kinds 33/34, F32 ones as kind 32, and leaves other float
weights dense."""

import shutil

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from kvserve.model.layers import Linear
from kvserve.model.quant import GgufMethod
from kvserve.ops import cpu_kernels
from kvserve.ops.gguf_blocks import pack_float_parts, pack_gguf_rows, unpack_gguf_rows
from tests.unit.test_gguf_gemv import quantize_block_np
from tests.unit.test_gguf_kquants import acts, random_blocks

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)
HOST_ISAS = cpu_kernels.host_isas()
PARTS = ["two", "one", "mixed"]
f32 = np.float32


def _lib_or_skip(isa):
    if cpu_kernels.library(isa) is None:
        pytest.skip("C kernels unavailable")


def _x16(x, parts):
    """Per (row, block): x16 = 256 xa + xb [32] int64 and dx, as the contract quantizes x."""
    m, k = x.shape
    q = np.zeros((m, k // 32, 32), np.int64)
    dx = np.zeros((m, k // 32), f32)
    for r, row in enumerate(x.numpy().astype(f32)):
        for b in range(k // 32):
            xa, xb, dx[r, b] = quantize_block_np(row[32 * b : 32 * b + 32], parts)
            q[r, b] = 256 * xa + xb
    return q, dx


def reference_q2_k(raw, n, k, x, parts):
    """gguf_gemv.h's kind 10 from Q2_K's bytes (ggml's layout: 16 bytes of 4-bit scale | min << 4
    per 16 weights, 64 bytes of 2-bit q, fp16 d, fp16 dmin): per block of 32,
    acc += s0 (d0 dx); acc += s1 (d1 dx); acc += m0 (dx sq0); acc += m1 (dx (sq - sq0))."""
    b = raw.reshape(n, k // 256, 84)
    d = b[..., 80:82].copy().view(np.float16).astype(f32)  # [n, ns, 1]
    dmin = b[..., 82:84].copy().view(np.float16).astype(f32)
    sc, mn = (b[..., :16] & 15).astype(f32), (b[..., :16] >> 4).astype(f32)  # per 16 weights
    ds, ms = d * sc, -(dmin * mn)  # [n, ns, 16]: exact products
    q = np.zeros((n, k // 256, 256), np.int64)
    for half in range(2):  # 128 weights from 32 bytes: 4 shifts x (16 + 16 bytes)
        qs = b[..., 16 + 32 * half : 48 + 32 * half]
        for j in range(4):
            q[..., 128 * half + 32 * j : 128 * half + 32 * j + 32] = (qs >> (2 * j)) & 3
    q = q.reshape(n, k // 32, 32)
    ds, ms = ds.reshape(n, k // 32, 2), ms.reshape(n, k // 32, 2)
    x16, dx = _x16(x, parts)
    out = np.zeros((x.shape[0], n), f32)
    for r in range(x.shape[0]):
        acc = np.zeros(n, f32)
        for blk in range(k // 32):
            xr, e = x16[r, blk], dx[r, blk]
            s0 = (q[:, blk, :16] * xr[:16]).sum(1).astype(f32)
            s1 = (q[:, blk, 16:] * xr[16:]).sum(1).astype(f32)
            sq0, sq = xr[:16].sum(), xr.sum()
            acc = acc + s0 * (ds[:, blk, 0] * e)
            acc = acc + s1 * (ds[:, blk, 1] * e)
            acc = acc + ms[:, blk, 0] * (e * f32(sq0))
            acc = acc + ms[:, blk, 1] * (e * f32(sq - sq0))
        out[r] = acc
    return out


def reference_float(W, x, parts):
    """gguf_gemv.h's kind 32: per block, s = s + w_j x16_j for j in order; acc += s dx."""
    W = W.numpy().astype(f32)
    n, k = W.shape
    x16, dx = _x16(x, parts)
    out = np.zeros((x.shape[0], n), f32)
    for r in range(x.shape[0]):
        acc = np.zeros(n, f32)
        for blk in range(k // 32):
            s = np.zeros(n, f32)
            for j in range(32):
                s = s + W[:, 32 * blk + j] * f32(x16[r, blk, j])
            acc = acc + s * dx[r, blk]
        out[r] = acc
    return out


def _acts(m, k):
    x = acts(m, k, seed=5)
    x[1, 40:72] *= 1e-3  # a quiet block beside an outlier: mixed parts keep xb in some blocks
    x[1, 45] = 30.0
    return x


@pytest.mark.parametrize("parts", PARTS)
@pytest.mark.parametrize("isa", HOST_ISAS)
def test_q2_k_gemv_is_the_contract_bit_for_bit(isa, parts):
    _lib_or_skip(isa)
    n, k = 37, 512
    bt = random_blocks(Q.Q2_K, n, k, seed=3)
    packed, kind = pack_gguf_rows(bt)
    assert kind == 10
    x = _acts(5, k)
    got = cpu_kernels.gguf_gemv(packed, kind, n, x, isa=isa, parts=parts)
    assert torch.equal(got, torch.from_numpy(reference_q2_k(bt.raw, n, k, x, parts)))


def _float_weights(qtype, n, k, seed):
    """F32, F16 or BF16 values of a file (F16: the subnormals too) as float32, and their raw
    bytes."""
    g = np.random.default_rng(seed)
    w = (g.standard_normal((n, k)) * 0.05).astype(f32)
    w[0, :8] = [6e-8, -3e-6, 0.0, -0.0, 1e4, -1e-30, 3.0e-5, 65504.0]
    raw = w if qtype == Q.F32 else quantize(w, qtype)
    raw = np.ascontiguousarray(raw).view(np.uint8)
    return torch.from_numpy(dequantize(raw, qtype).reshape(n, k).astype(f32)), raw


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16])
@pytest.mark.parametrize("isa", HOST_ISAS)
def test_float_weights_gemv_is_the_contract_bit_for_bit(isa, qtype):
    _lib_or_skip(isa)
    n, k = 21, 96
    W, _ = _float_weights(qtype, n, k, seed=int(qtype))
    packed, kind = pack_float_parts([W[:5], W[5:]])
    assert kind == 32
    assert torch.equal(
        unpack_gguf_rows(packed, kind, (n, k)).view(torch.int32), W.view(torch.int32)
    )
    x = _acts(4, k)
    for parts in PARTS:
        got = cpu_kernels.gguf_gemv(packed, kind, n, x, isa=isa, parts=parts)
        assert torch.equal(got, torch.from_numpy(reference_float(W, x, parts))), parts
    # prompt tokens' float32 GEMM: exact weights, K fused multiply-adds
    got = cpu_kernels.gguf_gemv(packed, kind, n, x, isa=isa, f32=True)
    ref = x.double() @ W.double().t()
    bound = (x.double().abs() @ W.double().abs().t()) * k * 2**-24 + 1e-30
    assert ((got.double() - ref).abs() <= bound).all()
    ids = torch.tensor([20, 0, 16, 15, 3])
    assert torch.equal(cpu_kernels.gguf_rows(packed, kind, n, k, ids, isa=isa), W[ids])


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16])
@pytest.mark.parametrize("isa", HOST_ISAS)
def test_float_gemm_of_a_few_rows_gives_the_tiles_bits(isa, qtype, threads):
    """Float weights against at most GGUF_F32_FEW (4) rows take the float32 GEMM without tiles:
    each row gets the bits the tiles give it among 19 others (K across slices, a last group of
    5 rows, one and two threads), with the bias and accumulate of the tiles' writes."""
    _lib_or_skip(isa)
    n, k = 37, 288
    W, _ = _float_weights(qtype, n, k, seed=9)
    W.gguf_qtype = qtype
    packed, kind = pack_float_parts([W])
    x = _acts(20, k)
    bias = torch.randn(n)
    many = cpu_kernels.gguf_gemv(packed, kind, n, x, isa=isa, f32=True)
    for t in (1, 2):
        threads(t)
        for rows in ([0], [3, 17], [19, 2, 11], [5, 6, 7, 8]):
            few = cpu_kernels.gguf_gemv(packed, kind, n, x[rows].clone(), isa=isa, f32=True)
            assert torch.equal(few, many[rows]), (t, rows)
        out = torch.randn(3, n)
        want = out + many[[1, 4, 9]] + bias
        cpu_kernels.gguf_gemv(
            packed,
            kind,
            n,
            x[[1, 4, 9]].clone(),
            out=out,
            bias=bias,
            accumulate=True,
            isa=isa,
            f32=True,
        )
        assert torch.equal(out, want)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16])
@pytest.mark.parametrize("isa", HOST_ISAS)
def test_16_bit_float_kinds_give_kind_32s_bits(isa, qtype):
    """A file's F16 / BF16 weight packed in its 16 bits (kind 33 / 34, half kind 32's bytes):
    unpacked, every value is the file's; the GEMV (each activation parts), the float32 GEMM and row
    reads give the bits of kind 32 holding the same values."""
    _lib_or_skip(isa)
    n, k = 37, 160
    W, _ = _float_weights(qtype, n, k, seed=5)
    parts = [W[:20].clone(), W[20:].clone()]
    for p in parts:
        p.gguf_qtype = qtype
    packed, kind = pack_float_parts(parts)
    want_packed, want_kind = pack_float_parts([W])
    assert kind == {Q.F16: 33, Q.BF16: 34}[qtype] and want_kind == 32
    assert packed.numel() * 2 == want_packed.numel()
    assert torch.equal(
        unpack_gguf_rows(packed, kind, (n, k)).view(torch.int32), W.view(torch.int32)
    )
    x = _acts(9, k)
    for parts_ in PARTS:
        got = cpu_kernels.gguf_gemv(packed, kind, n, x, isa=isa, parts=parts_)
        want = cpu_kernels.gguf_gemv(want_packed, 32, n, x, isa=isa, parts=parts_)
        assert torch.equal(got, want), parts_
    got = cpu_kernels.gguf_gemv(packed, kind, n, x, isa=isa, f32=True)
    assert torch.equal(got, cpu_kernels.gguf_gemv(want_packed, 32, n, x, isa=isa, f32=True))
    ids = torch.tensor([36, 0, 16, 15, 3])
    assert torch.equal(cpu_kernels.gguf_rows(packed, kind, n, k, ids, isa=isa), W[ids])
    odd = W.clone()
    odd[3, 7] = 1 + 2**-20  # not a 16-bit value: such a weight stays float32
    odd.gguf_qtype = qtype
    assert pack_float_parts([odd])[1] == 32


def test_gguf_method_packs_a_files_float_tensors_and_only_those():
    _lib_or_skip(None)
    x = _acts(3, 64)
    for qtype in (Q.F16, Q.BF16, Q.F32):
        W, _ = _float_weights(qtype, 40, 64, seed=1)
        q, v = W[:32].clone(), W[32:].clone()
        q.gguf_qtype = v.gguf_qtype = qtype  # as kvserve.model.gguf_loader hands them over
        lin = Linear(64, [32, 8], quant_method=GgufMethod())
        lin.load_weight(q, 0)
        lin.load_weight(v, 1)
        kind = {Q.F16: 33, Q.BF16: 34, Q.F32: 32}[qtype]
        assert lin.dense_weight is None and lin.gguf_kind == kind and lin.dense_reason is None
        assert torch.equal(lin.quant_method.dequantized(lin), W)
        assert torch.equal(lin(x), torch.from_numpy(reference_float(W, x, "two")))
    lin = Linear(64, 40, quant_method=GgufMethod())  # a float checkpoint's weight: not a file's
    lin.load_weight(W.clone())
    assert lin.gguf_packed is None and lin.dense_reason == "its weights are not GGUF blocks"


def test_float_packing_refuses_rows_off_the_blocks():
    with pytest.raises(ValueError, match="blocks of 32 columns"):
        pack_float_parts([torch.zeros(16, 40)])


def _build_and_run(cc, flags, kernel, out, run=()):
    """tests/unit/csrc/generic_kinds_check.c linked with gguf_gemv.c and a kernel file, run
    (under `run`, e.g. qemu): its printed hashes."""
    import subprocess
    from pathlib import Path

    csrc = Path(cpu_kernels.__file__).parent / "csrc"
    check = Path(__file__).parent / "csrc" / "generic_kinds_check.c"
    exact = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno", "-fno-trapping-math"]
    srcs = [str(check), str(csrc / "gguf_gemv.c"), str(csrc / f"gguf_gemv_{kernel}.c")]
    cmd = [cc, *exact, *flags, f"-I{csrc}", *srcs, "-lm", "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return subprocess.run([*run, str(out)], check=True, capture_output=True, text=True).stdout


@pytest.mark.skipif(
    not (shutil.which("aarch64-linux-gnu-gcc") and shutil.which("qemu-aarch64")),
    reason="needs gcc-aarch64-linux-gnu, libc6-dev-arm64-cross and qemu-user",
)
def test_the_neon_build_prints_the_host_bits(tmp_path):
    """Kinds 10 and 32 (GEMV with each activation parts, float32 GEMM, row reads) built for
    aarch64 with the NEON kernel file, run under qemu-aarch64, and built for this host with the
    portable one: the same output bits (the host's ISA builds are compared above)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    want = _build_and_run(cc, [], "portable", tmp_path / "portable")
    assert want.count("\n") == 132
    try:
        got = _build_and_run(
            "aarch64-linux-gnu-gcc",
            ["-march=armv8.2-a+dotprod", "-static"],
            "neon",
            tmp_path / "neon",
            ["qemu-aarch64", "-cpu", "max"],
        )
    except Exception as e:  # no aarch64 C library: the cross compiler cannot link
        pytest.skip(f"aarch64 build failed: {e}")
    assert got == want
