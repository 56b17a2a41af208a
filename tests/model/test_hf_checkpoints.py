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
}
WINDOWS = {
    "llama": [None] * 2,
    "qwen2": [None] * 2,
    "mistral": [8] * 2,
    "gemma3": [8] * 5 + [None, 8],
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
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    kv_model.tokenizer.backend.save(
        str(path / "tokenizer.json")
    )  # any tokenizer: ids go in directly
    return request.param, str(path), model


def test_checkpoint_logits_match_transformers(checkpoint):
    from kvserve.config import ModelConfig
    from kvserve.model.loader import load_model

    name, path, hf = checkpoint
    lm = load_model(ModelConfig(model=path))
    assert lm.arch.name == name
    assert type(lm.model).__name__ == (
        "Gemma3ForCausalLM" if name == "gemma3" else "LlamaForCausalLM"
    )
    assert lm.arch.tie_word_embeddings == (name in ("qwen2", "gemma3"))
    assert [lm.arch.window_of(i) for i in range(lm.arch.num_layers)] == WINDOWS[name]
    ids = list(range(1000, 1030))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    pool = PagedPool(lm.arch, num_blocks=8, seed=3)
    outs = []
    for start, end in ((0, 17), (17, 30)):  # chunked prefill: every position's logits
        ids_t, pos = torch.tensor(ids[start:end]), torch.arange(start, end)
        slots = torch.tensor(pool.slots(0, start, end - start))
        meta = AttentionMetadata(
            slots, [0, end - start], [end], torch.tensor([pool.tables[0]]), BLOCK
        )
        outs.append(lm.model.compute_logits(lm.model(ids_t, pos, meta, pool.kv)))
    torch.testing.assert_close(torch.cat(outs), ref, atol=1e-4, rtol=1e-4)
