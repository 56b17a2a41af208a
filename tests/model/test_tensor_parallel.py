"""Tensor parallelism on the default model: 2 processes with 1 thread each, gloo over 127.0.0.1.
SmolLM2-135M has 3 KV heads, so TP=2 is the uneven split (2 + 1 heads, 6 + 3 query heads).

TP=2 gives the greedy tokens of TP=1 on 8 prompts and logprobs within 1e-4 (float32 KV cache:
float16 KV rounds the tensor-parallel sums' last bits into visible differences); a killed rank
makes the next step raise RankLost at once, never a hang (with pipeline stages too)."""
import time

import pytest

from kvserve import LLM, SamplingParams
from kvserve.runner.tensor_parallel import RankLost

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "List three colors:",
           "Q: What is 17 * 23?\nA:", "Water boils at", "The quick brown fox", "import numpy as np\n"]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)


def _llm(default_gguf, tp):
    return LLM(default_gguf, quantization="none", tensor_parallel_size=tp, num_threads=1, max_model_len=1024,
               kv_cache_memory="64MiB", kv_cache_dtype="float32")


@pytest.fixture(scope="module")
def tp1_outputs(default_gguf):
    return _llm(default_gguf, 1).generate(PROMPTS, PARAMS, use_tqdm=False)


def test_tp2_gives_the_tokens_and_logprobs_of_tp1(default_gguf, tp1_outputs):
    llm = _llm(default_gguf, 2)
    try:
        assert llm.engine.runner.tp is not None and llm.engine.runner.layer_stack is None
        attn = llm.engine.runner.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (6, 2)          # rank 0's share of 9 / 3
        got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        worst = 0.0
        for a, b in zip(tp1_outputs, got):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, (a.outputs[0].text, b.outputs[0].text)
            for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert [t for t, _, _ in la.top] == [t for t, _, _ in lb.top]
                worst = max([worst] + [abs(x - y) for (_, _, x), (_, _, y) in zip(la.top, lb.top)])
        assert worst < 1e-4, worst
        assert llm.engine.scheduler.num_used_blocks == 0
    finally:
        llm.engine.close()
    assert all(p.poll() is not None for p in llm.engine.runner.tp.workers)   # closed: the ranks exited


@pytest.mark.parametrize("kind", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_a_killed_rank_stops_the_engine_at_once_with_a_clear_error(default_gguf, kind):
    """Tensor and pipeline parallelism share their ranks (runner/ranks.py): either way, a dead
    worker makes the next step raise RankLost naming it."""
    llm = LLM(default_gguf, quantization="none", num_threads=1, max_model_len=1024, kv_cache_memory="64MiB",
              **{kind: 2})
    worker = llm.engine.ranks.workers[0]
    worker.kill()
    worker.wait()
    t0 = time.monotonic()
    with pytest.raises(RankLost, match=r"rank 1 \(pid \d+\) exited with code -9"):
        llm.generate(PROMPTS[:2], PARAMS, use_tqdm=False)
    assert time.monotonic() - t0 < 30
    llm.engine.close()


def test_tensor_parallel_refuses_what_it_cannot_shard(default_gguf):
    with pytest.raises(ValueError, match="more than the model's 3 KV heads"):
        LLM(default_gguf, tensor_parallel_size=4, num_threads=1, kv_cache_memory="32MiB")

