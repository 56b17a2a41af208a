"""Prefix caching and n > 1 block sharing on the real default model.

Reusing cached KV blocks (and forking a prompt's blocks for n samples, with copy-on-write)
must never change what the model generates. A chunk's attention reads its whole context from the
KV pool (this step's keys and values are written first), so a hit and a miss attend over the same
values. On the C layer stack (the default GGUF format, and --quantization none, whose float32
weights it runs through its float32 GEMM) every token's numbers are computed on their own: hit or
miss, the tokens and logprobs are the same bits.
"""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.model.quant.gguf import FLOAT_ACTS

SYSTEM = (
    "You are a careful assistant for a library of Python documentation. Answer briefly, "
    "cite the module name, and never invent functions that do not exist. "
) * 6
QUESTIONS = [
    "What does os.path.join do?",
    "How do I read a file line by line?",
    "What is a dataclass?",
    "Explain list comprehensions.",
    "What does zip() return?",
    "How do I sort a dict by value?",
]


def _prompts():
    return [SYSTEM + "\nQuestion: " + q + "\nAnswer:" for q in QUESTIONS]


@pytest.fixture(scope="module")
def cached():
    return LLM(kv_cache_memory="128MiB", enable_prefix_caching=True)


@pytest.fixture(scope="module")
def uncached():
    return LLM(kv_cache_memory="128MiB", enable_prefix_caching=False)


def _texts(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _logprobs(outs):
    return [[[lp.top for lp in c.logprobs] for c in o.outputs] for o in outs]


def _assert_idle(llm: LLM) -> None:
    s = llm.engine.scheduler
    assert s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0.0


def test_greedy_same_with_and_without_prefix_cache(cached, uncached):
    """The default format (C layer stack): hits give the tokens and logprobs of misses, bit for
    bit."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    prompts = _prompts()
    ref_outs = uncached.generate(prompts, params, use_tqdm=False)
    ref, ref_lp = _texts(ref_outs), _logprobs(ref_outs)
    hits_before = cached.engine.scheduler.stats.prefix_cache_hits
    # One batch: requests sharing the system prompt hit each other's blocks once computed.
    one_batch = cached.generate(prompts, params, use_tqdm=False)
    assert _texts(one_batch) == ref and _logprobs(one_batch) == ref_lp
    # Across batches: the second run finds every full block of every prompt in the cache.
    again = cached.generate(prompts, params, use_tqdm=False)
    assert _texts(again) == ref and _logprobs(again) == ref_lp
    n_prompt = len(cached.tokenizer.encode(prompts[0], add_special_tokens=True))
    for o in again:
        assert o.num_cached_tokens >= (n_prompt - 16) // 16 * 16 - 16, o.num_cached_tokens
        assert o.num_cached_tokens < len(o.prompt_token_ids), (
            "the last prompt token is always recomputed"
        )
    assert cached.engine.scheduler.stats.prefix_cache_hits > hits_before
    assert all(
        o.num_cached_tokens == 0 for o in uncached.generate(prompts[:2], params, use_tqdm=False)
    )
    _assert_idle(cached)
    _assert_idle(uncached)


def test_n4_seeded_sampling_same_with_and_without_cache(cached, uncached):
    params = SamplingParams(
        n=4, temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True
    )
    prompts = _prompts()[:2]
    a = uncached.generate(prompts, params, use_tqdm=False)
    b = cached.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs) for o in a] == [4, 4]
    assert _texts(a) == _texts(b)
    samples = {tuple(t) for t in _texts(a)[0]}
    assert len(samples) > 1, "4 seeded samples at temperature 0.9 should not all be equal"
    _assert_idle(cached)
    _assert_idle(uncached)


def test_n4_greedy_forks_match_single(cached):
    """n greedy samples share the prompt's blocks (fork + copy-on-write) and equal n=1 greedy."""
    prompt = QUESTIONS[2] * 3  # a prompt whose last block is partially filled
    single = (
        cached.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    many = cached.generate(
        [prompt], SamplingParams(n=4, temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )[0]
    assert [c.index for c in many.outputs] == [0, 1, 2, 3]
    assert all(c.token_ids == single for c in many.outputs)
    _assert_idle(cached)


def test_int8_kv_cache_engine_prefix_hits_and_forks():
    """The whole engine on an int8 KV pool: rows of int8 + scale, 12,240 bytes a token; prefix-cache
    hits and n > 1 forks (copy-on-write copies int8 blocks) give what recomputing gives, and every
    block is free at the end."""
    import torch

    llm = LLM(kv_cache_memory="64MiB", kv_cache_dtype="int8", enable_prefix_caching=True)
    assert llm.engine.kv_shape.bytes_per_token == 2 * 30 * 3 * (64 + 4)
    k = llm.engine.runner.kv_caches[0][0]
    assert k.dtype == torch.int8 and k.shape[-1] == 64 + 4
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = _prompts()[:3]
    first = _texts(llm.generate(prompts, params, use_tqdm=False))
    again = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in again)
    assert _texts(again) == first
    forks = llm.generate(
        prompts[:1],
        SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [c.token_ids for c in forks.outputs] == [first[0][0]] * 3
    _assert_idle(llm)


def test_float_weights_prefix_hits_chunks_and_company():
    """--quantization none (float32 weights on the C stack's float32 GEMM): each prompt alone in
    one chunk without the cache against all of them together in 32-token chunks with the cache
    (later prompts hit the system prompt's blocks; a second run hits every full block): the same
    tokens and logprobs, bit for bit."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    prompts = _prompts()[:3]
    common = dict(quantization="none", kv_cache_memory="64MiB", max_model_len=1024, num_threads=1)
    miss = LLM(enable_prefix_caching=False, **common)
    assert miss.engine.runner.layer_stack.parts == FLOAT_ACTS
    ref = [miss.generate([p], params, use_tqdm=False)[0] for p in prompts]
    del miss
    hit = LLM(enable_prefix_caching=True, max_num_batched_tokens=32, **common)
    first = hit.generate(prompts, params, use_tqdm=False)
    again = hit.generate(prompts, params, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in first[1:]) and all(
        o.num_cached_tokens > 0 for o in again
    )
    want = (_texts(ref), _logprobs(ref))
    assert (_texts(first), _logprobs(first)) == want
    assert (_texts(again), _logprobs(again)) == want
    _assert_idle(hit)
