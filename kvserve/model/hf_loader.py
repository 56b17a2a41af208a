"""Hugging Face model directories: config.json + *.safetensors (+ tokenizer.json)."""

from __future__ import annotations

import glob
import json
import math
import os

from kvserve.model import gemma3, registry
from kvserve.model.arch import ModelArch


def read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def _rope(cfg: dict, layer_type: str | None = None) -> tuple[float | None, dict | None]:
    """(rope theta, scaling dict or None) from config.json: transformers >= 5 keeps both in
    rope_parameters (per layer type for Gemma 3), older files in rope_theta / rope_scaling."""
    rope = dict(cfg.get("rope_parameters") or {})
    if layer_type is not None and isinstance(rope.get(layer_type), dict):
        rope = dict(rope[layer_type])
    theta = rope.pop("rope_theta", None)
    scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
    return theta, cfg.get("rope_scaling") or scaling


def hf_arch(cfg: dict, path: str = "") -> ModelArch:
    name = registry.hf_arch_name(cfg.get("architectures"), path)
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    arch = ModelArch(
        name=name,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", name == "gemma3")),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=set(eos) if isinstance(eos, list) else {eos} if eos is not None else set(),
    )
    (_gemma3_fields if name == "gemma3" else _llama_fields)(arch, cfg, path)
    if name in ("mixtral", "qwen3_moe", "qwen2_moe"):
        _moe_fields(arch, cfg, path)
    if name == "phi3":
        _phi3_fields(arch, cfg, path)
    return arch


def _llama_fields(arch: ModelArch, cfg: dict, path: str) -> None:
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias"):
        raise ValueError(
            f"{path}: only SwiGLU MLPs without bias are supported "
            f"(hidden_act {cfg.get('hidden_act')!r}, mlp_bias {cfg.get('mlp_bias')!r})"
        )
    theta, arch.rope_scaling = _rope(cfg)
    arch.rope_theta = float(cfg.get("rope_theta") or theta or 10000.0)
    if arch.name == "mistral":
        arch.sliding_window = cfg.get("sliding_window")
    elif arch.name in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        raise ValueError(
            f"{path}: Qwen2/Qwen3 per-layer sliding window (use_sliding_window) is not supported"
        )
    arch.qk_norm = arch.name == "qwen3"
    arch.attention_bias = arch.name == "qwen2" or bool(cfg.get("attention_bias", False))
    arch.o_proj_bias = arch.name != "qwen2" and bool(cfg.get("attention_bias", False))


def _moe_fields(arch: ModelArch, cfg: dict, path: str) -> None:
    """MixtralForCausalLM (its window), Qwen3MoeForCausalLM (q/k norms, expert width
    moe_intermediate_size, norm_topk_prob; every layer sparse) and Qwen2MoeForCausalLM (as
    Qwen3-MoE without q/k norms, with q/k/v biases and a shared expert): the Llama fields, plus
    experts."""
    arch.num_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    arch.num_experts_per_tok = int(cfg.get("num_experts_per_tok") or 0)
    if not 0 < arch.num_experts_per_tok <= arch.num_experts:
        raise ValueError(
            f"{path}: num_experts_per_tok ({arch.num_experts_per_tok}) must be in "
            f"[1, the number of experts ({arch.num_experts})]"
        )
    if arch.name == "mixtral":
        arch.sliding_window = cfg.get("sliding_window")
        return
    family = "Qwen2-MoE" if arch.name == "qwen2_moe" else "Qwen3-MoE"
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{path}: {family} sliding window (use_sliding_window) is not supported")
    if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
        raise ValueError(
            f"{path}: {family} with dense layers (decoder_sparse_step "
            f"{cfg.get('decoder_sparse_step')}, mlp_only_layers {cfg.get('mlp_only_layers')}) "
            "is not supported; every layer must be sparse"
        )
    arch.qk_norm = arch.name == "qwen3_moe"
    arch.intermediate_size = int(cfg["moe_intermediate_size"])
    arch.norm_topk_prob = bool(cfg.get("norm_topk_prob", False))
    if arch.name == "qwen2_moe":  # q/k/v biases (qkv_bias), a shared expert per layer
        arch.attention_bias = bool(cfg.get("qkv_bias", True))
        arch.o_proj_bias = False
        arch.shared_expert_size = int(cfg.get("shared_expert_intermediate_size") or 0)


def _phi3_fields(arch: ModelArch, cfg: dict, path: str) -> None:
    """Phi3ForCausalLM: the Llama fields, plus its window, partial rotary and LongRoPE."""
    arch.sliding_window = cfg.get("sliding_window")
    rope = cfg.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0
    rotary_dim = int(arch.head_dim * partial)
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(
            f"{path}: partial_rotary_factor {partial} gives {rotary_dim} rotary dims of "
            f"head_dim {arch.head_dim}; it must be a positive even number"
        )
    arch.rotary_dim = rotary_dim if rotary_dim != arch.head_dim else None
    scaling = arch.rope_scaling
    if scaling is None:
        return
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ("longrope", "su", "yarn"):  # transformers reads "su" and "yarn" as longrope
        raise ValueError(
            f"{path}: Phi-3 rope scaling {kind!r} is not supported (supported: longrope)"
        )
    orig = scaling.get("original_max_position_embeddings") or cfg.get(
        "original_max_position_embeddings"
    )
    if not orig or "short_factor" not in scaling or "long_factor" not in scaling:
        raise ValueError(
            f"{path}: longrope needs short_factor, long_factor and original_max_position_embeddings"
        )
    # transformers' attention factor: from `factor`, else max_position_embeddings / original.
    factor = scaling.get("factor") or arch.max_position_embeddings / orig
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        )
    arch.rope_scaling = {
        "rope_type": "longrope",
        "short_factor": list(scaling["short_factor"]),
        "long_factor": list(scaling["long_factor"]),
        "original_max_position_embeddings": int(orig),
        "attention_factor": float(attention_factor),
    }


def _gemma3_fields(arch: ModelArch, cfg: dict, path: str) -> None:
    """Gemma3ForCausalLM's config.json (model_type gemma3_text)."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(
            f"{path}: Gemma 3 with hidden_activation {act!r} is not supported (gelu_pytorch_tanh)"
        )
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ValueError(
                f"{path}: {key}={cfg[key]} is not supported (Gemma 3 checkpoints set it to null)"
            )
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{path}: use_bidirectional_attention (EmbeddingGemma) is not supported")
    theta, arch.rope_scaling = _rope(cfg, "full_attention")
    local_theta, local_scaling = _rope(cfg, "sliding_attention")
    if local_scaling is not None and cfg.get("rope_scaling") is None:
        raise ValueError(f"{path}: rope scaling on the sliding-window layers is not supported")
    arch.rope_theta = float(cfg.get("rope_theta") or theta or 1_000_000.0)
    arch.rope_local_theta = float(
        cfg.get("rope_local_base_freq") or local_theta or gemma3.LOCAL_ROPE_BASE
    )
    arch.query_pre_attn_scalar = cfg.get("query_pre_attn_scalar", arch.head_dim)
    arch.attention_bias = bool(cfg.get("attention_bias", False))
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is None:
        every = (
            cfg.get("sliding_window_pattern")
            or cfg.get("_sliding_window_pattern")
            or gemma3.GLOBAL_EVERY
        )
        types = [
            "sliding_attention" if w else "full_attention"
            for w in gemma3.layer_windows(arch.num_layers, 1, every)
        ]
    if len(types) != arch.num_layers or set(types) - {"full_attention", "sliding_attention"}:
        raise ValueError(
            f"{path}: layer_types must name full_attention or sliding_attention for each of "
            f"the {arch.num_layers} layers, got {types}"
        )
    arch.layer_windows = [window if t == "sliding_attention" else None for t in types]


def safetensors_files(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    return files


def has_tensor(path: str, name: str) -> bool:
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            if name in f.keys():
                return True
    return False


def iter_hf_weights(path: str):
    """Yield (name, tensor) for every tensor of every *.safetensors file in the directory."""
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
