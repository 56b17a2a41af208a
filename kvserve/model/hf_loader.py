"""Hugging Face model directories: config.json + *.safetensors (+ tokenizer.json)."""
from __future__ import annotations

import glob
import json
import os

from kvserve.model.arch import ModelArch

_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


def read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def hf_arch(cfg: dict, path: str = "") -> ModelArch:
    archs = cfg.get("architectures") or []
    name = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None)
    if name is None:
        raise ValueError(f"{path}: architecture {archs} is not supported (supported: {sorted(_ARCHITECTURES)})")
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias"):
        raise NotImplementedError(f"{path}: only SwiGLU MLPs without bias are supported")
    heads = cfg["num_attention_heads"]
    rope = dict(cfg.get("rope_parameters") or {})     # transformers >= 5 keeps theta and scaling here
    theta = cfg.get("rope_theta", rope.pop("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    sliding = None
    if name == "mistral":
        sliding = cfg.get("sliding_window")
    elif name == "qwen2" and cfg.get("use_sliding_window"):
        raise NotImplementedError(f"{path}: Qwen2 per-layer sliding window is not supported")
    eos = cfg.get("eos_token_id")
    return ModelArch(
        name=name,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rope_theta=float(theta),
        rope_scaling=scaling,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=name == "qwen2" or bool(cfg.get("attention_bias", False)),
        o_proj_bias=name != "qwen2" and bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=set(eos) if isinstance(eos, list) else {eos} if eos is not None else set(),
        sliding_window=sliding,
    )


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
