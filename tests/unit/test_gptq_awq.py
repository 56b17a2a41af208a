"""GPTQ / AWQ linears (kvserve.model.quant.hf_int4) against a reference written here from each
format's published layout: a round-to-nearest quantizer per group, packers that place every
4-bit field where GPTQ (AutoGPTQ / gptqmodel) and AutoAWQ's GEMM version put it, and the formats'
dequantization (q - z) s. The Q4_1 blocks kvserve makes must give that weight up to the fp16
rounding of m = -z s (bounded here), bit-exact where z is a power of two; layouts that do not map
must come back as the exact float weight with the reason logged."""

import logging

import numpy as np
import pytest
import torch

from kvserve.model.quant import hf_int4
from kvserve.model.quant.blocks import BlockTensor
from kvserve.ops.gguf_blocks import pack_gguf_rows, unpack_gguf_rows
from kvserve.ops.gguf_types import GGMLQuantizationType as Q

OUT, IN = 48, 256  # 48 rows: the packed kind's last group of 16 rows is padded
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: field j holds output column 8 c + ORDER[j]


def group_params(wg, bits: int, sym: bool):
    """Each row's zero point (int64) and fp16 scale over the columns wg [out, cols] of one group:
    min/max asymmetric, or symmetric with z = 2^(bits-1). Computed in wg's dtype."""
    top = (1 << bits) - 1
    if sym:
        s = (2 * wg.abs().amax(1) / top).clamp_min(1e-6).half()
        return torch.full((wg.shape[0],), (top + 1) // 2, dtype=torch.int64), s
    lo, hi = wg.amin(1).clamp_max(0), wg.amax(1).clamp_min(0)
    s = ((hi - lo) / top).clamp_min(1e-6).half()
    return torch.round(-lo / s.float()).clamp(0, top).long(), s


def quantize(w, groups, ngroups, sym, bits=4):
    """Round-to-nearest per group (group_params): q [out, in], z [ngroups, out] integers,
    s fp16 [ngroups, out]."""
    top = (1 << bits) - 1
    q = torch.zeros(w.shape, dtype=torch.int64)
    z = torch.zeros(ngroups, w.shape[0], dtype=torch.int64)
    s = torch.zeros(ngroups, w.shape[0], dtype=torch.float16)
    for g in range(ngroups):
        cols = (groups == g).nonzero().reshape(-1)
        wg = w[:, cols]
        zg, sg = group_params(wg, bits, sym)
        q[:, cols] = torch.clamp(torch.round(wg / sg.float()[:, None]) + zg[:, None], 0, top).long()
        z[g], s[g] = zg, sg
    return q, z, s


def reference(q, z, s, groups):
    """The formats' dequantization: (q - z) s, each column with its group's zero and scale."""
    return (q - z[groups].t()).double() * s[groups].t().double()


def rounded_m(q, z, s, groups):
    """The weight as Q4_1 blocks hold it (the documented rounding): d q + m in float32 with
    d = s and m = -z s rounded to fp16."""
    d = s[groups].t().float()
    m = (-(z[groups].t().double() * s[groups].t().double())).half().float()
    return q.float() * d + m


def words(fields, bits=4):
    """[..., 32 / bits] integer fields -> int32 [...]: field j at bit offset bits j."""
    acc = torch.zeros(fields.shape[:-1], dtype=torch.int64)
    for j in range(fields.shape[-1]):
        acc |= (fields[..., j] & ((1 << bits) - 1)) << (bits * j)
    return acc.to(torch.uint32).view(torch.int32)


def pack_gptq(q, z, s, g_idx, v1=True, bits=4):
    """GPTQ: qweight [in / per, out] along the input, qzeros [groups, out / per] along the
    output storing z - 1 (v1) or z (v2)."""
    per = 32 // bits
    qweight = words(q.t().reshape(q.shape[1] // per, per, q.shape[0]).transpose(1, 2), bits)
    zs = z - 1 if v1 else z
    qzeros = words(zs.reshape(z.shape[0], -1, per), bits)
    return {"qweight": qweight, "qzeros": qzeros, "scales": s, "g_idx": g_idx.to(torch.int32)}


def pack_awq(q, z, s):
    """AutoAWQ GEMM: qweight [in, out / 8] and qzeros [groups, out / 8] along the output, field j
    of word c holding column 8 c + ORDER[j]."""
    qt = q.t().reshape(q.shape[1], -1, 8)[..., AWQ_PACK_ORDER]
    zt = z.reshape(z.shape[0], -1, 8)[..., AWQ_PACK_ORDER]
    return {"qweight": words(qt), "qzeros": words(zt), "scales": s}


def make(method, group, sym, v1=True, seed=0, perm=None, bits=4):
    """A random weight quantized and packed: (tensors, config, reference weight, |z s|, the
    integers and scales (q, z, s, groups))."""
    torch.manual_seed(seed)
    w = torch.randn(OUT, IN) * 0.05 + torch.randn(OUT, 1) * 0.02  # rows off-centre: z varies
    order = torch.arange(IN) if perm is None else perm
    groups = torch.empty(IN, dtype=torch.int64)
    groups[order] = torch.arange(IN) // group
    ngroups = IN // group
    q, z, s = quantize(w, groups, ngroups, sym, bits)
    if method == "awq":
        t, qc = pack_awq(q, z, s), hf_int4.Int4Config("awq", 4, group, 0)
    else:
        t = pack_gptq(q, z, s, groups, v1, bits)
        qc = hf_int4.Int4Config("gptq", bits, group, 1 if v1 else 0)
    zs = (z[groups].t().double() * s[groups].t().double()).abs()
    return t, qc, reference(q, z, s, groups), zs, (q, z, s, groups)


def assert_within_m_rounding(ours, ref, zs):
    """|ours - ref| within m's fp16 rounding (2^-11 |z s|, 2^-25 for a subnormal) plus
    float32's rounding of d q + m."""
    err = (ours.double() - ref).abs()
    bound = zs * 2.0**-11 + 2.0**-25 + ref.abs() * 2.0**-23
    assert (err <= bound).all(), float((err - bound).max())


CASES = [("gptq", True), ("gptq", False), ("awq", False)]  # (method, GPTQ v1 zeros)


@pytest.mark.parametrize("method,v1", CASES, ids=["gptq-v1", "gptq-v2", "awq"])
@pytest.mark.parametrize("sym", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_blocks_hold_the_formats_weight(method, v1, sym, group):
    t, qc, ref, zs, parts = make(method, group, sym, v1)
    bt = hf_int4.convert_linear("model.layers.0.mlp.down_proj", t, qc)
    assert isinstance(bt, BlockTensor) and bt.qtype == Q.Q4_1 and bt.shape == (OUT, IN)
    ours = bt.dequantize()
    assert_within_m_rounding(ours, ref, zs)
    assert torch.equal(ours, rounded_m(*parts))
    if sym:  # z = 8: m = -8 s is exact in fp16, every weight bit-exact
        assert torch.equal(ours.double(), ref)
    else:  # the bound is not vacuous: m's rounding shows, and stays small
        assert (ours.double() != ref).any()
    packed, kind = pack_gguf_rows(bt)  # the C kernels' kind 4 holds the same values
    assert kind == 4
    assert torch.equal(unpack_gguf_rows(packed, kind, (OUT, IN)), ours)


def test_awq_field_order_matters():
    """Words packed in natural column order (not AWQ's) read as AWQ give another weight: the
    reader does apply the field order the format defines."""
    t, qc, ref, _, _ = make("awq", 64, False)
    q = hf_int4.unpack("x", t, qc)[0]
    t["qweight"] = words(q.t().reshape(IN, -1, 8))  # natural order within each word
    assert not torch.equal(hf_int4.convert_linear("x", t, qc).dequantize().double(), ref)


def test_trivial_g_idx_and_block_constant_g_idx_pack():
    """desc_act with g_idx constant over each block of 32 (whole blocks of columns in another
    group order) still maps onto blocks; g_idx decides each block's scale."""
    perm = torch.arange(IN).reshape(-1, 32)[torch.randperm(IN // 32)].reshape(-1)
    t, qc, ref, zs, _ = make("gptq", 64, False, perm=perm)
    bt = hf_int4.convert_linear("p", t, qc)
    assert isinstance(bt, BlockTensor)
    assert_within_m_rounding(bt.dequantize(), ref, zs)


@pytest.mark.parametrize("group", [32, 128])
def test_act_order_g_idx_is_dequantized_with_the_reason(group, caplog):
    perm = torch.randperm(IN, generator=torch.Generator().manual_seed(1))
    t, qc, ref, _, _ = make("gptq", group, False, perm=perm)
    with caplog.at_level(logging.WARNING, logger="kvserve.model"):
        w = hf_int4.convert_linear("model.layers.1.self_attn.q_proj", t, qc)
    assert isinstance(w, torch.Tensor) and w.dtype == torch.float32
    assert torch.equal(w.double(), ref)  # exact: (q - z) s in float32
    assert "model.layers.1.self_attn.q_proj" in caplog.text and "g_idx" in caplog.text


@pytest.mark.parametrize("bits", [2, 8])
def test_other_gptq_bits_are_dequantized(bits, caplog):
    t, qc, ref, _, _ = make("gptq", 64, False, bits=bits)
    with caplog.at_level(logging.WARNING, logger="kvserve.model"):
        w = hf_int4.convert_linear("layer.o_proj", t, qc)
    assert isinstance(w, torch.Tensor) and torch.equal(w.double(), ref)
    assert f"{bits}-bit" in caplog.text and "layer.o_proj" in caplog.text


def test_group_of_16_is_dequantized():
    t, qc, ref, _, _ = make("awq", 16, False)
    w = hf_int4.convert_linear("x", t, qc)
    assert isinstance(w, torch.Tensor) and torch.equal(w.double(), ref)


def test_read_config():
    rc = hf_int4.read_config
    assert rc({}) is None
    assert rc({"quantization_config": {"quant_method": "bitsandbytes"}}) is None
    g = rc({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}})
    assert g == hf_int4.Int4Config("gptq", 4, 128, 1)
    v2 = {"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "gptq_v2"}
    assert rc({"quantization_config": v2}).zero_offset == 0
    a = rc({"quantization_config": {"quant_method": "awq", "bits": 4, "version": "GEMM"}})
    assert a == hf_int4.Int4Config("awq", 4, 128, 0)
    for bad, fix in (
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version='gemm'"),
        ({"quant_method": "gptq", "bits": 3}, "bits=4"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "format='gptq'"),
    ):
        with pytest.raises(ValueError, match=fix):
            rc({"quantization_config": bad})


def test_convert_weights_groups_each_linears_tensors():
    t, qc, ref, zs, _ = make("awq", 128, False)
    names = {f"a.{k}" for k in t} | {"b.weight", "a.bias"}
    stream = [("a.qweight", t["qweight"]), ("b.weight", torch.ones(2)), ("a.bias", torch.ones(48))]
    stream += [("a.scales", t["scales"]), ("a.qzeros", t["qzeros"])]
    out = dict(hf_int4.convert_weights(iter(stream), qc, names))
    assert sorted(out) == ["a.bias", "a.weight", "b.weight"]
    assert_within_m_rounding(out["a.weight"].dequantize(), ref, zs)
    with pytest.raises(ValueError, match="qzeros"):
        list(hf_int4.convert_weights(iter(stream[:4]), qc, names))


def test_bad_shapes_name_the_tensor():
    t, qc, _, _, _ = make("gptq", 64, False)
    t["scales"] = t["scales"][:, :16]
    with pytest.raises(ValueError, match="lin"):
        hf_int4.convert_linear("lin", t, qc)
    t, qc, _, _, _ = make("gptq", 64, False)
    t["g_idx"] = t["g_idx"] + 100
    with pytest.raises(ValueError, match="lin.g_idx"):
        hf_int4.convert_linear("lin", t, qc)


def test_fp16_overflow_of_m_is_dequantized(caplog):
    t, qc, ref, _, _ = make("gptq", 64, False)
    t["scales"] = t["scales"].clone()
    t["scales"][0] = 30000.0  # z s > 65504 wherever z >= 3
    with caplog.at_level(logging.WARNING, logger="kvserve.model"):
        w = hf_int4.convert_linear("big", t, qc)
    assert isinstance(w, torch.Tensor) and np.isfinite(w.numpy()).all()
    assert "overflows fp16" in caplog.text


def test_q8_0_head_matches_gguf_py_bit_for_bit():
    """quantize_q8_0 is ggml's quantize_row_q8_0_ref (gguf-py's port): an all-zero block, exact
    halves and fp16 input included."""
    import gguf

    torch.manual_seed(0)
    w = torch.randn(40, 96) * 0.1
    w[0, :32] = 0
    w[1, :32] = torch.arange(32) - 15.5  # amax 16.5: many x / d land near halves
    w[2, 32:64] = 127 * 2.0**-6 * torch.tensor([0.5, -0.5, 1.5, -2.5] * 8)  # d = 2^-6: exact halves
    for x in (w, w.half()):
        ours = hf_int4.quantize_q8_0(x)
        want = gguf.quants.quantize(x.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
        assert ours.qtype == Q.Q8_0 and ours.shape == (40, 96)
        assert np.array_equal(ours.raw, want)
    with pytest.raises(ValueError, match="multiple of 32"):
        hf_int4.quantize_q8_0(torch.zeros(4, 48))


def test_head_type_setting():
    assert hf_int4.head_type(True) == "q8_0"
    assert hf_int4.head_type(False) == "float"  # a format that does not keep blocks
    assert hf_int4.head_type(True, "FLOAT") == "float"
    assert hf_int4.head_type(False, "q8_0") == "float"
    with pytest.raises(ValueError, match="lm_head_format must be one of.*q8_0.*'q6_k'"):
        hf_int4.head_type(True, "q6_k")


def test_head_format_is_an_engine_setting():
    from kvserve.config import make_engine_config

    cfg = make_engine_config("model-dir", lm_head_format="Float")
    assert cfg.model.lm_head_format == "float"
    with pytest.raises(ValueError, match="lm_head_format"):
        make_engine_config("model-dir", lm_head_format="q4")


@pytest.mark.parametrize("tied", [True, False])
def test_convert_weights_quantizes_only_the_head(tied, caplog):
    t, qc, _, _, _ = make("gptq", 32, False)
    emb, head = torch.randn(64, IN).half(), torch.randn(64, IN).half()
    tensors = {
        "model.embed_tokens.weight": emb,
        "lm_head.weight": head,
        "model.norm.weight": emb[0],
    }
    tensors.update({f"model.layers.0.mlp.down_proj.{k}": v for k, v in t.items()})
    with caplog.at_level(logging.INFO, logger="kvserve.model"):
        out = dict(
            hf_int4.convert_weights(tensors.items(), qc, set(tensors), head="q8_0", tied=tied)
        )
    quantized = "model.embed_tokens.weight" if tied else "lm_head.weight"
    other = "lm_head.weight" if tied else "model.embed_tokens.weight"
    assert isinstance(out[quantized], BlockTensor) and out[quantized].qtype == Q.Q8_0
    assert out[other] is tensors[other] and out["model.norm.weight"] is tensors["model.norm.weight"]
    assert out["model.layers.0.mlp.down_proj.weight"].qtype == Q.Q4_1
    assert "quantized to Q8_0 at load" in caplog.text
    # each weight within half a Q8_0 step of the float head, plus d's fp16 rounding times q
    back = unpack_gguf_rows(*pack_gguf_rows(out[quantized]), (64, IN))
    step = tensors[quantized].float().reshape(64, -1, 32).abs().amax(-1, keepdim=True) / 127
    err = (back - tensors[quantized].float()).reshape(64, -1, 32).abs()
    assert (err <= step * (0.5 + 127 * 2**-11) + 1e-7).all()
    plain = dict(hf_int4.convert_weights(tensors.items(), qc, set(tensors), tied=tied))
    assert plain[quantized] is tensors[quantized]
