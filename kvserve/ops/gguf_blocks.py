"""GGUF block packing for the C GEMV (kvserve/ops/csrc/gguf_gemv.c): the file's Q4_0 / Q4_1 / Q8_0
blocks interleaved 16 rows at a time (pack_gguf_rows), and back to float32 (unpack_gguf_rows).

`w` is any object with the GGUF tensor's `raw` blocks ([rows, bytes_per_row] uint8), `qtype` and
`shape` (kvserve.model.quant.BlockTensor). Imports numpy, torch and gguf only.
"""
from __future__ import annotations

import numpy as np
import torch

GROUP = 32      # weights per GGUF Q4_0 / Q4_1 / Q8_0 block


def pack_gguf_rows(w) -> tuple[torch.Tensor, int]:
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
