"""Paged attention in Triton (the GPU path).

The pool and batch layout are those of kvserve.ops.attention: one layer's KV pool is two tensors
`[num_blocks, block_size, Hkv, D]`, token p of a sequence sits in block `block_tables[b, p // bs]`
at offset `p % bs`. A float8_e4m3fn pool stores value / k_scale (resp. v_scale).

Both wrappers only launch kernels: no host reads of tensor data, scratch sized from shapes, so
they can be captured in a CUDA graph (after a first call has compiled the kernels).

- paged_decode_attention: one query token per sequence (flash-decoding). Grid
  (Bd, Hkv, num_splits): each program walks one contiguous share of the context for every query
  head of its KV head (each K/V tile loaded once per group), with an online softmax in float32,
  and writes a partial (max, sum, acc); a second kernel merges the splits into out[qrow[b]].
- paged_prefill_attention: chunks of several queries (prompts, chunked prefill, draft
  verification). Flash-attention tiles of BLOCK_M queries x BLOCK_N keys, grid
  (Bp, Hq, cdiv(max_q_len, BLOCK_M)); only key tiles inside the causal / sliding-window band
  of the query tile are visited, and those visible to every query of the tile skip the masks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


def _interpreter_index_fix() -> None:
    """Under TRITON_INTERPRET=1 with numpy >= 2.4, Triton 3.6's interpreter fails on
    `range(runtime_start, runtime_end)` (scalars are 1-element arrays, and int() of those is a
    TypeError; triton-lang/triton#9171). Patch its tensor __index__ as the upstream fix does.
    Nothing changes on the compiled (GPU) path."""
    import numpy as np
    from triton import knobs

    if not knobs.runtime.interpret:
        return
    try:
        int(np.zeros(1, dtype=np.int32))
        return  # this numpy still converts: no bug
    except TypeError:
        pass
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor
    if getattr(patch, "_index_fixed", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched._index_fixed = True
    interpreter._patch_lang_tensor = patched


_interpreter_index_fix()


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs: full-precision products rather than tf32; ignored for other dtypes.
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _decode_split_range(
    seq_len,
    split,
    window,
    NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """[start, end): the keys split `split` of a sequence of seq_len tokens visits. Each split
    covers a whole number of BLOCK_N tiles; trailing splits may be empty."""
    lo = seq_len * 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    n = tl.maximum(seq_len - lo, 0)
    chunk = tl.cdiv(tl.cdiv(n, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)
    return start, end


@triton.jit
def _decode_tiles(
    q,
    start,
    end,
    bt_row,
    k_ptr,
    v_ptr,
    kvh,
    qk_scale,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    GROUP_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Online softmax of the query heads q [GROUP_PAD, D] over keys [start, end) of KV head kvh,
    BLOCK_N keys a tile: (m, l, acc) in float32."""
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for t in range(start, end, BLOCK_N):
        tok = t + offs_n
        n_mask = tok < end
        blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        off = tok % BLOCK_SIZE
        k = tl.load(
            k_ptr
            + blk[:, None] * stride_kb
            + off[:, None] * stride_kt
            + kvh * stride_kh
            + offs_d[None, :],
            mask=n_mask[:, None],
            other=0.0,
        )
        v = tl.load(
            v_ptr
            + blk[:, None] * stride_vb
            + off[:, None] * stride_vt
            + kvh * stride_vh
            + offs_d[None, :],
            mask=n_mask[:, None],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC) * qk_scale  # log2 domain
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every visited tile has a valid key
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    qrow_ptr,
    lens_ptr,
    bt_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HQ: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(lens_ptr + b)
    row = tl.load(qrow_ptr + b).to(tl.int64)
    start, end = _decode_split_range(seq_len, split, window, NUM_SPLITS, BLOCK_N, HAS_WINDOW)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None],
        other=0.0,
    )

    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    m_i, l_i, acc = _decode_tiles(
        q,
        start,
        end,
        bt_row,
        k_ptr,
        v_ptr,
        kvh,
        qk_scale,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        GROUP_PAD,
        D,
        BLOCK_SIZE,
        BLOCK_N,
        DOT_PREC,
    )

    part = (b * HQ + heads) * NUM_SPLITS + split
    tl.store(m_ptr + part, m_i, mask=g_mask)
    tl.store(l_ptr + part, l_i, mask=g_mask)
    tl.store(acc_ptr + part[:, None] * D + offs_d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _decode_merge_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    qrow_ptr,
    out_ptr,
    v_scale,
    stride_ot,
    stride_oh,
    HQ: tl.constexpr,
    D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D)
    s_mask = offs_s < NUM_SPLITS
    part = (b * HQ + h) * NUM_SPLITS + offs_s
    m = tl.load(m_ptr + part, mask=s_mask, other=float("-inf"))
    l = tl.load(l_ptr + part, mask=s_mask, other=0.0)  # noqa: E741 (flash-attention notation)
    acc = tl.load(acc_ptr + part[:, None] * D + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # empty context: output zeros
    w = tl.math.exp2(m - m_max)  # empty split: exp2(-inf) = 0
    total = tl.sum(l * w, 0)
    o = tl.sum(acc * w[:, None], 0)
    o = tl.where(total > 0, o / total, 0.0) * v_scale
    row = tl.load(qrow_ptr + b).to(tl.int64)
    tl.store(out_ptr + row * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    qrow: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int = 8,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Single-token decode attention over the paged pool; writes out[qrow[b]] for every b.

    q, out: [T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (float32, float16,
    bfloat16 or float8_e4m3fn scaled by k_scale / v_scale); qrow, seq_lens: int32 [Bd];
    block_tables: int32 [Bd, max_blocks]. Query b sits at position seq_lens[b] - 1 and sees keys
    0 .. seq_lens[b] - 1 (with a sliding window W, only those > position - W); a row with
    seq_lens[b] == 0 gets zeros. num_splits: programs per (sequence, KV head), each a contiguous
    share of the context. Returns out.
    """
    T, Hq, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    Bd = qrow.shape[0]
    assert Hq % Hkv == 0 and D & (D - 1) == 0 and block_size & (block_size - 1) == 0
    assert (
        q.stride(2) == 1
        and out.stride(2) == 1
        and k_cache.stride(3) == 1
        and v_cache.stride(3) == 1
    )
    if Bd == 0:
        return out
    group = Hq // Hkv
    group_pad = max(16, triton.next_power_of_2(group))
    block_n = 64 if D <= 128 else 32
    m = torch.empty((Bd, Hq, num_splits), dtype=torch.float32, device=q.device)
    l = torch.empty((Bd, Hq, num_splits), dtype=torch.float32, device=q.device)  # noqa: E741
    acc = torch.empty((Bd, Hq, num_splits, D), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(Bd, Hkv, num_splits)](
        q,
        k_cache,
        v_cache,
        qrow,
        seq_lens,
        block_tables,
        m,
        l,
        acc,
        float(scale) * float(k_scale) * _LOG2E,
        0 if sliding_window is None else int(sliding_window),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        HQ=Hq,
        D=D,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        HAS_WINDOW=sliding_window is not None,
        DOT_PREC=_dot_precision(q.dtype),
        num_warps=4,
        num_stages=2,
    )
    _merge_decode_splits(m, l, acc, qrow, out, v_scale)
    return out


def _merge_decode_splits(m, l, acc, qrow, out, v_scale) -> None:  # noqa: E741
    """The splits' partial (max, sum, acc) [Bd, Hq, num_splits(, D)] -> out[qrow[b]], times
    v_scale."""
    Bd, Hq, num_splits, D = acc.shape
    _decode_merge_kernel[(Bd, Hq)](
        m,
        l,
        acc,
        qrow,
        out,
        float(v_scale),
        out.stride(0),
        out.stride(1),
        HQ=Hq,
        D=D,
        NUM_SPLITS=num_splits,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        num_warps=1 if D <= 64 else 2,
    )


@triton.jit
def _prefill_tile(
    q,
    m_i,
    l_i,
    acc,
    t,
    lo,
    hi,
    pos,
    window,
    qk_scale,
    k_ptr,
    v_ptr,
    bt_row,
    kvh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One BLOCK_N-key tile of the online softmax. MASKED=False: every key of the tile is in the
    context and visible to every query of the tile (no masks)."""
    offs_d = tl.arange(0, D)
    tok = t + tl.arange(0, BLOCK_N)
    if MASKED:
        n_mask = (tok >= lo) & (tok < hi)
        blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + tok // BLOCK_SIZE).to(tl.int64)
    off = tok % BLOCK_SIZE
    k_ptrs = (
        k_ptr
        + blk[:, None] * stride_kb
        + off[:, None] * stride_kt
        + kvh * stride_kh
        + offs_d[None, :]
    )
    v_ptrs = (
        v_ptr
        + blk[:, None] * stride_vb
        + off[:, None] * stride_vt
        + kvh * stride_vh
        + offs_d[None, :]
    )
    if MASKED:
        k = tl.load(k_ptrs, mask=n_mask[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=n_mask[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC) * qk_scale  # log2 domain
    if MASKED:
        visible = (tok[None, :] <= pos[:, None]) & n_mask[None, :]
        if HAS_WINDOW:
            visible = visible & (tok[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # row with nothing visible yet
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = m_new
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
    return m_new, l_i, acc


# fmt: off
# Argument lists kept compact by hand: ruff would put each of the 27 arguments of the three tile
# calls on its own line.
@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, seq_idx_ptr, qsl_ptr, lens_ptr, bt_ptr,
    qk_scale, v_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
):
    seq = tl.load(seq_idx_ptr + tl.program_id(0))
    h = tl.program_id(1)
    mblk = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if mblk * BLOCK_M >= q_len:
        return
    seq_len = tl.load(lens_ptr + seq)
    kvh = h // GROUP

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    m_mask = offs_m < q_len
    pos = seq_len - q_len + offs_m  # query positions
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=m_mask[:, None],
        other=0.0,
    )

    # The band of keys: [lo, hi), from the first query's window start (no key before it is
    # loaded: a window group frees those blocks) to the last valid query's position. Tiles
    # wholly visible to every query ([u_lo, u_hi)) run without masks.
    first_pos = seq_len - q_len + mblk * BLOCK_M
    hi = tl.minimum(first_pos + BLOCK_M, seq_len)
    lo = hi * 0
    full_lo = hi * 0
    if HAS_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)
        full_lo = tl.maximum(hi - window, 0)
    base = (lo // BLOCK_N) * BLOCK_N
    u_lo = tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, base)
    u_hi = tl.maximum(((first_pos + 1) // BLOCK_N) * BLOCK_N, u_lo)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    if HAS_WINDOW:
        for t in range(base, u_lo, BLOCK_N):  # the window's leading edge
            m_i, l_i, acc = _prefill_tile(
                q, m_i, l_i, acc, t, lo, hi, pos, window, qk_scale, k_ptr, v_ptr, bt_row, kvh,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                D, BLOCK_SIZE, BLOCK_N, True, HAS_WINDOW, DOT_PREC,
            )
    for t in range(u_lo, u_hi, BLOCK_N):  # interior
        m_i, l_i, acc = _prefill_tile(
            q, m_i, l_i, acc, t, lo, hi, pos, window, qk_scale, k_ptr, v_ptr, bt_row, kvh,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            D, BLOCK_SIZE, BLOCK_N, False, HAS_WINDOW, DOT_PREC,
        )
    for t in range(u_hi, hi, BLOCK_N):  # the causal diagonal
        m_i, l_i, acc = _prefill_tile(
            q, m_i, l_i, acc, t, lo, hi, pos, window, qk_scale, k_ptr, v_ptr, bt_row, kvh,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            D, BLOCK_SIZE, BLOCK_N, True, HAS_WINDOW, DOT_PREC,
        )

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
    tl.store(
        out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None],
    )
# fmt: on


# Prefill tiles by head dim: (BLOCK_M, BLOCK_N, num_warps, num_stages).
PREFILL_CONFIGS = {64: (64, 64, 4, 2), 128: (64, 32, 4, 2), 256: (32, 32, 4, 2)}


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    seq_idx: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_q_len: int,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of multi-token chunks over the paged pool; writes only the q rows of the
    sequences in seq_idx.

    query_start_loc: int32 [B + 1]; seq_lens: int32 [B]; block_tables: int32 [B, max_blocks];
    seq_idx: int32 [Bp], the sequences to compute; max_q_len: a bound on their q_len (grid
    size only). Query i of sequence b sits at position seq_len - q_len + i and sees keys
    0 .. position (with a sliding window W, only those > position - W); the chunk's own keys
    must already be in the pool. Returns out.
    """
    T, Hq, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    Bp = seq_idx.shape[0]
    assert Hq % Hkv == 0 and D & (D - 1) == 0 and block_size & (block_size - 1) == 0
    assert (
        q.stride(2) == 1
        and out.stride(2) == 1
        and k_cache.stride(3) == 1
        and v_cache.stride(3) == 1
    )
    if Bp == 0 or max_q_len <= 0:
        return out
    assert D <= 256, "head dims up to 256"
    block_m, block_n, warps, stages = PREFILL_CONFIGS[max(64, D)]
    grid = (Bp, Hq, triton.cdiv(max_q_len, block_m))
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        seq_idx,
        query_start_loc,
        seq_lens,
        block_tables,
        float(scale) * float(k_scale) * _LOG2E,
        float(v_scale),
        0 if sliding_window is None else int(sliding_window),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        GROUP=Hq // Hkv,
        D=D,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_WINDOW=sliding_window is not None,
        DOT_PREC=_dot_precision(q.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    return out
