"""int8: per-output-channel symmetric int8 weights (weight-only int8pack, or fbgemm's dynamic
linear)."""

from __future__ import annotations

import functools
import os
import warnings

import torch

from kvserve.model.layers import dense
from kvserve.model.quant.base import _PackedMethod


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
        quality (activation outliers of one token flatten every other token). So each
        row is first divided by its own absmax and the output row multiplied back: linear in x,
        so y is exact up to the per-token 8-bit rounding, at fbgemm's speed (an amax, a div and a
        mul more, small next to the GEMM).
    """

    def __init__(
        self,
        kernel: str | None = None,
        reduce_range: bool | None = None,
        compute_dtype: torch.dtype = torch.bfloat16,
    ):
        self.kernel = kernel or os.environ.get("KVSERVE_INT8_KERNEL", "int8pack")
        if self.kernel not in ("int8pack", "fbgemm"):
            raise ValueError(f"int8 kernel {self.kernel!r}: choose int8pack or fbgemm")
        if reduce_range is False and not _has_vnni():
            raise ValueError(
                "int8 reduce_range=False needs a CPU with VNNI "
                "(avx512_vnni / avx_vnni / amx_int8): "
                "fbgemm's AVX2 path sums u8*s8 pairs in int16 and saturates with full 8-bit "
                "activations; use reduce_range=True (or None: chosen for this CPU)"
            )
        self.reduce_range = (not _has_vnni()) if reduce_range is None else reduce_range
        self.compute_dtype = compute_dtype

    def rows(self, w):
        return quantize_int8_rows(dense(w))

    def pack(self, layer, q, scale):
        layer.register_buffer("qweight", q, persistent=False)  # kept for references / tests
        layer.register_buffer("wscale", scale, persistent=False)
        layer.register_buffer("wscale_c", scale.to(self.compute_dtype), persistent=False)
        layer._packed = None  # built when the bias is final

    def _prepacked(self, layer):
        if layer._packed is None:
            with warnings.catch_warnings():  # quantized tensor creation is deprecated upstream
                warnings.simplefilter("ignore", UserWarning)
                wq = torch._make_per_channel_quantized_tensor(
                    layer.qweight,
                    layer.wscale.double(),
                    torch.zeros_like(layer.wscale, dtype=torch.long),
                    0,
                )
                layer._packed = torch.ops.quantized.linear_prepack(
                    wq, None
                )  # bias added after the rescale
        return layer._packed

    def apply(self, layer, x):
        if self.kernel == "int8pack":
            return self._run_2d(
                layer,
                x,
                lambda x2: torch.ops.aten._weight_int8pack_mm(
                    x2.to(self.compute_dtype), layer.qweight, layer.wscale_c
                ),
            )
        packed = layer._packed if layer._packed is not None else self._prepacked(layer)

        def per_token(x2):
            xf = x2.float()
            s = xf.abs().amax(-1, keepdim=True).clamp_min_(1e-12)  # per-token scale
            return torch.ops.quantized.linear_dynamic(xf / s, packed, self.reduce_range).mul_(s)

        return self._run_2d(layer, x, per_token)

    def dequantized(self, layer) -> torch.Tensor:
        return layer.qweight.float() * layer.wscale[:, None]
