"""Fused elementwise kernels in Triton (the GPU path): RMSNorm, residual add + RMSNorm, rotary
embedding. Each wrapper only launches one kernel on shapes (no host reads of tensor data), so it
can be captured in a CUDA graph once compiled.

The math follows kvserve/model/layers.py: RMSNorm normalizes in float32, rounds to x.dtype, then
scales by the weight (one more rounding to x.dtype: the same as RMSNorm.forward when the weight
has x's dtype, and exact float32 math for float32 inputs). RoPE uses the "rotate half" tables of
RotaryEmbedding (cos duplicated, sin signed: -sin, +sin) and computes in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _row_warps(block: int) -> int:
    return 1 if block <= 256 else 2 if block <= 1024 else 4 if block <= 4096 else 8


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    y_ptr,
    new_res_ptr,
    stride_x,
    stride_r,
    stride_y,
    stride_nr,
    H,
    eps,
    BLOCK: tl.constexpr,
    HAS_RES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    dtype = x.dtype
    xf = x.to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        x = (r + xf).to(dtype)  # one rounding of the sum
        tl.store(new_res_ptr + row * stride_nr + offs, x, mask=mask)
        xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / H
    xn = (xf * tl.math.rsqrt(var + eps)).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, (xn * w).to(dtype), mask=mask)


def _check_rows(x: torch.Tensor) -> None:
    assert x.dim() == 2 and x.stride(1) == 1, "x: [N, H] with a contiguous last dimension"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, H] -> x / sqrt(mean(x^2) + eps) * weight, in float32, as x.dtype (a new tensor)."""
    _check_rows(x)
    N, H = x.shape
    y = torch.empty((N, H), dtype=x.dtype, device=x.device)
    if N == 0:
        return y
    block = triton.next_power_of_2(H)
    _rms_norm_kernel[(N,)](
        x,
        x,
        weight,
        y,
        y,
        x.stride(0),
        0,
        y.stride(0),
        0,
        H,
        float(eps),
        BLOCK=block,
        HAS_RES=False,
        num_warps=_row_warps(block),
    )
    return y


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + delta, rms_norm(residual + delta)) in one pass over each row. The sum is taken
    in float32 and rounded once to residual.dtype; the norm is of that rounded sum."""
    _check_rows(residual)
    _check_rows(delta)
    assert residual.shape == delta.shape
    N, H = residual.shape
    new_res = torch.empty((N, H), dtype=residual.dtype, device=residual.device)
    y = torch.empty((N, H), dtype=residual.dtype, device=residual.device)
    if N == 0:
        return new_res, y
    block = triton.next_power_of_2(H)
    # The kernel's x is delta, cast to the residual's dtype for the sum's rounding.
    delta = delta if delta.dtype == residual.dtype else delta.to(residual.dtype)
    _rms_norm_kernel[(N,)](
        delta,
        residual,
        weight,
        y,
        new_res,
        delta.stride(0),
        residual.stride(0),
        y.stride(0),
        new_res.stride(0),
        H,
        float(eps),
        BLOCK=block,
        HAS_RES=True,
        num_warps=_row_warps(block),
    )
    return new_res, y


@triton.jit
def _rope_kernel(
    x_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    y_ptr,
    H,
    stride_xt,
    stride_xh,
    stride_cos,
    stride_sin,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    mask = (offs_h[:, None] < H) & d_mask[None, :]
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos1 = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0)[None, :]
    cos2 = tl.load(cos_ptr + pos * stride_cos + HALF + offs_d, mask=d_mask, other=0.0)[None, :]
    sin1 = tl.load(sin_ptr + pos * stride_sin + offs_d, mask=d_mask, other=0.0)[None, :]
    sin2 = tl.load(sin_ptr + pos * stride_sin + HALF + offs_d, mask=d_mask, other=0.0)[None, :]
    xp = x_ptr + t * stride_xt + offs_h[:, None].to(tl.int64) * stride_xh + offs_d[None, :]
    x1 = tl.load(xp, mask=mask, other=0.0)
    x2 = tl.load(xp + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    y1 = x1 * cos1 + x2 * sin1
    y2 = x2 * cos2 + x1 * sin2
    yp = y_ptr + (t * H + offs_h[:, None]) * (2 * HALF) + offs_d[None, :]
    tl.store(yp, y1.to(dtype), mask=mask)
    tl.store(yp + HALF, y2.to(dtype), mask=mask)


def rope(
    x: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor
) -> torch.Tensor:
    """x [T, H, D] (last dim contiguous, other strides free) rotated by its token's position:
    x * cos[pos] + cat(x[..., D/2:], x[..., :D/2]) * sin[pos] in float32, as a new contiguous
    [T, H, D] tensor of x.dtype. cos_cache, sin_cache: float32 [max_positions, D] as
    RotaryEmbedding stores them."""
    assert x.dim() == 3 and x.stride(2) == 1, "x: [T, H, D] with a contiguous last dimension"
    T, H, D = x.shape
    assert D % 2 == 0 and cos_cache.stride(1) == 1 and sin_cache.stride(1) == 1
    y = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T == 0 or H == 0:
        return y
    half = D // 2
    half_pad = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(H), max(1, 4096 // half_pad))
    _rope_kernel[(T, triton.cdiv(H, block_h))](
        x,
        positions,
        cos_cache,
        sin_cache,
        y,
        H,
        x.stride(0),
        x.stride(1),
        cos_cache.stride(0),
        sin_cache.stride(0),
        HALF=half,
        HALF_PAD=half_pad,
        BLOCK_H=block_h,
        num_warps=_row_warps(block_h * half_pad),
    )
    return y
