"""int8 KV cache rows: each (token, KV head) row of K or V is kept as head_dim int8 values and its
float32 scale (max|x| / 127, in the row's last 4 bytes), so a layer's pool is
int8 [num_blocks, block_size, kv_heads, head_dim + 4]: 68 bytes a row for head_dim 64 instead of
256 in float32 (3.8x more tokens for the same memory). Per-row scales follow each token's own
range (keys have per-token outliers); x ~= scale * q, at most scale / 2 off per element.

The C decode kernels read these rows in place (csrc/paged_attention.c, csrc/layer_stack.c);
the PyTorch paths quantize on write and dequantize what they gather.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4


def pool_shape(num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (num_blocks, block_size, kv_heads, head_dim + SCALE_BYTES)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D + 4] int8 rows (values, then the float32 scale's bytes)."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / 127.0
    q = torch.where(scale > 0, x / scale, 0.0).round_().clamp_(-127, 127).to(torch.int8)
    return torch.cat((q, scale.contiguous().view(torch.int8)), dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., D + 4] int8 rows -> [..., D] in `dtype`."""
    q, scale = rows[..., :-SCALE_BYTES], rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (q.to(torch.float32) * scale).to(dtype)


def as_float(cache_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows gathered from a pool, in `dtype` (int8 rows dequantized)."""
    return dequantize(cache_rows, dtype) if cache_rows.dtype == torch.int8 else cache_rows.to(dtype)
