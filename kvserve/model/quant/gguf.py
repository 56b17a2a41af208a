"""gguf: the file's own Q4_0 / Q4_1 / Q8_0 blocks, run by the C kernel (ops/csrc/gguf_gemv.c)."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kvserve.model.layers import dense
from kvserve.model.quant.base import _PackedMethod
from kvserve.model.quant.blocks import BlockTensor, _packable_types
from kvserve.ops import cpu_kernels
from kvserve.ops.gguf_blocks import pack_gguf_rows, unpack_gguf_rows


class GgufMethod(_PackedMethod):
    """The file's Q4_0 / Q4_1 / Q8_0 blocks, interleaved 16 rows at a time (pack_gguf_rows) and run
    by the C kernel kvserve/ops/csrc/gguf_gemv.c at every batch size, on every ISA build: integer
    dot products of the 4/8-bit weights with the activations as two 8-bit parts per block of 32
    (~15 bits), weights read once per call for any number of rows. The values are the file's; no
    other copy of the weights exists. A weight the loader has already dequantized (another GGUF
    type, or a float checkpoint) stays a dense float32 tensor.

    Used when the C kernels are built (cpu_kernels.available()); otherwise the gguf format falls
    back to torch kernels (kvserve.model.quant.method_for)."""

    def __init__(self):
        self.isa = cpu_kernels.selected_isa()       # the kernel build, fixed for the layer's life

    def load(self, layer, w, offset: int, whole: bool) -> None:
        parts = self._stage(layer, offset, w, w.shape[0])      # blocks stay blocks until pack
        if parts is not None:
            self.pack(layer, parts)

    def pack(self, layer, parts):
        qtypes = {p.qtype if isinstance(p, BlockTensor) else None for p in parts}
        qtype = qtypes.pop() if len(qtypes) == 1 else None
        if qtype in _packable_types():
            blocks = BlockTensor(np.concatenate([p.raw for p in parts]), qtype,
                                 (layer.out_features, layer.in_features))
            packed, kind = pack_gguf_rows(blocks)
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
            layer.gguf_packed, layer.gguf_kind, layer.out_features, x2.float().contiguous(), isa=self.isa))

    def dequantized(self, layer) -> torch.Tensor:
        if layer.gguf_packed is not None:
            return unpack_gguf_rows(layer.gguf_packed, layer.gguf_kind, (layer.out_features, layer.in_features))
        return layer.dense_weight
