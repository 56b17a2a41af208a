"""paged_attention against the explicit-loop reference on random mixed batches, through both
decode paths: the C kernel (kvserve.ops.cpu_kernels) and the torch SDPA fallback; and the C
kernel itself on prompt rows, on every ISA build the host runs (the same bits on each)."""

import random
import shutil

import pytest
import torch

from kvserve.ops import cpu_kernels
from kvserve.ops.attention import (
    AttentionMetadata,
    causal_mask,
    gather_kv,
    paged_attention,
    paged_attention_ref,
    write_kv,
)


def make_batch(rng: random.Random, chunks, block_size, num_blocks, hq, hkv, d, dtype=torch.float32):
    """chunks: [(context_before, q_len)]. Fills the pool with each request's past context
    (in shuffled, ragged block tables), writes the new tokens with write_kv, returns everything."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g, dtype=dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, slots, seq_lens, qsl = [], [], [], [0]
    for before, q_len in chunks:
        seq_len = before + q_len
        n = (seq_len + block_size - 1) // block_size
        table = [free.pop() for _ in range(n)]
        tables.append(table)
        slots += [
            table[p // block_size] * block_size + p % block_size for p in range(before, seq_len)
        ]
        seq_lens.append(seq_len)
        qsl.append(qsl[-1] + q_len)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    T = qsl[-1]
    q = torch.randn(T, hq, d, generator=g, dtype=dtype)
    k = torch.randn(T, hkv, d, generator=g, dtype=dtype)
    v = torch.randn(T, hkv, d, generator=g, dtype=dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_tables=block_tables,
        block_size=block_size,
    )
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return q, k, v, k_cache, v_cache, meta


@pytest.fixture(autouse=True, params=["c-kernel", "torch"])
def decode_path(request, monkeypatch):
    """Every test runs once with the C decode kernel and once with it turned off."""
    monkeypatch.setenv("KVSERVE_NO_C_KERNELS", "0" if request.param == "c-kernel" else "1")
    cpu_kernels._load.cache_clear()
    yield request.param
    cpu_kernels._load.cache_clear()


@pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)
def test_c_kernel_builds_where_a_compiler_exists(decode_path):
    assert cpu_kernels.available() == (decode_path == "c-kernel")


def test_write_kv_places_tokens_at_their_slots():
    rng = random.Random(0)
    q, k, v, kc, vc, meta = make_batch(rng, [(3, 5), (0, 2)], 4, 8, 4, 2, 8)
    for t, slot in enumerate(meta.slot_mapping.tolist()):
        assert torch.equal(kc[slot // 4, slot % 4], k[t])
        assert torch.equal(vc[slot // 4, slot % 4], v[t])
    # gather_kv returns the context in position order through the block table
    ctx = gather_kv(kc, meta.block_tables[0], meta.seq_lens[0])
    assert torch.equal(ctx[3:8], k[0:5])


def test_causal_mask():
    m = causal_mask(2, 5)
    assert m.tolist() == [[True, True, True, True, False], [True] * 5]
    m = causal_mask(3, 3, sliding_window=2)
    assert m.tolist() == [[True, False, False], [True, True, False], [False, True, True]]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1)])
def test_paged_matches_reference_on_mixed_batches(seed, hq, hkv):
    rng = random.Random(seed * 31 + hq)
    block_size = rng.choice([1, 4, 16])
    chunks = []
    for _ in range(rng.randint(1, 6)):
        kind = rng.choice(["prefill", "chunk", "decode", "decode"])
        if kind == "prefill":
            chunks.append((0, rng.randint(1, 40)))
        elif kind == "chunk":
            chunks.append((rng.randint(1, 40), rng.randint(2, 20)))
        else:
            chunks.append((rng.randint(0, 60), 1))
    num_blocks = sum((a + b) // block_size + 1 for a, b in chunks) + 5
    q, _, _, kc, vc, meta = make_batch(rng, chunks, block_size, num_blocks, hq, hkv, 16)
    scale = 16**-0.5
    got = paged_attention(q, kc, vc, meta, scale)
    want = paged_attention_ref(q, kc, vc, meta, scale)
    assert got.shape == q.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_paged_sliding_window(seed):
    rng = random.Random(100 + seed)
    chunks = [(0, 30), (25, 7), (40, 1), (3, 1), (0, 1)]
    q, _, _, kc, vc, meta = make_batch(rng, chunks, 4, 64, 4, 2, 8)
    for window in (1, 5, 16, 100):
        got = paged_attention(q, kc, vc, meta, 0.3, sliding_window=window)
        want = paged_attention_ref(q, kc, vc, meta, 0.3, sliding_window=window)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_sliding_window_never_reads_freed_table_entries(kv):
    """A window KV group frees the blocks before a chunk's first visible key and names a null
    block there (core/kv_cache.py): pointing those entries at a poisoned block (large finite
    values, as any written KV is finite) must not change the output."""
    rng = random.Random(7)
    chunks = [(0, 30), (25, 7), (40, 1), (13, 1), (0, 1), (17, 9)]
    q, _, _, kc, vc, meta = make_batch(rng, chunks, 4, 64, 4, 2, 8)
    if kv == "int8":
        kc, vc = _int8_pools(kc, vc)
    for window in (1, 5, 8):
        want = paged_attention(q, kc, vc, meta, 0.3, sliding_window=window)
        poison = 63  # a block no table uses (make_batch leaves spares)
        assert poison not in meta.block_tables.tolist()
        kp, vp = kc.clone(), vc.clone()
        kp[poison], vp[poison] = (
            (30, 30) if kv == "float32" else (kp[poison] * 0 + 100, vp[poison] * 0 + 100)
        )
        tables = meta.block_tables.clone()
        for b in range(meta.num_seqs):
            first_query = meta.seq_lens[b] - (meta.query_start_loc[b + 1] - meta.query_start_loc[b])
            tables[b, : max(0, first_query - window + 1) // 4] = poison
        freed = AttentionMetadata(meta.slot_mapping, meta.query_start_loc, meta.seq_lens, tables, 4)
        assert not torch.equal(tables, meta.block_tables)
        got = paged_attention(q, kp, vp, freed, 0.3, sliding_window=window)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_for_layer_hands_each_layer_its_groups_metadata():
    rng = random.Random(3)
    *_, full = make_batch(rng, [(4, 2)], 4, 8, 2, 1, 8)
    *_, window = make_batch(rng, [(4, 2)], 4, 8, 2, 1, 8)
    assert full.for_layer(5) is full  # one group: the step's metadata itself
    full.layers = [window, full, window]
    assert [full.for_layer(i) for i in range(3)] == [window, full, window]


def test_chunked_equals_whole_prefill():
    """The same prompt run whole, or as two chunks plus a decode, gives the same outputs."""
    hq, hkv, d, bs = 4, 2, 8, 4
    g = torch.Generator().manual_seed(1)
    n = 13
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (hq, hkv, hkv))
    table = torch.tensor([[5, 2, 7, 0]])
    slots = torch.tensor([table[0, p // bs].item() * bs + p % bs for p in range(n)])

    def run(spans):
        kc = torch.zeros(8, bs, hkv, d)
        vc = torch.zeros(8, bs, hkv, d)
        outs = []
        for a, b in spans:
            meta = AttentionMetadata(slots[a:b], [0, b - a], [b], table, bs)
            write_kv(k[a:b], v[a:b], kc, vc, meta.slot_mapping)
            outs.append(paged_attention(q[a:b], kc, vc, meta, 0.5))
        return torch.cat(outs)

    whole = run([(0, n)])
    torch.testing.assert_close(run([(0, 5), (5, 12), (12, 13)]), whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(run([(i, i + 1) for i in range(n)]), whole, atol=1e-6, rtol=1e-6)


def test_bf16_cache_with_fp32_queries():
    rng = random.Random(3)
    q, _, _, kc, vc, meta = make_batch(rng, [(5, 3), (9, 1)], 4, 16, 4, 2, 8)
    kc16, vc16 = kc.to(torch.bfloat16), vc.to(torch.bfloat16)
    got = paged_attention(q, kc16, vc16, meta, 0.35)
    want = paged_attention_ref(q, kc16.float(), vc16.float(), meta, 0.35)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_unusable_cache_dir_falls_back_to_torch(monkeypatch, tmp_path, decode_path):
    """A cache directory that cannot be created must not break attention: torch path instead."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(blocker / "sub"))
    cpu_kernels._load.cache_clear()
    assert not cpu_kernels.available()
    rng = random.Random(3)
    q, _, _, kc, vc, meta = make_batch(rng, [(20, 1), (0, 5)], 4, 20, 4, 2, 16)
    torch.testing.assert_close(
        paged_attention(q, kc, vc, meta, 0.25),
        paged_attention_ref(q, kc, vc, meta, 0.25),
        atol=1e-5,
        rtol=1e-5,
    )


def test_model_layout_queries_take_the_c_kernel(monkeypatch, decode_path):
    """The model hands q over as a split view of the fused qkv output (not contiguous): decodes must
    still run in the C kernel when it is available, and match the reference."""
    if decode_path != "c-kernel" or not cpu_kernels.available():
        pytest.skip("C kernel turned off or not buildable here")
    calls = []
    real = cpu_kernels.paged_attention
    monkeypatch.setattr(
        cpu_kernels, "paged_attention", lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    )
    rng = random.Random(11)
    q, k, _, kc, vc, meta = make_batch(rng, [(30, 1), (7, 1), (0, 6)], 4, 40, 6, 2, 16)
    qk = torch.cat((q, k), dim=1)  # [T, Hq + Hkv, D], like the model
    q_view = qk.split([6, 2], dim=1)[0]
    assert not q_view.is_contiguous()
    torch.testing.assert_close(
        paged_attention(q_view, kc, vc, meta, 0.25),
        paged_attention_ref(q, kc, vc, meta, 0.25),
        atol=1e-5,
        rtol=1e-5,
    )
    assert calls, "decodes did not take the C kernel"


def _int8_pools(kc, vc):
    from kvserve.ops import kv_int8

    return kv_int8.quantize(kc), kv_int8.quantize(vc)


def test_int8_rows_round_trip_within_half_a_step():
    from kvserve.ops import kv_int8

    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.rand(50, 3, 1, generator=g) * 10
    x[4, 1] = 0.0  # an all-zero row keeps scale 0, values 0
    rows = kv_int8.quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 68)
    back = kv_int8.dequantize(rows)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((back - x).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(back[4, 1], torch.zeros(64))


@pytest.mark.parametrize("seed", range(4))
def test_int8_cache_matches_reference_on_mixed_batches(seed, decode_path):
    """An int8 pool (kv_int8 rows): prompt chunks and decodes (C kernel or torch) equal the
    reference attention over the dequantized pool; write_kv quantizes what it stores."""
    rng = random.Random(500 + seed)
    chunks = [
        (rng.randint(0, 40), 1),
        (0, rng.randint(2, 20)),
        (rng.randint(1, 30), 5),
        (rng.randint(0, 50), 1),
    ]
    q, k, v, kc, vc, meta = make_batch(rng, chunks, 4, 60, 6, 2, 16)
    kc8, vc8 = _int8_pools(kc, vc)
    write_kv(k, v, kc8, vc8, meta.slot_mapping)  # the new tokens go in quantized
    got = paged_attention(q, kc8, vc8, meta, 0.25, sliding_window=None if seed % 2 else 9)
    want = paged_attention_ref(q, kc8, vc8, meta, 0.25, sliding_window=None if seed % 2 else 9)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # and it is close to float attention: int8 rows are within half a step of the floats
    exact = paged_attention_ref(q, kc, vc, meta, 0.25, sliding_window=None if seed % 2 else 9)
    assert (got - exact).abs().max().item() < 0.05


# ------------------------------------------------------------ the C kernel on prompt rows, per ISA

HOST_ISAS = cpu_kernels.host_isas()
needs_cc = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)


@pytest.fixture
def use_isa(monkeypatch, decode_path):
    """use_isa(name): the C kernels of that build from now on (KVSERVE_ISA, fresh load)."""
    if decode_path != "c-kernel":
        pytest.skip("C kernel checks run in the c-kernel pass")

    def use(isa):
        monkeypatch.setenv("KVSERVE_ISA", isa)
        cpu_kernels._load.cache_clear()
        if not cpu_kernels.available():
            pytest.skip("C kernels unavailable")
        assert cpu_kernels.library().gguf_gemv_isa().decode() == isa

    yield use
    cpu_kernels._load.cache_clear()


def token_rows(meta, seed=0):
    """One kernel row per token of the batch (prompt tokens and decodes alike), in shuffled order
    (seed None: in order):
    qrow (its row in q), qseq (its sequence's table row), lens (its position + 1)."""
    rows = []
    for b, seq_len in enumerate(meta.seq_lens):
        q0, q1 = meta.query_start_loc[b], meta.query_start_loc[b + 1]
        start = seq_len - (q1 - q0)
        rows += [(q0 + i, b, start + i + 1) for i in range(q1 - q0)]
    if seed is not None:  # None: in order, each sequence's rows one after the other
        random.Random(seed).shuffle(rows)
    return tuple(torch.tensor(col, dtype=torch.long) for col in zip(*rows))


def run_kernel(q, kc, vc, meta, rows, scale, window):
    qrow, qseq, lens = rows
    out = torch.full_like(q, float("nan"))
    cpu_kernels.paged_attention(
        q.contiguous(),
        kc,
        vc,
        out,
        qrow,
        meta.block_tables.contiguous(),
        lens,
        scale,
        window,
        qseq=qseq,
    )
    return out


PROMPT_CHUNKS = [(0, 9), (12, 6), (30, 1), (5, 1), (0, 1)]


def _pools(kv, kc, vc):
    """The float32 test pools as a pool of dtype `kv` (int8: kv_int8 rows)."""
    if kv == "int8":
        return _int8_pools(kc, vc)
    return (kc.half(), vc.half()) if kv == "float16" else (kc, vc)


@needs_cc
@pytest.mark.parametrize("kv", ["float32", "int8", "float16"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("hq,hkv,d", [(6, 2, 20), (4, 4, 16), (8, 1, 8), (6, 2, 64), (4, 1, 128)])
def test_c_kernel_prompt_rows_match_reference(use_isa, kv, window, hq, hkv, d):
    """Rows that are prompt tokens (several per sequence, sharing its table row through qseq, each
    with lens = its position + 1) equal the reference attention of those tokens, on every ISA."""
    rng = random.Random(hq * 7 + d)
    q, k, v, kc, vc, meta = make_batch(rng, PROMPT_CHUNKS, 4, 40, hq, hkv, d)
    if kv != "float32":
        kc, vc = _pools(kv, kc, vc)
        write_kv(k, v, kc, vc, meta.slot_mapping)
    rows = token_rows(meta)
    want = paged_attention_ref(q, kc, vc, meta, 0.3, sliding_window=window)
    for isa in HOST_ISAS:
        use_isa(isa)
        got = run_kernel(q, kc, vc, meta, rows, 0.3, window)
        assert not got.isnan().any(), isa  # every token's row was written
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{isa}: {m}")


@needs_cc
@pytest.mark.parametrize("kv", ["float32", "int8", "float16"])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("d", [20, 64])
@pytest.mark.parametrize("group", [3, 2])
@pytest.mark.parametrize("block_size", [4, 16])
def test_c_kernel_bits_do_not_depend_on_batch_threads_or_isa(
    use_isa, threads, kv, window, d, group, block_size
):
    """A token's output is bitwise the same in a batch or alone, with 1 or 2 threads, on every
    ISA build the host runs (d = 64: the kernel's head size with the query in registers; groups
    of 3 and 2 query heads per KV head: the joint passes over V; blocks of 16: the x86 builds
    score 8 keys of a block at once, the portable build one by one)."""
    rng = random.Random(21)
    chunks = PROMPT_CHUNKS + [(3, 4)] + ([(40, 3)] if block_size == 16 else [])
    q, k, v, kc, vc, meta = make_batch(rng, chunks, block_size, 192 // block_size, 2 * group, 2, d)
    if kv != "float32":
        kc, vc = _pools(kv, kc, vc)
        write_kv(k, v, kc, vc, meta.slot_mapping)
    assert_same_bits_everywhere(use_isa, threads, q, kc, vc, meta, token_rows(meta, seed=5), window)


def assert_same_bits_everywhere(
    use_isa, threads, q, kc, vc, meta, rows, window, alone=None, alone_threads=(2,)
):
    """Each row's output is bitwise the same in the batch `rows` and in a call of its own, with 1
    or 2 threads, on every ISA build the host runs. alone: the index sets of `rows` that go as
    calls of their own (default: every row by itself), each with every count of alone_threads."""
    if alone is None:
        alone = [torch.tensor([i]) for i in range(len(rows[0]))]
    per_isa = {}
    for isa in HOST_ISAS:
        use_isa(isa)
        threads(2)
        batch = run_kernel(q, kc, vc, meta, rows, 0.25, window)
        assert not batch[rows[0]].isnan().any(), isa  # every row was written
        threads(1)
        assert torch.equal(run_kernel(q, kc, vc, meta, rows, 0.25, window), batch), isa
        for i, sel in enumerate(alone):
            call = tuple(c[sel] for c in rows)
            for n in alone_threads:
                threads(n)
                got = run_kernel(q, kc, vc, meta, call, 0.25, window)
                assert torch.equal(got[call[0]], batch[call[0]]), (isa, i, n)
        threads(2)
        per_isa[isa] = batch
    for isa, out in per_isa.items():
        assert torch.equal(out, per_isa["portable"]), isa


RUN_CHUNKS = [(20, 9), (0, 12), (33, 5), (7, 1), (50, 2), (0, 1), (3, 17)]


@needs_cc
@pytest.mark.parametrize("kv", ["float32", "int8", "float16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 3, 4])
@pytest.mark.parametrize("block_size", [4, 16])
def test_c_kernel_rows_of_one_sequence_keep_their_bits(use_isa, threads, kv, d, group, block_size):
    """Rows of one sequence at consecutive positions, in order (a verification's rows, a prompt
    chunk's tokens), go through the kernel as runs that read each K/V row once for all of them:
    every row's output is bitwise the one it gets alone, with 1 or 2 threads, on every ISA build."""
    rng = random.Random(d * 10 + group)
    q, k, v, kc, vc, meta = make_batch(
        rng, RUN_CHUNKS, block_size, 360 // block_size, 2 * group, 2, d
    )
    if kv != "float32":
        kc, vc = _pools(kv, kc, vc)
        write_kv(k, v, kc, vc, meta.slot_mapping)
    assert_same_bits_everywhere(
        use_isa, threads, q, kc, vc, meta, token_rows(meta, seed=None), None
    )


@needs_cc
@pytest.mark.parametrize("kv", ["float32", "int8", "float16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [4, 16])
def test_c_kernel_one_sequence_alone_keeps_its_bits(use_isa, threads, kv, d, group, block_size):
    """A call of one sequence's rows alone (a batch-1 decode, a verification, a prompt chunk: its
    rows cut into runs for the threads) gives each row the bits it gets inside a batch of many
    sequences, with 1 or 2 threads, on every ISA build."""
    rng = random.Random(d * 10 + group + 1)
    q, k, v, kc, vc, meta = make_batch(
        rng, RUN_CHUNKS, block_size, 360 // block_size, 2 * group, 2, d
    )
    if kv != "float32":
        kc, vc = _pools(kv, kc, vc)
        write_kv(k, v, kc, vc, meta.slot_mapping)
    rows = token_rows(meta, seed=None)
    sequences = [(rows[1] == b).nonzero().squeeze(1) for b in range(len(meta.seq_lens))]
    assert_same_bits_everywhere(
        use_isa, threads, q, kc, vc, meta, rows, None, alone=sequences, alone_threads=(2, 1)
    )
