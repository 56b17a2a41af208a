"""Hugging Face safetensors checkpoints (config.json + *.safetensors) written by the test with
transformers' save_pretrained, small random weights, loaded by transformers and by kvserve
(kvserve.model.hf_loader through the architecture registry): equal logits at every position,
prefilled in two chunks through a paged KV pool.

    llama    Llama 3 style: rope_scaling llama3, GQA (4 query heads, 2 KV heads), untied LM head
    qwen2    Qwen2 style: q/k/v biases (made large), tied embeddings
    mistral  a sliding window shorter than the prompt
    gemma3   Gemma 3 text: 5 local layers (window 8, RoPE 10k) per global one (RoPE 1M), q/k norms,
             four norms per layer (random: HF initializes them to zero), query_pre_attn_scalar !=
             head_dim
    qwen3    Qwen3: per-head q/k RMSNorms (random weights), head_dim 32 != hidden / heads
    phi3     Phi-3: fused qkv_proj and gate_up_proj tensors, plain RoPE
    phi3_longrope
             Phi-3 LongRoPE (Phi-4-mini style): partial_rotary_factor 0.75, distinct short and long
             factors, original_max_position_embeddings 16 under the 30-token prompt, so
             transformers rotates with the long factors (its rule: the longest position + 1 >
             original length) and scales cos/sin by sqrt(1 + ln(256/16) / ln(16)); kvserve picks
             the long set as its served context (256) exceeds 16. With max_model_len 16 it picks
             the short set: checked against transformers on a 16-token prompt.

Each new architecture also generates 32 greedy tokens through kvserve.LLM, equal to transformers'
generate.
"""

import pytest
import torch

from kvserve.ops.attention import AttentionMetadata
from tests.model.test_forward_vs_hf import BLOCK, PagedPool

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=49152,
    max_position_embeddings=256,
    initializer_range=0.2,
)
CONFIGS = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(sliding_window=8, tie_word_embeddings=False),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=7,
            head_dim=32,
            sliding_window=8,
            query_pre_attn_scalar=24,
            tie_word_embeddings=True,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(head_dim=32, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False, pad_token_id=0)),
    "phi3_longrope": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            tie_word_embeddings=False,
            pad_token_id=0,
            original_max_position_embeddings=16,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,  # 12 of 16 dims rotate: 6 frequencies
                "short_factor": [1.0, 1.3, 1.7, 2.2, 3.0, 4.5],
                "long_factor": [1.0, 2.5, 5.0, 9.0, 17.0, 40.0],
            },
        ),
    ),
}
# The architecture (ModelArch.name) each case loads as, where it is not the case's name.
ARCH = {"phi3_longrope": "phi3"}
NEW = ("qwen3", "phi3", "phi3_longrope")  # also checked through the engine
WINDOWS = {
    "llama": [None] * 2,
    "qwen2": [None] * 2,
    "mistral": [8] * 2,
    "gemma3": [8] * 5 + [None, 8],
    "qwen3": [None] * 2,
    "phi3": [None] * 2,
    "phi3_longrope": [None] * 2,
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory, kv_model):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    config_cls, model_cls, extra = CONFIGS[request.param]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**TINY, **extra})
    model = (
        getattr(transformers, model_cls)._from_config(config, attn_implementation="eager").eval()
    )
    with torch.no_grad():
        if request.param == "qwen2":  # make the biases matter
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    torch.nn.init.normal_(proj.bias, std=0.5)
        if request.param == "gemma3":  # HF starts Gemma's norm offsets at zero: make them matter
            for name, p in model.named_parameters():
                if "norm" in name:
                    torch.nn.init.normal_(p, std=0.3)
        if request.param == "qwen3":  # HF starts the q/k norms at one: make them matter
            for name, p in model.named_parameters():
                if "q_norm" in name or "k_norm" in name:
                    torch.nn.init.normal_(p, mean=1.0, std=0.5)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    kv_model.tokenizer.backend.save(
        str(path / "tokenizer.json")
    )  # any tokenizer: ids go in directly
    return request.param, str(path), model


def test_checkpoint_logits_match_transformers(checkpoint):
    from kvserve.config import ModelConfig
    from kvserve.model.loader import load_model

    case, path, hf = checkpoint
    name = ARCH.get(case, case)
    lm = load_model(ModelConfig(model=path))
    assert lm.arch.name == name
    assert type(lm.model).__name__ == (  # the Llama family: one class, options in ModelArch
        "Gemma3ForCausalLM" if name == "gemma3" else "LlamaForCausalLM"
    )
    assert lm.arch.tie_word_embeddings == (name in ("qwen2", "gemma3"))
    assert [lm.arch.window_of(i) for i in range(lm.arch.num_layers)] == WINDOWS[case]
    ids = list(range(1000, 1030))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(chunked_logits(lm, ids, 17), ref, atol=1e-4, rtol=1e-4)


def chunked_logits(lm, ids: list[int], split: int) -> torch.Tensor:
    """kvserve's logits at every position of `ids`, prefilled in two chunks (split at `split`)
    through a paged KV pool."""
    pool = PagedPool(lm.arch, num_blocks=8, seed=3)
    outs = []
    for start, end in ((0, split), (split, len(ids))):
        ids_t, pos = torch.tensor(ids[start:end]), torch.arange(start, end)
        slots = torch.tensor(pool.slots(0, start, end - start))
        meta = AttentionMetadata(
            slots, [0, end - start], [end], torch.tensor([pool.tables[0]]), BLOCK
        )
        outs.append(lm.model.compute_logits(lm.model(ids_t, pos, meta, pool.kv)))
    return torch.cat(outs)


def test_longrope_short_factors_within_the_original_length(checkpoint):
    """A context capped at original_max_position_embeddings (max_model_len 16): kvserve rotates
    with the short factors, as transformers does for a sequence of at most 16 tokens."""
    from kvserve.config import ModelConfig
    from kvserve.model.loader import load_model

    case, path, hf = checkpoint
    if case != "phi3_longrope":
        pytest.skip("LongRoPE checkpoint only")
    lm = load_model(ModelConfig(model=path, max_model_len=16))
    ids = list(range(2000, 2016))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        ref_long = hf(torch.tensor([ids + [7]])).logits[0, :16]  # 17 tokens: the long factors
    assert (ref - ref_long).abs().max() > 1e-2  # the two factor sets give different logits
    torch.testing.assert_close(chunked_logits(lm, ids, 9), ref, atol=1e-4, rtol=1e-4)


def test_greedy_32_tokens_through_the_engine(checkpoint):
    """kvserve.LLM (scheduler, paged KV, chunked prefill) generates transformers' greedy tokens."""
    from kvserve import LLM, SamplingParams

    case, path, hf = checkpoint
    if case not in NEW:
        pytest.skip("checked for the architectures added with the Llama-family options")
    prompt = list(range(3000, 3020))  # 20 tokens: past the LongRoPE case's original length
    with torch.no_grad():
        want = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=32,
            min_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    llm = LLM(
        path,
        num_threads=1,
        kv_cache_memory="16MiB",
        kv_cache_dtype="float32",
        max_num_batched_tokens=16,  # the prompt runs in two chunks
    )
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want
