"""gguf: the file's own blocks (Q4_0, Q4_1, Q5_0, Q8_0 and the K-quants Q3_K, Q4_K, Q5_K, Q6_K), run
by the C kernel (ops/csrc/gguf_gemv.c)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.model.layers import dense
from kvserve.model.quant.base import _PackedMethod
from kvserve.model.quant.blocks import BlockTensor
from kvserve.ops import cpu_kernels
from kvserve.ops.gguf_blocks import pack_gguf_parts, packed_kind, unpack_gguf_rows


class GgufMethod(_PackedMethod):
    """The file's blocks, decoded without changing a value and interleaved 16 rows at a time
    (kvserve.ops.gguf_blocks: Q4_0/Q4_1 as 4-bit kind 4, Q8_0/Q5_0 as 8-bit kind 8, Q4_K as 4-bit
    kind 14, Q5_K/Q6_K/Q3_K as 8-bit kind 18) and run by the C kernel kvserve/ops/csrc/gguf_gemv.c
    at every batch size, on every ISA build: integer dot products of the weights with the
    activations as two 8-bit parts per block of 32 (~15 bits), weights read once per call for any
    number of rows. No other copy of the weights exists. Fused shards (q/k/v, gate/up) pack
    together when their types share a kind (Q5_0 with Q8_0). A weight the loader has already
    dequantized (a type without a kind, such as Q2_K or Q5_1, or a float checkpoint), or shards
    whose kinds differ, stays a dense float32 tensor.

    Used when the C kernels are built (cpu_kernels.available()); otherwise the gguf format falls
    back to torch kernels (kvserve.model.quant.method_for).

    parts (cpu_kernels.ACT_PARTS, csrc/gguf_gemv.h): "two" (the gguf format); "one" (gguf-a8),
    the activations as one 8-bit part per block, llama.cpp's precision, at half the integer work;
    "mixed" (gguf-mixed), one part except in the blocks whose second part carries enough (an
    outlier's block), close to one part's work at well inside the quality bound. With one or mixed
    parts the layer stack runs prompt tokens through the integer GEMV too (csrc/layer_stack.c)."""

    def __init__(self, parts: str = "two"):
        if parts not in cpu_kernels.ACT_PARTS:
            raise ValueError(f"parts must be one of {sorted(cpu_kernels.ACT_PARTS)}, got {parts!r}")
        self.isa = cpu_kernels.selected_isa()       # the kernel build, fixed for the layer's life
        self.parts = parts

    def load(self, layer, w, offset: int, whole: bool) -> None:
        parts = self._stage(layer, offset, w, w.shape[0])      # blocks stay blocks until pack
        if parts is not None:
            self.pack(layer, parts)

    def pack(self, layer, parts):
        kinds = {packed_kind(p.qtype) if isinstance(p, BlockTensor) else None for p in parts}
        if len(kinds) == 1 and None not in kinds:
            packed, kind = pack_gguf_parts(parts)
            layer.register_buffer("gguf_packed", packed, persistent=False)
            layer.gguf_kind = kind
            layer.dense_weight = None
        else:
            layer.gguf_packed, layer.gguf_kind = None, 0
            layer.register_buffer("dense_weight", torch.cat([dense(p).float() for p in parts]).contiguous(),
                                  persistent=False)

    def apply(self, layer, x):
        if layer.gguf_packed is None:
            bias = layer.bias.float() if layer.bias is not None else None
            return F.linear(x.float(), layer.dense_weight, bias).to(x.dtype)
        return self._run_2d(layer, x, lambda x2: cpu_kernels.gguf_gemv(
            layer.gguf_packed, layer.gguf_kind, layer.out_features, x2.float().contiguous(), isa=self.isa,
            parts=self.parts))

    def row_reader(self, layer):
        """ids [R] -> the packed weight's rows as float32 [R, in_features] (None: kept dense)."""
        if layer.gguf_packed is None:
            return None
        return lambda ids: cpu_kernels.gguf_rows(layer.gguf_packed, layer.gguf_kind, layer.out_features,
                                                 layer.in_features, ids, isa=self.isa)

    def dequantized(self, layer) -> torch.Tensor:
        if layer.gguf_packed is not None:
            return unpack_gguf_rows(layer.gguf_packed, layer.gguf_kind, (layer.out_features, layer.in_features))
        return layer.dense_weight
