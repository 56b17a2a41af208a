"""Prompt logprobs (SamplingParams.prompt_logprobs) on the real model against Hugging Face
transformers: every prompt token's logprob within 1e-4 (fp32 weights), also when the prompt is
split into chunks across steps, never skipped by the prefix cache, with max_tokens=0 (scoring
only, as lm-evaluation-harness asks) and with n > 1."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams

TEXT = (
    "The paged KV cache stores keys and values in fixed blocks of sixteen tokens, and a block "
    "table maps each request's positions to physical blocks. "
) * 6 + "In short, paging"


@pytest.fixture(scope="module")
def dense(default_gguf):
    # fp32 weights (the GGUF dequantized once) and fp32 KV, a token budget of 64: the prompt runs in
    # chunks
    return LLM(
        default_gguf,
        quantization="none",
        num_threads=1,
        kv_cache_memory="64MiB",
        max_model_len=512,
        max_num_batched_tokens=64,
        kv_cache_dtype="float32",
    )


@pytest.fixture(scope="module")
def reference(dense, hf_model):
    ids = dense.tokenizer.encode(TEXT)
    with torch.no_grad():
        lp = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return ids, lp


def check_against_hf(plp, ids, ref_lp, num_top: int, atol: float) -> None:
    assert len(plp) == len(ids) and plp[0] is None
    for pos in range(1, len(ids)):
        entry, ref = plp[pos], ref_lp[pos - 1]
        assert entry.token_id == ids[pos]
        assert abs(entry.logprob - ref[ids[pos]].item()) <= atol, (
            pos,
            entry.logprob,
            ref[ids[pos]].item(),
        )
        assert (
            entry.rank == int((ref > ref[ids[pos]]).sum()) + 1
            or abs(entry.logprob - ref.max().item()) < 1e-3
        )
        top_ref = ref.topk(num_top)
        assert len(entry.top) == num_top
        for (tid, _, value), ref_value in zip(entry.top, top_ref.values.tolist()):
            assert abs(value - ref_value) <= atol
            assert abs(ref[tid].item() - value) <= atol


def test_prompt_logprobs_match_hf_with_chunked_prefill(dense, reference):
    ids, ref_lp = reference
    assert len(ids) > 2 * 64  # at least three chunks
    out = dense.generate(
        [{"prompt_token_ids": ids}],
        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=5),
        use_tqdm=False,
    )[0]
    check_against_hf(out.prompt_logprobs, ids, ref_lp, 5, atol=1e-4)


def test_the_prefix_cache_never_skips_asked_positions(dense, reference):
    ids, ref_lp = reference
    plain = SamplingParams(max_tokens=1, temperature=0)
    dense.generate([{"prompt_token_ids": ids}], plain, use_tqdm=False)  # fills the cache
    hit = dense.generate([{"prompt_token_ids": ids}], plain, use_tqdm=False)[0]
    assert hit.num_cached_tokens > 0
    out = dense.generate(
        [{"prompt_token_ids": ids}],
        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
        use_tqdm=False,
    )[0]
    assert out.num_cached_tokens == 0
    check_against_hf(out.prompt_logprobs, ids, ref_lp, 0, atol=1e-4)


def test_max_tokens_zero_scores_the_prompt_only(dense, reference):
    ids, ref_lp = reference
    out = dense.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False
    )[0]
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    check_against_hf(out.prompt_logprobs, ids, ref_lp, 1, atol=1e-4)
    assert dense.engine.scheduler.num_used_blocks == 0
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(max_tokens=0)


def test_n_samples_share_one_prompt_logprobs(dense, reference):
    ids, ref_lp = reference
    out = dense.generate(
        [{"prompt_token_ids": ids[:40]}],
        SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=7, prompt_logprobs=2),
        use_tqdm=False,
    )[0]
    assert len(out.outputs) == 3 and all(len(o.token_ids) == 4 for o in out.outputs)
    check_against_hf(out.prompt_logprobs, ids[:40], ref_lp, 2, atol=1e-4)


def test_the_c_kernels_give_prompt_logprobs_inside_the_quality_bound(default_gguf, reference):
    ids, ref_lp = reference
    llm = LLM(
        default_gguf,
        num_threads=1,
        kv_cache_memory="64MiB",
        max_model_len=512,
        max_num_batched_tokens=64,
    )
    out = llm.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False
    )[0]
    ours = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    ref = ref_lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    # the packed GGUF weights against their fp32 dequantization: perplexity within 1%
    # (eval-quality's bound)
    assert abs(ours.mean().item() - ref.mean().item()) <= 0.01
