"""fp16 weights run by fbgemm's packed fp16 GEMM (fp32 activations and accumulation)."""

from __future__ import annotations

import warnings

import torch

from kvserve.model.layers import dense
from kvserve.model.quant.base import _PackedMethod


def fp16_prepack(w: torch.Tensor):
    """fbgemm's packed fp16 copy of a float [N, K] weight (no bias), for linear_dynamic_fp16."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.ops.quantized.linear_prepack_fp16(w.float().contiguous(), None)


class Fp16Method(_PackedMethod):
    """fp16 weights, fp32 activations and fp32 accumulation: fbgemm's packed fp16 GEMM. Half the
    weight bytes of fp32 at nearly its accuracy (weights rounded to fp16, 2^-11 relative; a Q8_0
    value d*q is within that of exact), and faster than MKL's fp32 GEMM (docs/benchmarks.md)."""

    def rows(self, w):
        return (dense(w).float(),)

    def pack(self, layer, w):
        layer._fp16 = fp16_prepack(w)
        layer.fp16_nbytes = w.numel() * 2

    def apply(self, layer, x):
        return self._run_2d(
            layer, x, lambda x2: torch.ops.quantized.linear_dynamic_fp16(x2.float(), layer._fp16)
        )

    def dequantized(self, layer) -> torch.Tensor:
        return torch.ops.quantized.linear_unpack_fp16(layer._fp16)[0].float()
