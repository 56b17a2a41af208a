"""Triton kernels (kvserve.ops.triton_attention, kvserve.ops.triton_norm) against torch references.

Two modes. With CUDA (and TRITON_INTERPRET unset): on the GPU at SmolLM2-135M shapes (Hq=9,
Hkv=3, D=64, block_size 16), contexts up to 4096, 256 decodes, bfloat16 / float16 / float32 and
float8_e4m3fn KV. Without CUDA: on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1) at
small shapes, float32 and float16 (the interpreter's bfloat16 dot and float32 -> bfloat16
rounding differ from the GPU's, so bfloat16 runs on the GPU only).

KV pools hold NaN in block 0, and block tables name block 0 wherever no visible key lives (past
the context, before a sliding window): a kernel that reads such a key fails the comparison.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules are imported
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")

triton = pytest.importorskip("triton", reason="Triton is not installed (the GPU kernels need it)")
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("no CUDA device and TRITON_INTERPRET is off", allow_module_level=True)

from kvserve.model.layers import RMSNorm, RopeTables, RotaryEmbedding  # noqa: E402
from kvserve.ops.attention import AttentionMetadata, paged_attention_ref  # noqa: E402
from kvserve.ops.triton_attention import paged_decode_attention, paged_prefill_attention  # noqa: E402
from kvserve.ops.triton_norm import add_rms_norm, rms_norm, rope  # noqa: E402

GPU = not INTERPRET
DEVICE = torch.device("cuda" if GPU else "cpu")
SENTINEL = -777.0
FP8 = torch.float8_e4m3fn

if GPU:
    HQ, HKV, D, BS = 9, 3, 64, 16
    DTYPES = [torch.bfloat16, torch.float16, torch.float32]
    SPLITS = [1, 8, 16]
    WINDOW = 1000
    DECODE_LENS = [1, 2, 15, 16, 17, 63, 64, 65, 4096] + random.Random(0).choices(
        range(1, 4097), k=247
    )
    # (start position, q_len, computed): q_len == 1 rows and computed=False rows stay untouched.
    PREFILL = [
        (0, 1, False),
        (21, 37, True),
        (0, 1024, True),
        (3000, 1096, True),
        (4091, 5, True),
        (100, 300, False),
        (0, 2048, True),
        (1, 1, False),
        (517, 700, True),
        (2000, 2, True),
        (0, 4096, True),
        (33, 64, True),
    ]
    FP8_QDTYPES = [torch.bfloat16, torch.float16]
    HEAD_DIMS = [(128, 16), (256, 8), (64, 32)]
else:
    HQ, HKV, D, BS = 6, 2, 64, 16
    DTYPES = [torch.float32, torch.float16]
    SPLITS = [1, 3, 8]
    WINDOW = 20
    DECODE_LENS = [1, 2, 9, 16, 33, 64, 100]
    PREFILL = [
        (0, 1, False),
        (21, 37, True),
        (0, 70, True),
        (50, 5, True),
        (3, 90, True),
        (10, 6, False),
    ]
    FP8_QDTYPES = [torch.float32, torch.float16]
    HEAD_DIMS = [(128, 16), (256, 8)]

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def i32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32, device=DEVICE)


def make_pools(
    num_blocks: int,
    block_size: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
):
    """(k_cache, v_cache) of `dtype`, block 0 all NaN. A float8 pool stores value / scale."""
    k = torch.randn(num_blocks, block_size, hkv, d, device=DEVICE)
    v = torch.randn(num_blocks, block_size, hkv, d, device=DEVICE)
    k[0] = float("nan")
    v[0] = float("nan")
    if dtype == FP8:
        return (k / k_scale).to(FP8), (v / v_scale).to(FP8)
    return k.to(dtype), v.to(dtype)


def make_tables(seq_lens: list[int], first_visible: list[int], block_size: int, seed: int = 0):
    """Block tables with distinct, shuffled block ids >= 1 for every block holding a visible key;
    block 0 (NaN) for blocks wholly before first_visible[b] and for the padding. Returns
    (tables int32 [B, width], num_blocks)."""
    nblks = [-(-n // block_size) for n in seq_lens]
    width = max(nblks) + 2
    ids = (torch.randperm(sum(nblks), generator=torch.Generator().manual_seed(seed)) + 1).to(
        torch.int32
    )
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for b, n in enumerate(nblks):
        tables[b, :n] = ids[used : used + n]
        tables[b, : first_visible[b] // block_size] = 0
        used += n
    return tables.to(DEVICE), sum(nblks) + 1


def ref_chunk(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    seq_len: int,
    scale: float,
    window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of one sequence's last q.shape[0] queries over its paged context, with explicit
    masks and softmax (float64 on CPU, float32 on the GPU). Returns [q_len, Hq, D] float."""
    q_len, hq, _ = q.shape
    bs = k_cache.shape[1]
    ft = torch.float32 if GPU else torch.float64
    first = 0 if window is None else max(0, seq_len - q_len - window + 1)
    nblk = -(-seq_len // bs)
    k = k_cache[table[:nblk].long()].flatten(0, 1)[first:seq_len].to(ft) * k_scale
    v = v_cache[table[:nblk].long()].flatten(0, 1)[first:seq_len].to(ft) * v_scale
    group = hq // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.to(ft), k) * scale
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
    k_pos = torch.arange(first, seq_len, device=q.device)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    s = s.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref.double(), atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- decode


def run_decode(
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    num_splits: int,
    window: int | None,
    lens: list[int],
    hq: int = HQ,
    hkv: int = HKV,
    d: int = D,
    bs: int = BS,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    torch.manual_seed(1)
    first = [0 if window is None else max(0, n - window) for n in lens]
    tables, num_blocks = make_tables(lens, first, bs, seed=2)
    k_cache, v_cache = make_pools(num_blocks, bs, hkv, d, kv_dtype, k_scale, v_scale)
    Bd = len(lens)
    T = Bd + 3  # three rows that are not decodes
    qrow = torch.randperm(T)[:Bd].to(torch.int32).to(DEVICE)
    q = torch.randn(T, hq, d, device=DEVICE).to(dtype)
    out = torch.full_like(q, SENTINEL)
    scale = d**-0.5
    paged_decode_attention(
        q,
        k_cache,
        v_cache,
        out,
        qrow,
        i32(lens),
        tables,
        scale,
        sliding_window=window,
        num_splits=num_splits,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    rows = qrow.long().tolist()
    ref = torch.stack(
        [
            ref_chunk(
                q[r : r + 1], k_cache, v_cache, tables[b], lens[b], scale, window, k_scale, v_scale
            )[0]
            for b, r in enumerate(rows)
        ]
    )
    assert_close(out[qrow.long()], ref, dtype)
    others = [r for r in range(T) if r not in rows]
    assert (out[others] == SENTINEL).all(), "rows that are not decodes were written"


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("num_splits", SPLITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode(dtype, num_splits, window):
    """Random non-contiguous block tables, GQA, mixed context lengths (short ones leave splits
    empty), sliding window; only the decode rows of out are written."""
    run_decode(dtype, dtype, num_splits, window, DECODE_LENS)


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("dtype", FP8_QDTYPES, ids=str)
def test_decode_fp8(dtype, window):
    """float8_e4m3fn pools with k_scale / v_scale (also runs under the interpreter)."""
    run_decode(dtype, FP8, 8, window, DECODE_LENS, k_scale=0.05, v_scale=0.03)


@pytest.mark.parametrize("d,bs", HEAD_DIMS)
def test_decode_head_dims(d, bs):
    """Head dims 128 / 256 (and 64 with 32-token blocks on the GPU), a group of 4 query heads."""
    lens = [1, 40, 77] if not GPU else DECODE_LENS[:64]
    dtype = torch.float32 if not GPU else torch.bfloat16
    run_decode(dtype, dtype, 4, None, lens, hq=8, hkv=2, d=d, bs=bs)


def test_decode_one_kv_head_all_splits_empty_but_one():
    """Hkv = 1 (every query head in one group) and a context of one token with many splits."""
    dtype = torch.float32
    run_decode(dtype, dtype, 16, None, [1, 3], hq=4, hkv=1)


# ----------------------------------------------------------------------------- prefill


def run_prefill(
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    window: int | None,
    spec=PREFILL,
    hq: int = HQ,
    hkv: int = HKV,
    d: int = D,
    bs: int = BS,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    extra_q_len: int = 17,
) -> None:
    torch.manual_seed(3)
    lens = [start + q_len for start, q_len, _ in spec]
    qsl = [0]
    for _, q_len, _ in spec:
        qsl.append(qsl[-1] + q_len)
    first = [0 if window is None else max(0, start - window + 1) for start, _, _ in spec]
    tables, num_blocks = make_tables(lens, first, bs, seed=4)
    k_cache, v_cache = make_pools(num_blocks, bs, hkv, d, kv_dtype, k_scale, v_scale)
    q = torch.randn(qsl[-1], hq, d, device=DEVICE).to(dtype)
    out = torch.full_like(q, SENTINEL)
    computed = [b for b, (_, _, c) in enumerate(spec) if c]
    random.Random(5).shuffle(computed)
    max_q_len = max(spec[b][1] for b in computed) + extra_q_len  # a loose bound: more programs
    scale = d**-0.5
    paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        out,
        i32(computed),
        i32(qsl),
        i32(lens),
        tables,
        max_q_len,
        scale,
        sliding_window=window,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    for b in range(len(spec)):
        rows = slice(qsl[b], qsl[b + 1])
        if b in computed:
            ref = ref_chunk(
                q[rows], k_cache, v_cache, tables[b], lens[b], scale, window, k_scale, v_scale
            )
            assert_close(out[rows], ref, dtype)
        else:
            assert (out[rows] == SENTINEL).all(), (
                f"rows of sequence {b} (not in seq_idx) were written"
            )


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill(dtype, window):
    """Chunked prefill (start not a multiple of the block size), full prompts, short verification
    chunks, chunks longer than one query tile, sequences left out of seq_idx untouched."""
    run_prefill(dtype, dtype, window)


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("dtype", FP8_QDTYPES, ids=str)
def test_prefill_fp8(dtype, window):
    run_prefill(dtype, FP8, window, k_scale=0.05, v_scale=0.03)


@pytest.mark.parametrize("d,bs", HEAD_DIMS)
def test_prefill_head_dims(d, bs):
    spec = [(5, 40, True), (0, 33, True), (7, 1, False)]
    dtype = torch.float32 if not GPU else torch.bfloat16
    run_prefill(dtype, dtype, 30, spec=spec, hq=8, hkv=2, d=d, bs=bs)


def test_prefill_long_context_window():
    """A window much longer than a key tile: key tiles visible to a whole query tile (no masks)
    between the window's edge and the diagonal."""
    spec = [(300, 20, True), (250, 64, True), (0, 200, True)]
    dtype = torch.float32 if not GPU else torch.bfloat16
    run_prefill(dtype, dtype, 200, spec=spec)


def test_reference_matches_paged_attention_ref():
    """ref_chunk (used above) agrees with kvserve.ops.attention.paged_attention_ref."""
    spec = [(0, 1), (13, 9), (0, 20), (30, 1)]
    lens = [s + n for s, n in spec]
    qsl = [0]
    for _, n in spec:
        qsl.append(qsl[-1] + n)
    tables, num_blocks = make_tables(lens, [0] * len(lens), 8, seed=6)
    gen = torch.Generator().manual_seed(7)
    k_cache = torch.randn(num_blocks, 8, 2, 16, generator=gen)
    v_cache = torch.randn(num_blocks, 8, 2, 16, generator=gen)
    q = torch.randn(qsl[-1], 4, 16, generator=gen)
    tables = tables.cpu()
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        query_start_loc=qsl,
        seq_lens=lens,
        block_tables=tables.long(),
        block_size=8,
    )
    for window in (None, 6):
        expect = paged_attention_ref(q, k_cache, v_cache, meta, 0.3, window)
        for b in range(len(spec)):
            got = ref_chunk(
                q[qsl[b] : qsl[b + 1]].to(DEVICE),
                k_cache.to(DEVICE),
                v_cache.to(DEVICE),
                tables[b].to(DEVICE),
                lens[b],
                0.3,
                window,
            )
            torch.testing.assert_close(
                got.float().cpu(), expect[qsl[b] : qsl[b + 1]], atol=1e-4, rtol=1e-4
            )


# ----------------------------------------------------------------------------- norms, rope

NORM_DTYPES = DTYPES


@pytest.mark.parametrize("dtype", NORM_DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [576, 96])
def test_rms_norm(dtype, hidden):
    """Against RMSNorm.forward of layers.py (weight in the activation dtype), also on a strided
    x."""
    torch.manual_seed(8)
    n_rows = 300 if GPU else 37
    base = torch.randn(n_rows, hidden + 40, device=DEVICE).to(dtype) * 3
    w = (torch.rand(hidden, device=DEVICE) + 0.5).to(dtype)
    norm = RMSNorm(hidden, 1e-6, dtype).to(DEVICE)
    norm.load_weight(w)
    for x in (base[:, :hidden].contiguous(), base[:, 40:]):  # the second has stride 0 != H
        y = rms_norm(x, w, 1e-6)
        assert y.dtype == dtype and y.shape == x.shape
        assert_close(y, norm(x), dtype)


@pytest.mark.parametrize("dtype", NORM_DTYPES, ids=str)
def test_add_rms_norm(dtype):
    """new_residual is the float32 sum rounded once; y is rms_norm of it."""
    torch.manual_seed(9)
    n_rows, hidden = (300, 576) if GPU else (29, 576)
    residual = torch.randn(n_rows, hidden, device=DEVICE).to(dtype)
    delta = torch.randn(n_rows, hidden, device=DEVICE).to(dtype)
    w = (torch.rand(hidden, device=DEVICE) + 0.5).to(dtype)
    norm = RMSNorm(hidden, 1e-5, dtype).to(DEVICE)
    norm.load_weight(w)
    new_res, y = add_rms_norm(residual, delta, w, 1e-5)
    expect = (residual.float() + delta.float()).to(dtype)
    assert new_res.dtype == dtype and torch.equal(new_res, expect)
    assert_close(y, norm(expect), dtype)
    assert_close(y, rms_norm(expect, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", NORM_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope(dtype, head_dim):
    """Against RotaryEmbedding.apply (float32 math), on a contiguous x and on the query / key
    column slices of a fused [T, (Hq + 2 Hkv) * D] projection; int64 and int32 positions."""
    torch.manual_seed(10)
    T = 200 if GPU else 13
    hq, hkv = 9, 3
    emb = RotaryEmbedding(head_dim, 4096, 10000.0).to(DEVICE)
    positions = torch.randint(0, 4096, (T,), device=DEVICE)
    qkv = torch.randn(T, (hq + 2 * hkv) * head_dim, device=DEVICE).to(dtype)
    q = qkv[:, : hq * head_dim].view(T, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hkv) * head_dim].view(T, hkv, head_dim)
    assert not q.is_contiguous() and not k.is_contiguous()
    for x in (q, k, q.contiguous()):
        torch_math = emb.tables(positions.cpu(), torch.float32)  # cos, sin rows: no kernel
        rows = RopeTables(torch_math.cos.to(DEVICE), torch_math.sin.to(DEVICE))
        expect = RotaryEmbedding.apply(x.float(), rows).to(dtype)
        for pos in (positions, positions.to(torch.int32)):
            y = rope(x, pos, emb.cos, emb.sin)
            assert y.is_contiguous() and y.dtype == dtype and y.shape == x.shape
            assert_close(y, expect, dtype)
    assert torch.equal(qkv[:, : hq * head_dim].view(T, hq, head_dim), q)  # x is not modified


# ----------------------------------------------------------------------------- CUDA graphs


@pytest.mark.skipif(
    not GPU, reason="CUDA graph capture needs a GPU (this run uses the interpreter)"
)
def test_cuda_graph_capture():
    """Every wrapper captures into one CUDA graph; replays follow new seq_lens, tables and inputs
    written in place, matching eager calls."""
    torch.manual_seed(11)
    dtype, width = torch.bfloat16, 64  # room for 1024 tokens of 16
    Bd, T = 4, 39
    k_cache, v_cache = make_pools(Bd * width + 1, BS, HKV, D, dtype)
    k_cache[0] = 0.0
    v_cache[0] = 0.0
    tables = (torch.randperm(Bd * width, device=DEVICE) + 1).view(Bd, width).to(torch.int32)
    q = torch.randn(T, HQ, D, device=DEVICE).to(dtype)
    lens = i32([5, 100, 1000, 40])
    qsl = i32([0, 1, 2, 3, 39])  # three decodes, then a 36-token chunk
    qrow, seq_idx = i32([0, 1, 2]), i32([3])
    out = torch.zeros_like(q)
    hidden = torch.randn(T, 576, device=DEVICE).to(dtype)
    w = torch.rand(576, device=DEVICE).to(dtype)
    emb = RotaryEmbedding(D, 2048, 10000.0).to(DEVICE)
    pos = torch.arange(T, device=DEVICE)

    def step():
        paged_decode_attention(q, k_cache, v_cache, out, qrow, lens[:3], tables[:3], D**-0.5)
        paged_prefill_attention(q, k_cache, v_cache, out, seq_idx, qsl, lens, tables, 64, D**-0.5)
        res, y = add_rms_norm(hidden, hidden, w, 1e-5)
        return res, y, rope(q, pos, emb.cos, emb.sin)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for new_lens in ([1, 700, 64, 1024], [33, 2, 999, 36]):  # the chunk: 36 tokens
        lens.copy_(i32(new_lens))
        tables.copy_(tables[torch.randperm(Bd, device=DEVICE)])
        q.copy_(torch.randn_like(q))
        hidden.copy_(torch.randn_like(hidden))
        pos.copy_(torch.randint(0, 2048, (T,), device=DEVICE))
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        graph_out, graph_outs = out.clone(), [t.clone() for t in outs]
        out.zero_()
        eager = step()
        assert torch.equal(graph_out, out)
        for a, b in zip(graph_outs, eager):
            assert torch.equal(a, b)
