"""Our model through a real paged KV pool against HF transformers on the same GGUF."""

import inspect
import random

import pytest
import torch

from kvserve.ops.attention import AttentionMetadata

BLOCK = 16

PROMPTS = {
    "english": "The capital of France is",
    "korean": "대한민국의 수도는 서울입니다. 서울은 한강을 따라 펼쳐진 큰 도시이며, "
    "많은 사람들이 살고 있습니다. 오늘 날씨는",
    "code": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
    "    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\nclass Stack:\n    def __init__(self):\n"
    "        self.items = []\n\n    def push(self, item):\n        self.items.append(item)\n\n"
    "    def pop(self):\n",
    "long": " ".join(
        f"Chapter {i}. The river keeps running past the old mill, "
        f"and the miller counts {i * 7} sacks of flour "
        f"before the sun goes down; "
        f"the children of the village watch the water wheel turn and turn."
        for i in range(1, 12)
    )
    + " In the end, the miller",
}


class PagedPool:
    """A real KV pool for every layer and a shuffled free list: each request gets a ragged,
    non-contiguous block table, as the scheduler would hand out."""

    def __init__(self, arch, num_blocks=160, seed=0):
        shape = (num_blocks, BLOCK, arch.num_kv_heads, arch.head_dim)
        self.kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(arch.num_layers)]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}

    def slots(self, rid, start, n):
        table = self.tables.setdefault(rid, [])
        while len(table) * BLOCK < start + n:
            table.append(self.free.pop())
        return [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)]


def step(lm, pool, chunks):
    """chunks: [(rid, token_ids, start_pos)] -> logits [len(chunks), V] at each chunk's last
    token."""
    ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
    for rid, toks, start in chunks:
        ids += toks
        pos += range(start, start + len(toks))
        slots += pool.slots(rid, start, len(toks))
        qsl.append(qsl[-1] + len(toks))
        seq_lens.append(start + len(toks))
    width = max(len(pool.tables[rid]) for rid, _, _ in chunks)
    tables = torch.tensor(
        [pool.tables[rid] + [0] * (width - len(pool.tables[rid])) for rid, _, _ in chunks]
    )
    meta = AttentionMetadata(torch.tensor(slots), qsl, seq_lens, tables, BLOCK)
    hidden = lm.model(torch.tensor(ids), torch.tensor(pos), meta, pool.kv)
    return lm.model.compute_logits(hidden[[q - 1 for q in qsl[1:]]])


@torch.no_grad()
def hf_greedy(hf_model, ids, n):
    """HF's last-position logits of the prompt and its greedy next n tokens (HF's own KV cache)."""
    out = hf_model(torch.tensor([ids]), use_cache=True)
    first = out.logits[0, -1]
    tokens = [int(first.argmax())]
    for _ in range(n - 1):
        out = hf_model(
            torch.tensor([tokens[-1:]]), **hf_cache_kwargs(hf_model, out), use_cache=True
        )
        tokens.append(int(out.logits[0, -1].argmax()))
    return first, tokens


def hf_cache_kwargs(hf_model, out) -> dict:
    """The KV cache of `out` as the next forward's argument: `cache` where transformers names it
    so (5.x, which drops `past_key_values` in 5.40), else `past_key_values`."""
    if "cache" in inspect.signature(hf_model.forward).parameters:
        return {"cache": out.cache}
    return {"past_key_values": out.past_key_values}


def assert_logits_close(ours, ref):
    scale = ref.abs().max().item()
    assert (ours - ref).abs().max().item() < 1e-3 * scale
    assert int(ours.argmax()) == int(ref.argmax())


@pytest.fixture(scope="module")
def references(kv_model, hf_model):
    refs = {}
    for name, text in PROMPTS.items():
        ids = kv_model.tokenizer.encode(text)
        refs[name] = (ids, *hf_greedy(hf_model, ids, 8))
    return refs


def test_prompt_lengths_cover_5_to_500(references):
    lengths = sorted(len(ids) for ids, _, _ in references.values())
    assert lengths[0] >= 5 and 400 <= lengths[-1] <= 520, lengths


@pytest.mark.parametrize("name", list(PROMPTS))
def test_whole_prefill_then_decode_matches_hf(kv_model, references, name):
    ids, ref_logits, ref_tokens = references[name]
    pool = PagedPool(kv_model.arch, seed=len(ids))
    logits = step(kv_model, pool, [(0, ids, 0)])[0]
    assert_logits_close(logits, ref_logits)
    tokens = [int(logits.argmax())]
    for _ in range(7):
        logits = step(kv_model, pool, [(0, tokens[-1:], len(ids) + len(tokens) - 1)])[0]
        tokens.append(int(logits.argmax()))
    assert tokens == ref_tokens


def test_chunked_prefill_matches_whole(kv_model, references):
    ids, ref_logits, _ = references["code"]
    pool = PagedPool(kv_model.arch, seed=1)
    for start in range(0, len(ids), 23):
        logits = step(kv_model, pool, [(0, ids[start : start + 23], start)])[0]
    assert_logits_close(logits, ref_logits)


def test_mixed_batch_of_all_prompts_matches_hf(kv_model, references):
    """Every prompt prefilled in one flat batch, then decoded together; one request joins late
    as a prefill chunk alongside the others' decodes."""
    names = list(PROMPTS)
    pool = PagedPool(kv_model.arch, seed=2)
    late = names[-1]
    first = [(i, references[n][0], 0) for i, n in enumerate(names) if n != late]
    logits = step(kv_model, pool, first)
    tokens = {i: [int(row.argmax())] for (i, _, _), row in zip(first, logits)}
    for (i, _, _), row in zip(first, logits):
        assert_logits_close(row, references[names[i]][1])
    for k in range(7):
        chunks = [
            (i, tokens[i][-1:], len(references[names[i]][0]) + len(tokens[i]) - 1) for i in tokens
        ]
        if k == 2:
            chunks.insert(1, (names.index(late), references[late][0], 0))
        logits = step(kv_model, pool, chunks)
        for (i, _, _), row in zip(chunks, logits):
            tokens.setdefault(i, []).append(int(row.argmax()))
    for i, n in enumerate(names):
        want = references[n][2]
        assert tokens[i] == want[: len(tokens[i])], n


def test_bfloat16_weights_and_cache(references):
    """dtype=bfloat16 loads and runs (RMSNorm in fp32, bf16 pool); greedy top-1 mostly agrees."""
    from kvserve.config import ModelConfig
    from kvserve.model.loader import load_model

    lm = load_model(ModelConfig(dtype="bfloat16"))
    assert lm.model.embed_tokens(torch.tensor([1, 2])).dtype == torch.bfloat16
    ids, ref_logits, _ = references["english"]
    pool = PagedPool(lm.arch, num_blocks=4)
    pool.kv = [(k.bfloat16(), v.bfloat16()) for k, v in pool.kv]
    logits = step(lm, pool, [(0, ids, 0)])[0]
    assert logits.dtype == torch.float32
    assert int(logits.argmax()) == int(ref_logits.argmax())
    assert torch.nn.functional.cosine_similarity(logits, ref_logits, dim=0) > 0.99


# ---- GGUF reading ----


def test_gguf_header_matches_gguf_reader(default_gguf):
    import numpy as np
    from gguf import GGUFReader

    from kvserve.model.gguf_file import GGUFFile

    ours, ref = GGUFFile(default_gguf), GGUFReader(default_gguf)
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            want = field.contents()
            assert ours.metadata[key] == (
                pytest.approx(want) if isinstance(want, float) else want
            ), key
    assert len(ours.tensors) == len(ref.tensors)
    for t in ref.tensors[:40]:
        mine = ours.tensors[t.name]
        assert (mine.qtype, mine.offset, mine.shape) == (
            t.tensor_type,
            t.data_offset,
            tuple(reversed(t.shape.tolist())),
        )
        assert np.array_equal(
            ours.raw(mine).view(np.uint8).ravel(), np.asarray(t.data).view(np.uint8).ravel()
        )


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q5_0"])
def test_dequantize_matches_gguf_quants(qtype):
    import numpy as np
    from gguf import quants
    from gguf.constants import GGMLQuantizationType

    from kvserve.model.gguf_loader import dequantize_rows

    qt = GGMLQuantizationType[qtype]
    x = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    packed = x if qt == GGMLQuantizationType.F32 else quants.quantize(x, qt)
    raw = np.ascontiguousarray(packed).view(np.uint8)
    want = quants.dequantize(raw, qt)
    got = dequantize_rows(raw.copy(), qt)
    assert got.shape == (6, 96) and got.dtype == torch.float32
    assert np.array_equal(got.numpy(), want)


def test_unpermute_undoes_llama_cpp_permute():
    from kvserve.model.gguf_loader import unpermute_rows

    n_heads, head_dim = 3, 8
    w = torch.arange(n_heads * head_dim * 2, dtype=torch.float32).view(n_heads * head_dim, 2)
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    permuted = w.reshape(n_heads, 2, head_dim // 2, 2).swapaxes(1, 2).reshape(w.shape)
    assert torch.equal(permuted[torch.from_numpy(unpermute_rows(n_heads * head_dim, n_heads))], w)
