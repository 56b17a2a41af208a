"""GPTQ and AWQ checkpoints (Hugging Face directories whose config.json carries a
`quantization_config` with quant_method "gptq" or "awq"): each quantized linear's qweight, qzeros,
scales (and GPTQ's g_idx) become one GGUF Q4_1 BlockTensor, so the gguf formats pack it as the
C kernels' kind 4 (kvserve.ops.gguf_blocks) like a Q4_1 file's weight, and the model can run on
the C layer stack.

Both formats hold w = (q - z) s per group of input columns: q 4-bit, z an integer zero, s fp16.
Q4_1 holds w = d q + m per block of 32 input columns, d and m fp16. So per block d = s (a group
of 64 or 128 spans 2 or 4 blocks with the same d and m) and m = -z s rounded to fp16: the one
place a value changes. d q is exact in float32 (an fp16 times a 4-bit integer), so a weight
differs from (q - z) s only by m's rounding, at most 2^-11 |z s| (plus float32's own rounding of
the sum; an fp16 subnormal m: 2^-25 absolute). z s is exact in fp16 when z is a power of two,
so symmetric checkpoints (z = 8) and GPTQ's z = 16 come through bit-exact.

Layouts (int32 words, 4-bit fields at bit offset 4 j):
    GPTQ  qweight [in / 8, out]: input row 8 i + j in field j of word i (packed along the input);
          qzeros [groups, out / 8]: output column 8 c + j in field j; scales fp16 [groups, out];
          g_idx int32 [in], the group of each input column. checkpoint_format "gptq" (v1) stores
          z - 1 (z = field + 1), "gptq_v2" stores z.
    AWQ   (AutoAWQ's GEMM version) qweight [in, out / 8] and qzeros [groups, out / 8], both
          packed along the output with output column 8 c + ORDER[j] in field j, ORDER = [0, 2,
          4, 6, 1, 3, 5, 7]; scales fp16 [groups, out]; z as stored.

A weight whose groups do not line up with blocks of 32 (act-order g_idx that is not constant
over each block, a group size that is not a multiple of 32), whose scales are not fp16 values,
whose m overflows fp16, or of 2 or 8 bits (GPTQ) is dequantized to float32 instead, exactly
(q - z) s, and the reason is logged naming the tensor: it stays dense, off the C layer stack.
Layouts that cannot be read (3-bit GPTQ, other checkpoint formats, AWQ versions other than
GEMM) raise ValueError naming the fix.

The float LM head (the tied embedding, or an untied lm_head) is quantized at load to Q8_0 blocks
when the format keeps blocks packed (the gguf formats): a dense float32 head would be the largest
weight streamed per decoded token. Q8_0 is what llama-quantize gives a tied output whose width is
not a multiple of 256 (the default model's head), and it is reproduced bit for bit here (ggml's
quantize_row_q8_0_ref); for other widths llama-quantize picks Q6_K, which has no reference
quantizer in gguf-py. --lm-head-format float (ModelConfig.lm_head_format) keeps the checkpoint's
float head.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.config import LM_HEAD_FORMATS, lm_head_format
from kvserve.model.quant.blocks import GROUP, BlockTensor
from kvserve.ops.gguf_types import GGMLQuantizationType as Q

log = logging.getLogger("kvserve.model")

METHODS = ("gptq", "awq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # field j of an AWQ word holds output column 8 c + ORDER[j]
PARTS = ("qweight", "qzeros", "scales", "g_idx")  # a quantized linear's tensors (g_idx: GPTQ)


@dataclass(frozen=True)
class Int4Config:
    """A checkpoint's quantization_config, read: `zero_offset` is what the file's zero fields
    lack (1 for GPTQ v1: the stored zero is z - 1)."""

    method: str  # "gptq" | "awq"
    bits: int
    group_size: int  # input columns per group; -1 or 0: one group per row
    zero_offset: int


def read_config(cfg: dict, path: str = "") -> Int4Config | None:
    """The GPTQ / AWQ settings of an HF config.json dict (None: not such a checkpoint). An older
    AutoGPTQ directory keeps them in quantize_config.json beside it. ValueError naming the fix
    for a variant whose layout cannot be read."""
    qc = cfg.get("quantization_config")
    if qc is None and path and os.path.isfile(os.path.join(path, "quantize_config.json")):
        with open(os.path.join(path, "quantize_config.json"), encoding="utf-8") as f:
            qc = {"quant_method": "gptq", **json.load(f)}
    if not isinstance(qc, dict) or str(qc.get("quant_method", "")).lower() not in METHODS:
        return None
    method = str(qc["quant_method"]).lower()
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    group = int(qc.get("group_size", qc.get("q_group_size", 128)) or -1)
    where = f"{path}: " if path else ""
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm" or bits != 4:
            raise ValueError(
                f"{where}AWQ version {version!r} with {bits} bits is not supported: kvserve reads "
                "AutoAWQ's 4-bit GEMM layout (re-save the model with version='gemm', w_bit=4)"
            )
        return Int4Config("awq", 4, group, 0)
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(
            f"{where}GPTQ checkpoint_format {fmt!r} is not supported: kvserve reads 'gptq' and "
            "'gptq_v2' (convert it back with gptqmodel, e.g. save with format='gptq')"
        )
    if 32 % bits:
        raise ValueError(
            f"{where}{bits}-bit GPTQ is not supported: kvserve reads 2, 4 and 8 bits (4 runs on "
            "the C kernels); requantize with bits=4"
        )
    return Int4Config("gptq", bits, group, 1 if fmt == "gptq" else 0)


def read_dir_config(path: str) -> Int4Config | None:
    """read_config of an HF directory (None: not a directory, or not GPTQ / AWQ)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        return None
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return read_config(json.load(f), path)


def head_type(packed: bool, setting: str = LM_HEAD_FORMATS[0]) -> str:
    """How the float LM head of a GPTQ / AWQ checkpoint is held: `setting`
    (ModelConfig.lm_head_format: "q8_0" or "float") where the format keeps blocks packed
    (`packed`), else "float". ValueError naming the accepted values for another setting."""
    want = lm_head_format(setting)
    return want if packed else "float"


def head_name(tied: bool) -> str:
    """The checkpoint tensor the LM head is loaded from."""
    return "model.embed_tokens.weight" if tied else "lm_head.weight"


def quantize_q8_0(w: torch.Tensor) -> BlockTensor:
    """A float matrix [out, in] (in a multiple of 32) -> Q8_0 blocks, ggml's
    quantize_row_q8_0_ref bit for bit: per block of 32, d = max |x| / 127 in float32, q =
    roundf(x / d) (halves away from zero), d stored as fp16."""
    out, cols = w.shape
    if cols % GROUP:
        raise ValueError(f"Q8_0 needs a multiple of {GROUP} columns, got {cols}")
    x = w.float().reshape(out, -1, GROUP)
    d = x.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    v = x * inv
    q = (v.sign() * torch.floor(v.abs() + 0.5)).to(torch.int8)
    raw = torch.cat([d.half().view(torch.uint8), q.view(torch.uint8)], dim=-1)
    return BlockTensor(raw.reshape(out, -1).numpy(), Q.Q8_0, (out, cols))


def convert_weights(
    weights, qc: Int4Config, names: set[str], head: str = "float", tied: bool = False
):
    """(name, tensor) pairs of a checkpoint -> the same, with each quantized linear's tensors
    (`names`: every tensor name of the checkpoint, to know which a linear has) replaced by one
    `<prefix>.weight`: a Q4_1 BlockTensor, or a float32 tensor where the layout does not map
    (logged). `head` "q8_0" quantizes the float LM head (head_name(tied)) to Q8_0 blocks.
    ValueError for a linear whose tensors are incomplete."""
    staged: dict[str, dict] = {}
    reasons: set[str] = set()
    head_tensor = head_name(tied) if head == "q8_0" else None
    for name, w in weights:
        prefix, _, part = name.rpartition(".")
        if name == head_tensor and w.dim() == 2 and w.shape[1] % GROUP == 0:
            log.info(
                "LM head%s: float %s quantized to Q8_0 at load (--lm-head-format float keeps "
                "it float)",
                " (tied to the embedding)" if tied else "",
                tuple(w.shape),
            )
            yield name, quantize_q8_0(w)
            continue
        if part not in PARTS or f"{prefix}.qweight" not in names:
            yield name, w
            continue
        got = staged.setdefault(prefix, {})
        got[part] = w
        want = [p for p in PARTS if f"{prefix}.{p}" in names]
        if len(got) == len(want):
            del staged[prefix]
            yield f"{prefix}.weight", convert_linear(prefix, got, qc, reasons)
    if staged:
        prefix = sorted(staged)[0]
        raise ValueError(
            f"{prefix}: the checkpoint lacks "
            f"{[p for p in PARTS[:3] if p not in staged[prefix]]} of this quantized linear"
        )


def convert_linear(prefix: str, t: dict, qc: Int4Config, reasons: set | None = None):
    """One linear's tensors -> a Q4_1 BlockTensor [out, in], or the exact float32 weight with
    the reason logged (the first time for each reason; `reasons` keeps those seen)."""
    for p in PARTS[:3]:
        if p not in t:
            raise ValueError(f"{prefix}: the checkpoint has no {prefix}.{p} for this linear")
    q, z, s = unpack(prefix, t, qc)
    groups = _groups(prefix, t.get("g_idx"), qc, q.shape[1], s.shape[0])
    why = _unpackable(q, s, z, groups, qc)
    if why is None:
        return to_q4_1(q, z, s, groups)
    msg = f"{prefix}: {why}; dequantized to float32 (kept dense, off the C layer stack)"
    if reasons is None or why not in reasons:
        log.warning(msg)
    else:
        log.info(msg)
    if reasons is not None:
        reasons.add(why)
    return dequantize(q, z, s, groups)


def _fields(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., n] -> int16 [..., n, 32 / bits]: field j of each word (bit offset bits j)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).to(torch.int16)


def unpack(prefix: str, t: dict, qc: Int4Config):
    """A linear's packed tensors -> (q int16 [out, in], z int16 [groups, out], s [groups, out])
    in natural order, z the zero itself (GPTQ v1's offset added)."""
    qweight, qzeros, s = t["qweight"], t["qzeros"], t["scales"]
    per = 32 // qc.bits
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"{prefix}: qweight and qzeros must be int32, got {qweight.dtype}")
    if qc.method == "gptq":
        q = _fields(qweight.t(), qc.bits).reshape(qweight.shape[1], -1)  # [out, in]
        z = _fields(qzeros, qc.bits).reshape(qzeros.shape[0], -1)
    else:
        order = torch.tensor(AWQ_ORDER).argsort()  # natural column k is field order^-1[k]
        q = _fields(qweight, 4)[..., order].reshape(qweight.shape[0], -1).t()
        z = _fields(qzeros, 4)[..., order].reshape(qzeros.shape[0], -1)
    z = z + qc.zero_offset
    if s.dim() != 2 or z.shape != s.shape or s.shape[1] != q.shape[0]:
        raise ValueError(
            f"{prefix}: scales {tuple(s.shape)}, qzeros {tuple(qzeros.shape)} and qweight "
            f"{tuple(qweight.shape)} do not describe one {qc.method.upper()} {qc.bits}-bit "
            f"layout ({per} values per int32)"
        )
    return q.contiguous(), z, s


def _groups(prefix, g_idx, qc: Int4Config, cols: int, ngroups: int) -> torch.Tensor:
    """The group of each input column: g_idx, else column // group_size."""
    if g_idx is not None:
        g = g_idx.to(torch.int64).reshape(-1)
        if g.numel() != cols or (cols and (int(g.min()) < 0 or int(g.max()) >= ngroups)):
            raise ValueError(
                f"{prefix}.g_idx must give each of the {cols} input columns a group in "
                f"[0, {ngroups})"
            )
        return g
    size = qc.group_size if qc.group_size > 0 else cols
    g = torch.arange(cols) // size
    if cols and int(g[-1]) >= ngroups:
        raise ValueError(
            f"{prefix}: {cols} input columns in groups of {size} need {int(g[-1]) + 1} rows of "
            f"scales, the checkpoint has {ngroups} (group_size in quantization_config)"
        )
    return g


def _m(z, s) -> np.ndarray:
    """m = -z s rounded to fp16, [groups, out] (z s is exact in float32)."""
    with np.errstate(over="ignore"):  # inf: _unpackable's overflow check
        return (-(z.float() * s.float())).numpy().astype(np.float16)


def _unpackable(q, s, z, groups, qc: Int4Config) -> str | None:
    """Why this weight cannot become Q4_1 blocks (None: it can)."""
    if qc.bits != 4:
        return f"{qc.bits}-bit weights (the packed 4-bit kind takes 4 bits)"
    cols = q.shape[1]
    if cols % GROUP:
        return f"{cols} input columns, not a multiple of {GROUP}"
    blocks = groups.reshape(-1, GROUP)
    if (blocks != blocks[:, :1]).any():
        return (
            "the groups of its input columns (g_idx: act-order / desc_act, or a group size not "
            f"a multiple of {GROUP}) are not constant over each block of {GROUP}"
        )
    if s.dtype != torch.float16 and not torch.equal(s.half().to(s.dtype), s):
        return f"its {s.dtype} scales are not fp16 values"
    if not np.isfinite(_m(z, s)).all() or not torch.isfinite(s).all():
        return "a zero point times its scale overflows fp16"
    return None


def to_q4_1(q, z, s, groups) -> BlockTensor:
    """q [out, in] (0..15), z, s [groups, out], the group of each input column -> a Q4_1
    BlockTensor [out, in]: per block of 32, fp16 d = s, fp16 m = -z s, then 16 bytes of q[t] |
    q[t + 16] << 4 (GGUF's block)."""
    out, cols = q.shape
    g = groups[::GROUP].numpy()  # each block's group
    d = s.half().numpy().T[:, g]  # [out, nb]
    m = _m(z, s).T[:, g]
    qb = q.numpy().astype(np.uint8).reshape(out, -1, GROUP)
    qs = qb[..., :16] | (qb[..., 16:] << 4)
    raw = np.concatenate(
        [d[..., None].view(np.uint8), m[..., None].view(np.uint8), qs], axis=-1
    ).reshape(out, -1)
    return BlockTensor(np.ascontiguousarray(raw), Q.Q4_1, (out, cols))


def dequantize(q, z, s, groups) -> torch.Tensor:
    """The exact float32 weight [out, in]: (q - z) s with each column's group's zero and scale
    ((q - z) is a small integer: its product with an fp16 scale is exact in float32)."""
    zz = z.t()[:, groups].float()
    ss = s.t()[:, groups].float()
    return ((q.float() - zz) * ss).contiguous()


def tensor_names(path: str) -> set[str]:
    """Every tensor name of the HF directory's safetensors files (read from their headers)."""
    from safetensors import safe_open

    from kvserve.model.hf_loader import safetensors_files

    names: set[str] = set()
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            names.update(f.keys())
    return names
