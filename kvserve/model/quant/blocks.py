"""GGUF tensors handed over still in their quantized blocks (BlockTensor), and which GGUF types
the packed formats take as they are."""

from __future__ import annotations

import numpy as np
import torch

# GROUP: weights per GGUF block = the int4 group (re-exported)
from kvserve.ops.gguf_blocks import GROUP, packable_types  # noqa: F401
from kvserve.ops.gguf_types import GGMLQuantizationType as Q


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
        rows = self.shape[0]
        b = torch.from_numpy(self.raw).view(-1, 18 if self.qtype == Q.Q4_0 else 20)
        d = b[:, 0:2].contiguous().view(torch.float16).float().view(rows, -1)
        qs = b[:, -16:]
        q = torch.stack((qs & 0xF, qs >> 4), dim=1).reshape(rows, -1)  # low nibbles first
        m = (
            b[:, 2:4].contiguous().view(torch.float16).float().view(rows, -1)
            if self.qtype == Q.Q4_1
            else None
        )
        return q, d, m


def is_q4(w) -> bool:
    if not isinstance(w, BlockTensor):
        return False
    return w.qtype in _q4_types()


def _q4_types():
    return (Q.Q4_0, Q.Q4_1)


def _packable_types():
    """The GGUF types the gguf format keeps as blocks (kvserve.ops.gguf_blocks.packable_types:
    Q4_0, Q4_1, Q5_0, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K)."""
    return packable_types()
