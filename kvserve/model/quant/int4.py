"""int4: group-32 asymmetric int4 weights in torch's int4pack layout (GGUF Q4_0/Q4_1 blocks as
they are).

int4pack's convention (checked against the kernel): w = (q - 8) * scale + zero, q in 0..15, with
scale/zero laid out as [K / group, N, 2]. GGUF Q4_1 is w = d * q + m, so scale = d and
zero = m + 8 d; Q4_0 is w = d * (q - 8), so scale = d and zero = 0.
"""

from __future__ import annotations

import torch

from kvserve.model.layers import dense
from kvserve.model.quant.base import _PackedMethod
from kvserve.model.quant.blocks import GROUP, is_q4
from kvserve.model.quant.fp16 import fp16_prepack


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
    Activations go through the kernel in `compute_dtype` (bf16: its fp32 path is a slow
    reference loop).

    int4pack is the fastest kernel here for one or two rows (decode of one or two requests), but
    it scales badly with rows on CPUs without native bf16. With `batch_fp16`, the layer also
    keeps its int4 values, dequantized exactly, as an fbgemm fp16 weight, and calls with more
    than SMALL_BATCH rows run fbgemm's fp16 GEMM (fp32 activations and accumulation). Both paths
    compute with the same weights (fp16 rounding of d*q+m: 2^-11 relative). Timings:
    docs/benchmarks.md."""

    SMALL_BATCH = 2  # the crossover: int4pack up to this many rows, fbgemm fp16 above

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
        layer.register_buffer(
            "packed4",
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1),
            persistent=False,
        )
        sz = torch.stack((d.t(), zero.t()), dim=-1).contiguous()  # [K/g, N, 2]
        layer.register_buffer("scale_zero4", sz.to(self.compute_dtype), persistent=False)
        if self.batch_fp16:
            w = self._dequantize(q, d, m)
            layer._fp16 = fp16_prepack(w)
            layer.fp16_nbytes = w.numel() * 2
        del layer.q4  # the packed copy is enough at run time; dequantized() unpacks on demand

    def apply(self, layer, x):
        def kernel(x2):
            if self.batch_fp16 and x2.shape[0] > self.SMALL_BATCH:
                return torch.ops.quantized.linear_dynamic_fp16(x2.float(), layer._fp16)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(self.compute_dtype), layer.packed4, GROUP, layer.scale_zero4
            )

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
        q = torch.ops.aten._weight_int4pack_mm_for_cpu(
            torch.eye(K, dtype=torch.bfloat16),
            layer.packed4,
            GROUP,
            sz.to(torch.bfloat16).contiguous(),
        )
        return q.t().float().round().to(torch.uint8)
