"""Packed weight formats for `Linear` (the quant-method hooks of kvserve.model.layers).

    none   UnquantizedMethod: dense weights in the model dtype (GGUF blocks dequantized to fp32)
    int8   per-output-channel symmetric int8 weights, LM head included; weight-only kernel
           (_weight_int8pack_mm, bf16 activations) by default, fbgemm's dynamic int8 linear with
           KVSERVE_INT8_KERNEL=fbgemm (fastest; activations quantized per token, still ~5 points
           of top-1 agreement per layer kind on SmolLM2: see Int8Method)
    int4   group-32 asymmetric int4 weights, run by torch's int4pack CPU kernel (bf16 activations:
           its float32 path is a slow reference loop, 40x slower). GGUF Q4_0/Q4_1 blocks are taken
           as they are (same group of 32, same 16 levels): no dequantize/requantize round trip.
           The LM head is int8 (an int4 head costs +5.6% ppl on SmolLM2).
    gguf   the file's own blocks: Q4_0/Q4_1/Q8_0 (the default model's layers and its tied Q8_0 LM
           head) interleaved 16 rows at a time and run by our C kernel (ops/csrc/gguf_gemv.c,
           AVX-512 VNNI, activations as two 8-bit parts per block of 32) for up to 32 rows, and as
           the same values in an fbgemm fp16 weight for larger batches (GgufMethod). Without the
           kernel's SIMD build: Q4 blocks in int4pack for 1-2 rows, fbgemm fp16 above, and a
           fp16 LM head (Int4Method(batch_fp16=True), Fp16Method).

Kernel time of all linears of SmolLM2-135M (30 layers + the 49152x576 LM head), 1 thread,
2-core AVX-512-VNNI dev box (before the C kernel; it takes 4.1 ms at batch 1 with 2 threads, and
is as fast as fbgemm fp16 at 32 rows):
                                  batch 1     batch 64
    fp32 F.linear                 19.3 ms     242 ms
    int8 fbgemm dynamic            4.9 ms      33 ms
    int8 int8pack (bf16 act.)      6.8 ms     156 ms
    int4 int4pack (bf16 act.)      5.9 ms     127 ms
    int4pack / int8pack, fp32 act. 248 / 111 ms (reference loops: never use)
The default for GGUF models is the fastest format within the quality bound of
`kvserve eval-quality` (DEFAULT_GGUF below).

int4pack's convention (checked against the kernel): w = (q - 8) * scale + zero, q in 0..15, with
scale/zero laid out as [K / group, N, 2]. GGUF Q4_1 is w = d * q + m, so scale = d and
zero = m + 8 d; Q4_0 is w = d * (q - 8), so scale = d and zero = 0.
"""
from __future__ import annotations

import functools
import os
import threading
import warnings

import numpy as np
import torch
from torch import nn

from kvserve.model.layers import Linear, dense
from kvserve.ops import cpu_kernels

FORMATS = ("none", "int8", "int4", "gguf")
GROUP = 32


# ---------------------------------------------------------------- GGUF blocks, not dequantized

class BlockTensor:
    """A GGUF tensor still in its quantized blocks: `raw` [rows, bytes_per_row] uint8.
    Has a `.shape` like a weight so Linear.load_weight can check it; `dequantize()` gives the
    float32 tensor (bit-identical to gguf.quants.dequantize)."""

    def __init__(self, raw: np.ndarray, qtype, shape: tuple[int, ...]):
        self.raw, self.qtype, self.shape = raw, qtype, tuple(shape)

    def dequantize(self) -> torch.Tensor:
        from kvserve.model.gguf_loader import dequantize_rows
        return dequantize_rows(self.raw, self.qtype).reshape(self.shape)

    def int4_parts(self):
        """Q4_0/Q4_1 -> (q uint8 [N, K] in 0..15, d float32 [N, K/32], m float32 [N, K/32] | None)
        with w = d * q + m (Q4_1) or w = d * (q - 8) (Q4_0, m None)."""
        from gguf.constants import GGMLQuantizationType as Q
        rows = self.shape[0]
        b = torch.from_numpy(self.raw).view(-1, 18 if self.qtype == Q.Q4_0 else 20)
        d = b[:, 0:2].contiguous().view(torch.float16).float().view(rows, -1)
        qs = b[:, -16:]
        q = torch.stack((qs & 0xF, qs >> 4), dim=1).reshape(rows, -1)    # low nibbles first
        m = b[:, 2:4].contiguous().view(torch.float16).float().view(rows, -1) if self.qtype == Q.Q4_1 else None
        return q, d, m


def pack_gguf_rows(w: BlockTensor) -> tuple[torch.Tensor, int]:
    """Q4_0 / Q4_1 / Q8_0 blocks -> (uint8 tensor, kind) in the interleaved layout of
    kvserve/ops/csrc/gguf_gemv.c: per group of 16 rows and block of 32 weights, the 16 fp16 scales
    d, (Q4) the 16 fp16 offsets m, then the integers, 4 weights of each row side by side. Values
    are the file's: the same nibbles / int8 (Q8 stored + 128) and fp16 scales (Q4_0: m = -8 d,
    exact in fp16)."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.constants import GGMLQuantizationType as Q
    N, K = w.shape
    nb, G = K // GROUP, -(-N // 16)
    bs = GGML_QUANT_SIZES[w.qtype][1]          # bytes per block of 32
    blocks = np.zeros((G * 16, nb, bs), np.uint8)
    blocks[:N] = w.raw.reshape(N, nb, bs)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]                  # [G*16, nb]

    def by_group(a):      # [G*16, nb, ...] -> [G, nb, 16, ...] as bytes
        a = np.ascontiguousarray(a.reshape(G, 16, nb, *a.shape[2:]).swapaxes(1, 2))
        return a.view(np.uint8)
    if w.qtype == Q.Q8_0:
        q = blocks[..., 2:] ^ 0x80                                           # q + 128 as u8
        q[N:] = 128                                                          # padding rows: q = 0
        ints = by_group(q.reshape(G * 16, nb, 8, 4)).swapaxes(2, 3)          # [G, nb, 8 chunks, 16 rows, 4]
        parts = [by_group(d), ints]
        kind = 8
    else:
        m = (blocks[..., 2:4].copy().view(np.float16)[..., 0] if w.qtype == Q.Q4_1
             else (d.astype(np.float32) * -8).astype(np.float16))
        qs = blocks[..., -16:]                           # byte j: q[j] | q[j + 16] << 4, kept as is
        ints = by_group(qs.reshape(G * 16, nb, 4, 4)).swapaxes(2, 3)         # [G, nb, 4 chunks, 16 rows, 4]
        parts = [by_group(d), by_group(m), ints]
        kind = 4
    packed = np.concatenate([p.reshape(G, nb, -1) for p in parts], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(packed)).reshape(-1), kind


def unpack_gguf_rows(packed: torch.Tensor, kind: int, shape: tuple[int, int]) -> torch.Tensor:
    """The float32 [N, K] weight held by pack_gguf_rows' layout (d * q + m, exactly as the file's
    dequantization gives it)."""
    N, K = shape
    nb, G = K // GROUP, -(-N // 16)
    a = packed.numpy().reshape(G, nb, -1)
    d = a[..., 0:32].copy().view(np.float16).astype(np.float32)             # [G, nb, 16]
    if kind == 8:
        q = (a[..., 32:].reshape(G, nb, 8, 16, 4) ^ 0x80).view(np.int8).astype(np.float32)
        q = q.transpose(0, 3, 1, 2, 4).reshape(G, 16, nb, 32)                # [G, row, nb, j]
        w = q * d.transpose(0, 2, 1)[..., None]
    else:
        m = a[..., 32:64].copy().view(np.float16).astype(np.float32)
        qs = a[..., 64:].reshape(G, nb, 4, 16, 4).transpose(0, 3, 1, 2, 4).reshape(G, 16, nb, 16)
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float32)   # j = 0..15, 16..31
        w = q * d.transpose(0, 2, 1)[..., None] + m.transpose(0, 2, 1)[..., None]
    return torch.from_numpy(w.reshape(G * 16, K)[:N].copy())


def is_q4(w) -> bool:
    if not isinstance(w, BlockTensor):
        return False
    from gguf.constants import GGMLQuantizationType as Q
    return w.qtype in (Q.Q4_0, Q.Q4_1)


# ---------------------------------------------------------------- staging of fused shards

class _PackedMethod:
    """Base for packed formats: each shard is converted to per-row parts at load time (so the
    float32 weight never exists whole); once every row of the layer is in, `pack` builds the
    kernel's layout and the staging is freed."""

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        layer.weight = None
        layer._staged = {}      # offset -> (parts, rows) of a shard not yet packed
        layer._dtype = dtype

    def load(self, layer, w, offset: int, whole: bool) -> None:
        parts = self._stage(layer, offset, self.rows(w), w.shape[0])
        if parts is not None:
            self.pack(layer, *(torch.cat(xs, 0) if xs[0] is not None else None for xs in zip(*parts)))

    @staticmethod
    def _stage(layer, offset: int, part, rows: int) -> list | None:
        """Keep one shard's part until the layer's rows are all in; then return the parts in row
        order (and free the staging), else None."""
        layer._staged[offset] = (part, rows)
        if sum(n for _, n in layer._staged.values()) != layer.out_features:
            return None
        parts = [layer._staged[o][0] for o in sorted(layer._staged)]
        del layer._staged
        return parts

    def rows(self, w):
        raise NotImplementedError

    def pack(self, layer, *parts):
        raise NotImplementedError

    @staticmethod
    def _run_2d(layer, x: torch.Tensor, kernel) -> torch.Tensor:
        """kernel(x as [rows, in_features]) -> [rows, out]; back to x's shape and dtype, plus the bias."""
        shape = x.shape
        y = kernel(x.reshape(-1, shape[-1])).to(x.dtype).reshape(*shape[:-1], layer.out_features)
        return y + layer.bias if layer.bias is not None else y


# ---------------------------------------------------------------- int8 (fbgemm dynamic)

@functools.cache
def _has_vnni() -> bool:
    """fbgemm's AVX2 path sums u8*s8 pairs in int16 (vpmaddubsw) and can saturate with 8-bit
    activations; with VNNI (vpdpbusd, int32) the full range is safe."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
        return "avx512_vnni" in flags or "avx_vnni" in flags or "amx_int8" in flags
    except OSError:
        return False


def quantize_int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], scale float32 [N]) with w ~= q * scale (symmetric per row)."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8Method(_PackedMethod):
    """Per-output-channel symmetric int8 weights, two kernels:

    kernel="int8pack" (default): weight-only, torch's _weight_int8pack_mm with bf16 activations
        (its fp32 path is a slow reference loop). Accurate: activations are only rounded to bf16.
    kernel="fbgemm": fbgemm's dynamic int8 linear, activations quantized PER TOKEN. fbgemm itself
        quantizes its input per tensor (one scale for the whole batch), which on SmolLM2 wrecks
        quality (activation outliers of one token flatten every other token: ppl +77%). So each
        row is first divided by its own absmax and the output row multiplied back: linear in x,
        so y is exact up to the per-token 8-bit rounding, at fbgemm's speed (an amax, a div and a
        mul more, small next to the GEMM).
    """

    def __init__(self, kernel: str | None = None, reduce_range: bool | None = None,
                 compute_dtype: torch.dtype = torch.bfloat16):
        self.kernel = kernel or os.environ.get("KVSERVE_INT8_KERNEL", "int8pack")
        if self.kernel not in ("int8pack", "fbgemm"):
            raise ValueError(f"int8 kernel {self.kernel!r}: choose int8pack or fbgemm")
        self.reduce_range = (not _has_vnni()) if reduce_range is None else reduce_range
        self.compute_dtype = compute_dtype

    def rows(self, w):
        return quantize_int8_rows(dense(w))

    def pack(self, layer, q, scale):
        layer.register_buffer("qweight", q, persistent=False)        # kept for references / tests
        layer.register_buffer("wscale", scale, persistent=False)
        layer.register_buffer("wscale_c", scale.to(self.compute_dtype), persistent=False)
        layer._packed = None                                          # built when the bias is final

    def _prepacked(self, layer):
        if layer._packed is None:
            with warnings.catch_warnings():   # quantized tensor creation is deprecated upstream
                warnings.simplefilter("ignore", UserWarning)
                wq = torch._make_per_channel_quantized_tensor(
                    layer.qweight, layer.wscale.double(), torch.zeros_like(layer.wscale, dtype=torch.long), 0)
                layer._packed = torch.ops.quantized.linear_prepack(wq, None)   # bias added after the rescale
        return layer._packed

    def apply(self, layer, x):
        if self.kernel == "int8pack":
            return self._run_2d(layer, x, lambda x2: torch.ops.aten._weight_int8pack_mm(
                x2.to(self.compute_dtype), layer.qweight, layer.wscale_c))
        packed = layer._packed if layer._packed is not None else self._prepacked(layer)

        def per_token(x2):
            xf = x2.float()
            s = xf.abs().amax(-1, keepdim=True).clamp_min_(1e-12)        # per-token scale
            return torch.ops.quantized.linear_dynamic(xf / s, packed, self.reduce_range).mul_(s)
        return self._run_2d(layer, x, per_token)

    def dequantized(self, layer) -> torch.Tensor:
        return layer.qweight.float() * layer.wscale[:, None]


# ---------------------------------------------------------------- int4 (int4pack, group 32)

def quantize_int4_rows(w: torch.Tensor, group: int = GROUP):
    """[N, K] float -> (q uint8 [N, K] in 0..15, d [N, K/g], m [N, K/g]) with w ~= d * q + m
    (asymmetric min/max per group, like GGUF Q4_1)."""
    N, K = w.shape
    g = w.float().reshape(N, K // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    d = ((hi - lo) / 15.0).clamp_min(1e-12)
    q = torch.round((g - lo[..., None]) / d[..., None]).clamp_(0, 15).to(torch.uint8).reshape(N, K)
    return q, d, lo


class Int4Method(_PackedMethod):
    """Group-32 int4 weights in torch's int4pack layout; GGUF Q4_0/Q4_1 blocks load directly.
    Activations go through the kernel in `compute_dtype` (bf16: the fp32 path is ~40x slower).

    int4pack is the fastest kernel here for 1-2 rows (decode of one or two requests), but it
    scales badly with rows (no native bf16 on this CPU): at 64 rows it is 2x slower than fp32.
    With `batch_fp16`, the layer also keeps its int4 values, dequantized exactly, as an fbgemm
    fp16 weight, and calls with more than SMALL_BATCH rows run fbgemm's fp16 GEMM (fp32
    activations and accumulation), 2-4x faster than int4pack from 3 rows up. Both paths compute
    with the same weights (fp16 rounding of d*q+m: 2^-11 relative)."""

    SMALL_BATCH = 2     # measured crossover: int4pack wins at 1-2 rows, fbgemm fp16 from 3

    def __init__(self, compute_dtype: torch.dtype = torch.bfloat16, batch_fp16: bool = False):
        self.compute_dtype = compute_dtype
        self.batch_fp16 = batch_fp16

    @staticmethod
    def supports(in_features: int) -> bool:
        return in_features % GROUP == 0

    def rows(self, w):
        return w.int4_parts() if is_q4(w) else quantize_int4_rows(dense(w))

    def pack(self, layer, q, d, m):
        # Keep the file's numbers (q, d, m) for exactness checks; the kernel wants zero = m + 8d.
        layer.register_buffer("q4", q, persistent=False)
        layer.register_buffer("d4", d, persistent=False)
        layer.register_buffer("m4", m, persistent=False)
        zero = m + 8 * d if m is not None else torch.zeros_like(d)
        layer.register_buffer("packed4", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1),
                              persistent=False)
        sz = torch.stack((d.t(), zero.t()), dim=-1).contiguous()          # [K/g, N, 2]
        layer.register_buffer("scale_zero4", sz.to(self.compute_dtype), persistent=False)
        if self.batch_fp16:
            w = self._dequantize(q, d, m)
            layer._fp16 = fp16_prepack(w)
            layer.fp16_nbytes = w.numel() * 2
        del layer.q4     # the packed copy is enough at run time; dequantized() unpacks on demand

    def apply(self, layer, x):
        def kernel(x2):
            if self.batch_fp16 and x2.shape[0] > self.SMALL_BATCH:
                return torch.ops.quantized.linear_dynamic_fp16(x2.float(), layer._fp16)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(self.compute_dtype), layer.packed4,
                                                             GROUP, layer.scale_zero4)
        return self._run_2d(layer, x, kernel)

    def dequantized(self, layer) -> torch.Tensor:
        """float32 [N, K] exactly as the file / quantizer gave it: d * q + m (Q4_0: d * (q - 8))."""
        return self._dequantize(self.unpacked_q(layer), layer.d4, layer.m4)

    @staticmethod
    def _dequantize(q, d, m) -> torch.Tensor:
        d = d.repeat_interleave(GROUP, 1)
        if m is None:
            return (q.float() - 8) * d
        return q.float() * d + m.repeat_interleave(GROUP, 1)

    def unpacked_q(self, layer) -> torch.Tensor:
        # Recover q from the packed copy: identity input, scale 1, zero 8 -> (q - 8) * 1 + 8 = q,
        # small integers that bf16 holds exactly.
        K, N = layer.in_features, layer.out_features
        sz = torch.stack((torch.ones(K // GROUP, N), torch.full((K // GROUP, N), 8.0)), -1)
        q = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(K, dtype=torch.bfloat16), layer.packed4,
                                                       GROUP, sz.to(torch.bfloat16).contiguous())
        return q.t().float().round().to(torch.uint8)


# ---------------------------------------------------------------- fp16 weights (fbgemm)

def fp16_prepack(w: torch.Tensor):
    """fbgemm's packed fp16 copy of a float [N, K] weight (no bias), for linear_dynamic_fp16."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.ops.quantized.linear_prepack_fp16(w.float().contiguous(), None)


class Fp16Method(_PackedMethod):
    """fp16 weights, fp32 activations and fp32 accumulation: fbgemm's packed fp16 GEMM. Half the
    weight bytes of fp32 at nearly its accuracy (weights rounded to fp16, 2^-11 relative; a Q8_0
    value d*q is within that of exact), and faster than MKL's fp32 GEMM at every batch size on
    this CPU (the 49152x576 LM head: 4.0 vs 6.2 ms at 1 row, 26 vs 39 ms at 64, 2 threads)."""

    def rows(self, w):
        return (dense(w).float(),)

    def pack(self, layer, w):
        layer._fp16 = fp16_prepack(w)
        layer.fp16_nbytes = w.numel() * 2

    def apply(self, layer, x):
        return self._run_2d(layer, x, lambda x2: torch.ops.quantized.linear_dynamic_fp16(x2.float(), layer._fp16))

    def dequantized(self, layer) -> torch.Tensor:
        return torch.ops.quantized.linear_unpack_fp16(layer._fp16)[0].float()


# ---------------------------------------------------------------- GGUF blocks (C kernel)

def _packable_types():
    from gguf.constants import GGMLQuantizationType as Q
    return (Q.Q4_0, Q.Q4_1, Q.Q8_0)


class GgufMethod(_PackedMethod):
    """The file's Q4_0 / Q4_1 / Q8_0 blocks, interleaved 16 rows at a time (pack_gguf_rows) and run
    by the C kernel kvserve/ops/csrc/gguf_gemv.c for up to C_ROWS activation rows (decode steps):
    512-bit VNNI dot products of the 4/8-bit integers with the activations as two 8-bit parts
    per block of 32 (~15 bits). Larger batches use the same values as an fbgemm fp16 weight (fp32
    activations), faster from ~C_ROWS rows up. A weight the loader has already dequantized
    (another GGUF type, or a float checkpoint) gets only the fp16 weight.

    The fp16 copy is built when a batch first needs it (or ahead of time by
    prepare_batch_weights): it costs ~2 s of start-up and ~270 MB that single-stream use never
    needs. Which kernel runs depends only on the number of rows, never on timing.

    Used when the kernel's SIMD path was built (cpu_kernels.gguf_gemv_fast()); otherwise the gguf
    format falls back to Int4Method(batch_fp16=True) and Fp16Method."""

    C_ROWS = 32     # measured: the C kernel is as fast as fbgemm fp16 at 32 rows, faster below

    def __init__(self, c_rows: int | None = C_ROWS):
        """c_rows: the most rows the C kernel takes (None: every batch; no fp16 copy is built)."""
        self.c_rows = c_rows

    def load(self, layer, w, offset: int, whole: bool) -> None:
        parts = self._stage(layer, offset, w, w.shape[0])      # blocks stay blocks until pack
        if parts is not None:
            self.pack(layer, parts)

    def pack(self, layer, parts):
        qtypes = {p.qtype if isinstance(p, BlockTensor) else None for p in parts}
        qtype = qtypes.pop() if len(qtypes) == 1 else None
        layer.fp16_nbytes = layer.out_features * layer.in_features * 2
        if qtype in _packable_types():
            blocks = BlockTensor(np.concatenate([p.raw for p in parts]), qtype,
                                 (layer.out_features, layer.in_features))
            packed, kind = pack_gguf_rows(blocks)
            layer.register_buffer("gguf_packed", packed, persistent=False)
            layer.gguf_kind = kind
            layer._fp16 = None            # built on first use: batch_weight
        else:
            layer.gguf_packed, layer.gguf_kind = None, 0
            layer._fp16 = fp16_prepack(torch.cat([dense(p).float() for p in parts]))

    def batch_weight(self, layer):
        """The fbgemm fp16 weight of the layer's values, built once (thread-safe)."""
        fp16 = layer._fp16
        if fp16 is None:
            with _FP16_BUILD:
                if layer._fp16 is None:
                    layer._fp16 = fp16_prepack(self.dequantized(layer))
                fp16 = layer._fp16
        return fp16

    def apply(self, layer, x):
        def kernel(x2):
            if layer.gguf_packed is not None and (self.c_rows is None or x2.shape[0] <= self.c_rows):
                return cpu_kernels.gguf_gemv(layer.gguf_packed, layer.gguf_kind, layer.out_features,
                                             x2.float().contiguous())
            return torch.ops.quantized.linear_dynamic_fp16(x2.float(), self.batch_weight(layer))
        return self._run_2d(layer, x, kernel)

    def dequantized(self, layer) -> torch.Tensor:
        if layer.gguf_packed is not None:
            return unpack_gguf_rows(layer.gguf_packed, layer.gguf_kind, (layer.out_features, layer.in_features))
        return torch.ops.quantized.linear_unpack_fp16(layer._fp16)[0].float()


_FP16_BUILD = threading.Lock()


def prepare_batch_weights(model: nn.Module) -> int:
    """Build every GgufMethod layer's fp16 batch weight now (benchmarks before timing, the server
    in the background after start-up). Returns how many were built."""
    built = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, GgufMethod) and method.c_rows is not None and module._fp16 is None:
            method.batch_weight(module)
            built += 1
    return built


# ---------------------------------------------------------------- choosing methods

def method_for(fmt: str, in_features: int, out_features: int):
    """The quant method for one Linear under format `fmt` (None: keep the dense default)."""
    if fmt in (None, "none"):
        return None
    if fmt == "int8":
        return Int8Method()
    if fmt == "gguf" and cpu_kernels.gguf_gemv_fast():
        return GgufMethod() if in_features % GROUP == 0 else None
    if fmt in ("int4", "gguf"):
        return Int4Method(batch_fp16=fmt == "gguf") if Int4Method.supports(in_features) else None
    raise ValueError(f"quantization {fmt!r} is not supported (choose from {list(FORMATS)})")


def head_method_for(fmt: str, in_features: int, out_features: int):
    """The LM head's method: gguf keeps the file's Q8_0 blocks for the C kernel at every batch size
    (without its SIMD build: the same values as fbgemm fp16 weights with fp32 activations; an
    int8-activation head costs 2.7 points of top-1 agreement on SmolLM2); int4 uses int8 for the
    head (an int4 head costs +5.6% ppl on SmolLM2, the Q4 layers ~0%)."""
    if fmt == "gguf":   # the C kernel at every batch size: it beats fbgemm fp16 on the head up to
        # 64 rows (max_num_seqs), and the fp16 copy would cost 56 MB (plus 113 MB while built)
        return GgufMethod(c_rows=None) if cpu_kernels.gguf_gemv_fast() and in_features % GROUP == 0 else Fp16Method()
    if fmt == "int4":
        return Int8Method()
    return method_for(fmt, in_features, out_features)


def apply_quantization(model: nn.Module, fmt: str) -> None:
    """Give every Linear of `model` the method of format `fmt` (before any weight is loaded), and
    a quantized LM head when the head is tied to the embedding."""
    if fmt in (None, "none"):
        return
    for module in list(model.modules()):
        if isinstance(module, Linear):
            if module is getattr(model, "lm_head", None):
                method = head_method_for(fmt, module.in_features, module.out_features)
            else:
                method = method_for(fmt, module.in_features, module.out_features)
            if method is not None:
                module.quant_method = method
                method.create_weights(module, model.dtype)
    arch = model.arch
    if model.lm_head is None and arch.tie_word_embeddings:
        method = head_method_for(fmt, arch.hidden_size, arch.vocab_size)
        if method is not None:
            model.tie_quantized_head(Linear(arch.hidden_size, arch.vocab_size, dtype=model.dtype,
                                            quant_method=method))


def _q4_types():
    from gguf.constants import GGMLQuantizationType as Q
    return (Q.Q4_0, Q.Q4_1)


# GGUF qtypes the loader hands over as blocks (not dequantized), per format.
KEEP_BLOCKS = {"int4": _q4_types(), "gguf": _packable_types()}

# The default for GGUF models: the fastest format within the quality bound. eval-quality, 24,576
# tokens, SmolLM2-135M Q4_1: int8 ppl +0.55% top-1 94.85% (NO), int4 +0.30% 96.31% (NO),
# gguf +0.00% 99.85% (docs/benchmarks.md).
DEFAULT_GGUF = "gguf"

DESCRIPTION = {
    "none": "dense weights in the model dtype, GGUF blocks dequantized",
    "int8": "per-channel int8 weights (weight-only int8pack, bf16 activations), LM head included",
    "int4": "group-32 int4 weights (int4pack, bf16 activations), GGUF Q4 blocks as they are, LM head included",
    "gguf": "GGUF Q4_0/Q4_1/Q8_0 blocks run by kvserve's C VNNI kernel up to 32 rows, the same values "
            "as fbgemm fp16 for larger batches",
}
