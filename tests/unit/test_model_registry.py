"""The architecture registry (kvserve.model.registry): names from GGUF and HF files -> model class;
unknown ones refused naming what is supported; Gemma 3 hyper-parameters from config.json."""

import math

import pytest
import torch

from kvserve.model import registry
from kvserve.model.arch import ModelArch
from kvserve.model.gemma3 import Gemma3ForCausalLM
from kvserve.model.hf_loader import hf_arch
from kvserve.model.llama import LlamaForCausalLM


def test_names_map_to_model_classes():
    assert (
        registry.gguf_arch_name("gemma3") == "gemma3"
        and registry.gguf_arch_name("llama") == "llama"
    )
    assert registry.hf_arch_name(["Qwen2ForCausalLM"]) == "qwen2"
    assert registry.hf_arch_name(["Qwen3ForCausalLM"]) == "qwen3"
    assert registry.hf_arch_name(["Phi3ForCausalLM"]) == "phi3"
    assert registry.gguf_arch_name("qwen3") == "qwen3" and registry.gguf_arch_name("phi3") == "phi3"
    assert registry.MODEL_CLASSES["gemma3"] is Gemma3ForCausalLM
    family = ("llama", "mistral", "qwen2", "qwen3", "phi3")
    assert {registry.MODEL_CLASSES[a] for a in family} == {LlamaForCausalLM}


def test_unknown_architectures_are_refused_naming_the_supported():
    with pytest.raises(
        ValueError,
        match=r"'phi2' is not supported \(supported: gemma3, llama, phi3, qwen2, qwen3\)",
    ):
        registry.gguf_arch_name("phi2", "x.gguf")
    with pytest.raises(ValueError, match="Gemma3ForCausalLM, LlamaForCausalLM"):
        registry.hf_arch_name(["FalconForCausalLM"])
    with pytest.raises(ValueError, match="multimodal Gemma 3"):
        registry.hf_arch_name(["Gemma3ForConditionalGeneration"])
    with pytest.raises(ValueError, match="no model file builds"):
        registry.build_model(ModelArch("bert", 1, 8, 1, 1, 8, 8, 8, 8), torch.float32)


GEMMA3 = dict(
    architectures=["Gemma3ForCausalLM"],
    model_type="gemma3_text",
    num_hidden_layers=8,
    hidden_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    intermediate_size=96,
    vocab_size=300,
    max_position_embeddings=128,
    sliding_window=16,
    query_pre_attn_scalar=24,
)


def test_gemma3_config_new_style():
    cfg = dict(
        GEMMA3,
        layer_types=["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 4,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    arch = hf_arch(cfg)
    assert arch.layer_windows == [16, 16, 16, None, 16, 16, 16, 16]
    assert (arch.rope_theta, arch.rope_local_theta, arch.query_pre_attn_scalar) == (1e6, 1e4, 24)
    assert arch.rope_scaling["rope_type"] == "linear" and arch.tie_word_embeddings
    model = registry.build_model(arch, torch.float32)
    assert isinstance(model, Gemma3ForCausalLM)
    assert [layer.self_attn.sliding_window for layer in model.layers] == arch.layer_windows
    assert model.layers[0].self_attn.scale == 24**-0.5
    assert "model.layers.3.self_attn.k_norm.weight" in model.weight_names()


def test_gemma3_config_old_style_pattern():
    arch = hf_arch(dict(GEMMA3, rope_theta=1e6, rope_local_base_freq=5e3, sliding_window_pattern=4))
    assert arch.layer_windows == [16, 16, 16, None, 16, 16, 16, None]
    assert arch.rope_local_theta == 5e3


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"hidden_activation": "relu"}, "hidden_activation"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
    ],
)
def test_gemma3_config_refusals(bad, match):
    with pytest.raises(ValueError, match=match):
        hf_arch(dict(GEMMA3, **bad))


def test_c_layer_stack_does_not_take_gemma3():
    from kvserve.runner.layer_stack import CLayerStack

    model = registry.build_model(hf_arch(GEMMA3), torch.float32)
    assert CLayerStack.build(model) is None


LLAMA_SHAPE = dict(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=300,
    max_position_embeddings=4096,
)


def test_qwen3_config():
    arch = hf_arch(dict(LLAMA_SHAPE, architectures=["Qwen3ForCausalLM"], head_dim=32))
    assert arch.qk_norm and arch.head_dim == 32 and not arch.attention_bias
    model = registry.build_model(arch, torch.float32)
    names = model.weight_names()
    assert {"model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"} <= (
        names
    )
    with pytest.raises(ValueError, match="use_sliding_window"):
        hf_arch(dict(LLAMA_SHAPE, architectures=["Qwen3ForCausalLM"], use_sliding_window=True))


PHI3 = dict(LLAMA_SHAPE, architectures=["Phi3ForCausalLM"], original_max_position_embeddings=1024)


def test_phi3_config_longrope_old_style():
    """Phi-3-mini-128k's config.json: rope_scaling type "su" (transformers reads it as longrope),
    partial_rotary_factor at the top level; the attention factor by transformers' rule."""
    factors = [1.0] * 6
    arch = hf_arch(
        dict(
            PHI3,
            partial_rotary_factor=0.75,
            rope_scaling={"type": "su", "short_factor": factors, "long_factor": factors},
        )
    )
    assert arch.rotary_dim == 12 and arch.head_dim == 16
    s = arch.rope_scaling
    assert s["rope_type"] == "longrope" and s["original_max_position_embeddings"] == 1024
    assert s["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(4) / math.log(1024)))
    model = registry.build_model(arch, torch.float32)
    assert model.rotary.cos.shape[1] == 12
    assert "model.layers.0.self_attn.qkv_proj.weight" in model.weight_names()
    assert "model.layers.0.mlp.gate_up_proj.weight" in model.weight_names()


def test_phi3_fused_weights_are_split_into_the_parts():
    arch = hf_arch(PHI3)
    assert arch.rotary_dim is None and arch.rope_scaling is None
    model = registry.build_model(arch, torch.float32)
    qkv = torch.randn(64 + 2 * 32, 64)
    gate_up = torch.randn(2 * 96, 64)
    model.load_weight("model.layers.0.self_attn.qkv_proj.weight", qkv)
    model.load_weight("model.layers.0.mlp.gate_up_proj.weight", gate_up)
    assert torch.equal(model.layers[0].self_attn.qkv_proj.weight, qkv)
    assert torch.equal(model.layers[0].mlp.gate_up_proj.weight, gate_up)
    with pytest.raises(ValueError, match="rows"):
        model.load_weight("model.layers.0.self_attn.qkv_proj.weight", torch.randn(100, 64))


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic' is not supported"),
        ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8}}, "long_factor"),
        ({"partial_rotary_factor": 0.1}, "partial_rotary_factor"),
    ],
)
def test_phi3_config_refusals(bad, match):
    with pytest.raises(ValueError, match=match):
        hf_arch(dict(PHI3, **bad))
