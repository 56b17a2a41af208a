"""Paged attention over a flat, unpadded batch (torch reference path).

The KV pool of one layer is two tensors `[num_blocks, block_size, kv_heads, head_dim]`.
A request's context lives in the blocks its block table names, in order: token `p` of the
request sits in block `block_table[p // block_size]` at offset `p % block_size`, i.e. at the
flat slot `block_table[p // block_size] * block_size + p % block_size`.

One step's batch is every scheduled token of every request, concatenated (no padding):
request `b` owns queries `query_start_loc[b]:query_start_loc[b + 1]`, which are the last
`q_len` tokens of its `seq_lens[b]` context. A decode is simply a chunk of one token.

Sliding windows (HF semantics: key j is visible to query i iff j <= i and i - j < W). A model
whose layers attend with different windows keeps one KV group per window, each with its own
pool and block tables (kvserve/core/kv_cache.py): the step's metadata holds one
AttentionMetadata per layer (`for_layer`). A window group frees the blocks no query can read any
more, and its tables name block 0 in their place: no path here reads those entries for a
visible key (the C kernel starts at the window, the prompt path gathers from the window's first
block, the batched SDPA decode path reads them under a -inf mask, and written KV is finite).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.ops import cpu_kernels, kv_int8


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: flat slot of each new token
    query_start_loc: list[int]  # [B + 1] query spans in the flat batch
    seq_lens: list[int]  # [B] context length after this step (start_pos + q_len)
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    block_size: int
    # Derived once per step and reused by every layer (decode rows, masks): see decode_plan.
    plan: dict = field(default_factory=dict, repr=False, compare=False)
    # Several KV groups: the metadata of each layer's group, by layer (None: one group, this one).
    layers: list["AttentionMetadata"] | None = field(default=None, repr=False, compare=False)
    # The same step as the Triton kernels read it (GpuPlan: device tensors); when set, attention
    # runs there.
    gpu: "GpuPlan | None" = field(default=None, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def for_layer(self, layer: int) -> "AttentionMetadata":
        """The metadata layer `layer` attends with: its KV group's slot mapping and block tables
        (one KV group, every layer's blocks at the same ids: this one)."""
        return self if self.layers is None else self.layers[layer]


# An fp8 (e4m3) pool stores value / FP8_KV_SCALE, clamped to e4m3's range: one per-tensor scale,
# 1.0 as vLLM takes it without calibration (e4m3 spans 2^-9..448 with 3 mantissa bits).
FP8_KV_SCALE = 1.0
FP8_MAX = 448.0


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store the new tokens' keys and values ([T, Hkv, D]) at their slots in the pool (an int8
    pool gets quantized rows: kvserve.ops.kv_int8; an fp8 pool scaled e4m3 values)."""
    nb, bs, h, d = k_cache.shape
    if k_cache.dtype == torch.int8:
        k, v = kv_int8.quantize(k), kv_int8.quantize(v)
    elif k_cache.dtype == torch.float8_e4m3fn:  # index_copy_ has no fp8 kernel: copy the bytes

        def fp8_bytes(x):
            return (
                (x.float() / FP8_KV_SCALE)
                .clamp_(-FP8_MAX, FP8_MAX)
                .to(torch.float8_e4m3fn)
                .view(torch.uint8)
            )

        k_cache.view(torch.uint8).view(nb * bs, h, d).index_copy_(0, slot_mapping, fp8_bytes(k))
        v_cache.view(torch.uint8).view(nb * bs, h, d).index_copy_(0, slot_mapping, fp8_bytes(v))
        return
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, n: int, first_block: int = 0
) -> torch.Tensor:
    """Tokens first_block * block_size .. n - 1 of one request's context:
    [n - first_block * bs, Hkv, D]."""
    bs = cache.shape[1]
    return cache.index_select(0, block_table[first_block : (n + bs - 1) // bs]).flatten(0, 1)[
        : n - first_block * bs
    ]


def gather_blocks(cache: torch.Tensor, tables: torch.Tensor, n: int) -> torch.Tensor:
    """The first `n` token slots of each row's blocks: [B, n, Hkv, D]. index_select copies whole
    blocks (contiguous slices), about twice as fast as advanced indexing with a 2-D index."""
    B, nblk = tables.shape
    _, bs, h, d = cache.shape
    return cache.index_select(0, tables.reshape(-1)).view(B, nblk * bs, h, d)[:, :n]


def causal_mask(
    q_len: int, seq_len: int, sliding_window: int | None = None, device=None
) -> torch.Tensor:
    """[q_len, seq_len] bool, True where query i (at position seq_len - q_len + i) sees key j."""
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of every query in the flat batch over its request's paged context.

    q: [T, Hq, D]; the batch's own keys/values must already be in the cache (write_kv).
    Returns [T, Hq, D]. GQA: each KV head serves Hq // Hkv query heads.
    Single-token decodes run together: in the C kernel (cpu_kernels.paged_attention), which reads
    K/V in place from the pool, or else in one SDPA call over their gathered blocks (context
    padded and masked). Prompt chunks run one SDPA call each.
    """
    if meta.gpu is not None:
        return gpu_paged_attention(q, k_cache, v_cache, meta.gpu, scale, sliding_window)
    qsl, seq_lens = meta.query_start_loc, meta.seq_lens
    plan = decode_plan(meta, sliding_window, q.device)
    if plan is not None and cpu_kernels.supports(q, k_cache, v_cache):
        q = q.contiguous()
        out = torch.empty_like(q)
        cpu_kernels.paged_attention(
            q, k_cache, v_cache, out, plan.qrow, plan.tables, plan.lens, scale, sliding_window
        )
        if plan.all_decodes:
            return out
    elif plan is not None:
        k = kv_int8.as_float(
            gather_blocks(k_cache, plan.tables, plan.max_len), q.dtype
        )  # [Bd, Lmax, Hkv, D]
        v = kv_int8.as_float(gather_blocks(v_cache, plan.tables, plan.max_len), q.dtype)
        qd = q if plan.all_decodes else q[plan.qrow]
        o = F.scaled_dot_product_attention(
            qd[:, :, None],
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=plan.sdpa_mask(sliding_window),
            scale=scale,
            enable_gqa=True,
        )[:, :, 0]
        if plan.all_decodes:  # every chunk is a decode: nothing else to compute
            return o
        out = torch.empty_like(q)
        out[plan.qrow] = o
    else:
        out = torch.empty_like(q)
    for b in range(len(seq_lens)):
        q_len, seq_len = qsl[b + 1] - qsl[b], seq_lens[b]
        if q_len <= 1:
            continue
        # Keys from the block of the chunk's first visible key on (masks depend on i - j only).
        first = (
            0
            if sliding_window is None
            else max(0, seq_len - q_len - sliding_window + 1) // meta.block_size
        )
        k = kv_int8.as_float(gather_kv(k_cache, meta.block_tables[b], seq_len, first), q.dtype)
        v = kv_int8.as_float(gather_kv(v_cache, meta.block_tables[b], seq_len, first), q.dtype)
        qb = q[qsl[b] : qsl[b + 1]].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        kb, vb = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, Hkv, L, D]
        if q_len == seq_len and sliding_window is None:
            o = F.scaled_dot_product_attention(
                qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            mask = causal_mask(q_len, seq_len - first * meta.block_size, sliding_window, q.device)
            o = F.scaled_dot_product_attention(
                qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=True
            )
        out[qsl[b] : qsl[b + 1]] = o[0].transpose(0, 1)
    return out


@dataclass
class GpuPlan:
    """One step as the Triton kernels (kvserve/ops/triton_attention.py) read it: int32 tensors on
    the device, built once per step (gpu_plan) or held as static buffers by a captured CUDA graph.
    Single-token decodes run the split-K decode kernel, every longer chunk the prefill kernel."""

    query_start_loc: torch.Tensor  # [B + 1]
    seq_lens: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, nblk]
    decode_rows: torch.Tensor  # [Bd]: rows of the decodes in the flat batch
    decode_lens: torch.Tensor  # [Bd]
    decode_tables: torch.Tensor  # [Bd, nblk]
    prefill_seqs: torch.Tensor  # [Bp]: the chunks of more than one token
    num_decodes: int
    max_q_len: int  # the longest of those chunks (0: none)
    num_splits: int  # decode kernel: KV splits per (decode, KV head)


def decode_splits(num_decodes: int, num_kv_heads: int, sm_count: int) -> int:
    """KV splits per (decode, KV head) for the split-K decode kernel: enough programs to fill
    the GPU twice over, 1 to 16."""
    return max(1, min(16, 2 * sm_count // max(1, num_decodes * num_kv_heads)))


def gpu_plan(meta: AttentionMetadata, device, num_kv_heads: int, sm_count: int) -> GpuPlan:
    """The step's GpuPlan from the metadata's host-side lists (a few small host-to-device
    copies)."""
    qsl, lens = meta.query_start_loc, meta.seq_lens
    q_lens = [qsl[b + 1] - qsl[b] for b in range(len(lens))]
    decodes = [b for b, n in enumerate(q_lens) if n == 1]
    prefills = [b for b, n in enumerate(q_lens) if n > 1]
    tables = meta.block_tables.to(torch.int32)

    def dev(x):
        return torch.tensor(x, dtype=torch.int32).to(device, non_blocking=True)

    return GpuPlan(
        query_start_loc=dev(qsl),
        seq_lens=dev(lens),
        block_tables=tables.to(device, non_blocking=True),
        decode_rows=dev([qsl[b] for b in decodes]),
        decode_lens=dev([lens[b] for b in decodes]),
        decode_tables=tables[decodes].to(device, non_blocking=True),
        prefill_seqs=dev(prefills),
        num_decodes=len(decodes),
        max_q_len=max((q_lens[b] for b in prefills), default=0),
        num_splits=decode_splits(len(decodes), num_kv_heads, sm_count),
    )


def gpu_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: GpuPlan,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """paged_attention through the Triton kernels: decodes split-K, longer chunks flash-style."""
    from kvserve.ops import triton_attention

    q = q.contiguous()
    out = torch.empty_like(q)
    kv_scale = FP8_KV_SCALE if k_cache.dtype == torch.float8_e4m3fn else 1.0
    if plan.num_decodes:
        triton_attention.paged_decode_attention(
            q,
            k_cache,
            v_cache,
            out,
            plan.decode_rows,
            plan.decode_lens,
            plan.decode_tables,
            scale,
            sliding_window,
            plan.num_splits,
            kv_scale,
            kv_scale,
        )
    if plan.max_q_len:
        triton_attention.paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            out,
            plan.prefill_seqs,
            plan.query_start_loc,
            plan.seq_lens,
            plan.block_tables,
            plan.max_q_len,
            scale,
            sliding_window,
            kv_scale,
            kv_scale,
        )
    return out


@dataclass
class DecodePlan:
    """The step's single-token decodes, as every layer runs them (built once per step)."""

    all_decodes: bool  # every chunk of the step is a decode (rows are the whole batch, in order)
    qrow: torch.Tensor  # [Bd] int64: their rows in the flat batch
    tables: torch.Tensor  # [Bd, nblk] int64, contiguous: their block tables, cut to max_len
    lens: torch.Tensor  # [Bd] int64: their context lengths
    max_len: int
    _mask: tuple | None = None

    def sdpa_mask(self, sliding_window: int | None) -> torch.Tensor | None:
        """[Bd, 1, 1, max_len] additive mask (0 / -inf) over the padded contexts for the SDPA path,
        or None when no row needs one (one context length, no window inside it). Built once."""
        if self._mask is None:
            lens = self.lens.tolist()
            mask = None
            if min(lens) != self.max_len or (
                sliding_window is not None and self.max_len > sliding_window
            ):
                k_pos = torch.arange(self.max_len, device=self.lens.device)[None, :]
                keep = k_pos < self.lens[:, None]  # padding past each context
                if sliding_window is not None:
                    keep &= k_pos >= (self.lens[:, None] - sliding_window)
                mask = torch.zeros(keep.shape, device=keep.device).masked_fill_(
                    ~keep, float("-inf")
                )
                mask = mask[:, None, None, :]
            self._mask = (mask,)
        return self._mask[0]


def decode_plan(meta: AttentionMetadata, sliding_window: int | None, device) -> DecodePlan | None:
    """The DecodePlan of the step, or None without decodes. Built on the first layer's call and
    cached on the metadata for the other layers (per sliding window: its mask differs)."""
    key = ("decode", sliding_window)
    if key in meta.plan:
        return meta.plan[key]
    qsl, seq_lens = meta.query_start_loc, meta.seq_lens
    decodes = [b for b in range(len(seq_lens)) if qsl[b + 1] - qsl[b] == 1]
    plan = None
    if decodes:
        dec_lens = [seq_lens[b] for b in decodes]
        max_len = max(dec_lens)
        plan = DecodePlan(
            all_decodes=len(decodes) == len(seq_lens),
            qrow=torch.tensor([qsl[b] for b in decodes], device=device),
            tables=meta.block_tables[decodes, : -(-max_len // meta.block_size)].contiguous(),
            lens=torch.tensor(dec_lens, device=device),
            max_len=max_len,
        )
    meta.plan[key] = plan
    return plan


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Dead-simple reference: explicit loops and softmax. Tests only."""
    if k_cache.dtype == torch.int8:
        k_cache, v_cache = kv_int8.dequantize(k_cache), kv_int8.dequantize(v_cache)
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    group = Hq // Hkv
    bs = meta.block_size
    out = torch.zeros(T, Hq, D, dtype=torch.float64)
    for b in range(len(meta.seq_lens)):
        start_q, end_q, seq_len = (
            meta.query_start_loc[b],
            meta.query_start_loc[b + 1],
            meta.seq_lens[b],
        )
        start = seq_len - (end_q - start_q)
        for i in range(end_q - start_q):
            pos = start + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            keys = range(lo, pos + 1)
            for h in range(Hq):
                kvh = h // group
                ks = torch.stack(
                    [k_cache[meta.block_tables[b, j // bs], j % bs, kvh] for j in keys]
                )
                vs = torch.stack(
                    [v_cache[meta.block_tables[b, j // bs], j % bs, kvh] for j in keys]
                )
                scores = (ks.double() @ q[start_q + i, h].double()) * scale
                p = torch.exp(scores - scores.max())
                p = p / p.sum()
                out[start_q + i, h] = p @ vs.double()
    return out.to(q.dtype)
