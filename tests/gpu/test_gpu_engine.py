"""The engine on a CUDA device against Hugging Face transformers on the same GPU, and the GPU
path's own parts: CUDA graphs replaying what eager steps compute, the fp8 KV cache staying close
to bfloat16's, the KV cache sized from --gpu-memory-utilization. Skipped without CUDA."""

from __future__ import annotations

import gc
import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip(
        "no CUDA device: the GPU engine tests run on a machine with one (CI has none)",
        allow_module_level=True,
    )
pytest.importorskip(
    "triton", reason="the GPU path's kernels are Triton kernels: pip install triton"
)

from kvserve import LLM, SamplingParams  # noqa: E402
from tests.model.test_engine_vs_hf import NEW_TOKENS, PROMPTS, TOP, _assert_all  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    from kvserve.config import ModelConfig
    from kvserve.model.loader import load_model
    from tests.conftest import default_model_or_skip

    return load_model(ModelConfig(model=default_model_or_skip(), quantization="none")).tokenizer


@pytest.fixture(scope="module")
def hf_cuda_reference(tokenizer):
    """Greedy continuations and per-step top-5 sets from transformers in float32 on the GPU."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf", reason="transformers reads GGUF files with the gguf package")
    from tests.conftest import default_model_or_skip

    path = default_model_or_skip()
    model = (
        transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
        )
        .to("cuda")
        .eval()
    )
    refs = []
    for text in PROMPTS:
        ids = tokenizer.encode(text, add_special_tokens=True)
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids], device="cuda"),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        gen = out.sequences[0, len(ids) :].tolist()
        tops = [
            set(torch.log_softmax(s[0].float(), -1).topk(TOP).indices.tolist()) for s in out.logits
        ]
        refs.append((ids, gen, tops))
    del model
    torch.cuda.empty_cache()
    return refs


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "label, kwargs, batched, count",
    [
        ("one at a time", {}, False, 8),
        ("one batch", {}, True, 8),
        ("a batch padded to a captured size", {}, True, 3),  # 3 rows replay the graph of 4
        (
            "chunked prefill",
            {"max_num_batched_tokens": 64, "enable_prefix_caching": False},
            True,
            8,
        ),
    ],
)
def test_cuda_float32_matches_hf_on_the_gpu(hf_cuda_reference, label, kwargs, batched, count):
    llm = LLM(
        device="cuda", dtype="float32", kv_cache_dtype="float32", kv_cache_memory="1GiB", **kwargs
    )
    assert llm.engine.runner.kv_caches[0][0].is_cuda
    assert "Triton attention" in llm.engine.step_path
    _assert_all(llm, hf_cuda_reference[:count], batched, label)
    assert llm.engine.runner.graphs.replays > 0, "the decode steps were meant to replay CUDA graphs"


def test_cuda_preemption_recomputes_the_same_tokens(hf_cuda_reference):
    longest = max(len(r[0]) for r in hf_cuda_reference) + NEW_TOKENS
    llm = LLM(
        device="cuda",
        dtype="float32",
        kv_cache_dtype="float32",
        num_blocks=longest // 16 + 6,
        max_num_batched_tokens=128,
        enable_prefix_caching=False,
    )
    _assert_all(llm, hf_cuda_reference, True, "preemption")
    assert llm.engine.scheduler.stats.num_preemptions > 0


def test_cuda_graphs_replay_exactly_what_eager_steps_compute(tokenizer):
    llm = LLM(device="cuda", kv_cache_memory="1GiB")  # bfloat16, the GPU default
    prompts = [tokenizer.encode(t, add_special_tokens=True) for t in PROMPTS]
    backend = llm.engine.runner.backend  # CudaBackend: graphs off is the eager Triton path
    with_graphs = greedy(llm, prompts)
    assert backend.graphs.replays >= NEW_TOKENS - 1
    graphs, backend.graphs = backend.graphs, None
    try:
        eager = greedy(llm, prompts)
    finally:
        backend.graphs = graphs
    assert with_graphs == eager


def test_fp8_kv_cache_stays_close_to_bfloat16(tokenizer):
    prompts = [tokenizer.encode(t, add_special_tokens=True) for t in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    runs = {}
    for kv in ("bfloat16", "fp8"):
        llm = LLM(device="cuda", kv_cache_dtype=kv, kv_cache_memory="1GiB")
        assert llm.engine.runner.kv_caches[0][0].dtype == (
            torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs[kv] = [
            [(lp.logprob, lp.top[0][0] if lp.top else None) for lp in o.prompt_logprobs[1:]]
            for o in outs
        ]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    diffs, agree, n = 0.0, 0, 0
    for a, b in zip(runs["bfloat16"], runs["fp8"]):
        for (lp_a, top_a), (lp_b, top_b) in zip(a, b):
            diffs += abs(lp_a - lp_b)
            agree += top_a == top_b
            n += 1
    print(
        f"fp8 vs bfloat16 KV over {n} prompt tokens: mean |dlogprob| {diffs / n:.4f}, "
        f"top-1 agreement {agree / n:.4f}"
    )
    assert diffs / n < 0.15 and agree / n >= 0.90


def test_kv_cache_takes_what_gpu_memory_utilization_leaves():
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    small = LLM(device="cuda", gpu_memory_utilization=0.2)
    small_bytes = small.engine.runner.kv_cache_bytes
    assert 0 < small_bytes < 0.2 * total
    del small
    gc.collect()
    torch.cuda.empty_cache()
    larger = LLM(device="cuda", gpu_memory_utilization=0.3)
    assert larger.engine.runner.kv_cache_bytes > small_bytes + 0.05 * total


def test_cuda_seeded_sampling_is_reproducible(tokenizer):
    llm = LLM(device="cuda", kv_cache_memory="1GiB")
    prompt = {"prompt_token_ids": tokenizer.encode(PROMPTS[0], add_special_tokens=True)}
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=24, seed=1234)
    first = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([prompt, prompt], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [first, first]
