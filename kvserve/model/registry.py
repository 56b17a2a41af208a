"""Which model file builds which architecture: the one owner of the names kvserve supports.

    model file            ModelArch.name        GGUF architecture  HF config.json architectures
    kvserve/model/llama   llama, mistral, qwen2 llama, qwen2       LlamaForCausalLM,
                          qwen3, phi3           qwen3, phi3        MistralForCausalLM,
                                                                   Qwen2ForCausalLM,
                                                                   Qwen3ForCausalLM,
                                                                   Phi3ForCausalLM
    kvserve/model/gemma3  gemma3                gemma3             Gemma3ForCausalLM
    kvserve/model/mixtral mixtral, qwen3_moe,   llama (experts),   MixtralForCausalLM,
                          qwen2_moe             qwen3moe           Qwen3MoeForCausalLM,
                                                                   Qwen2MoeForCausalLM

(GGUF architecture: the file's general.architecture; "llama (experts)": a "llama" file with
llama.expert_count > 0, as llama.cpp writes Mixtral.)

(SmolLM and Mistral GGUFs state "llama".) Every model class has the same interface (CausalLM):
the loaders hand it HF-named tensors, the runner calls forward and compute_logits.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvserve.model.arch import ModelArch
from kvserve.model.gemma3 import Gemma3ForCausalLM
from kvserve.model.layers import Linear
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.mixtral import (
    MixtralForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)
from kvserve.ops.attention import AttentionMetadata


class CausalLM(Protocol):
    """What every model class of the registry provides."""

    arch: ModelArch
    dtype: torch.dtype
    lm_head: Linear | None
    # The model's layers can be split over tensor-parallel ranks and pipeline stages
    # (runner/tensor_parallel.py, runner/pipeline_parallel.py know its module names).
    supports_parallel: bool

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, H]."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, V]."""

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        """One tensor under its Hugging Face name."""

    def weight_names(self) -> set[str]:
        """Every tensor (HF names) a checkpoint must provide."""

    def tie_quantized_head(self, head: Linear) -> None:
        """A packed LM head for a tied model, loaded from the embedding's weight."""


# ModelArch.name -> the class that builds it.
MODEL_CLASSES: dict[str, type] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,  # + per-head q/k norms (ModelArch.qk_norm)
    "phi3": LlamaForCausalLM,  # fused qkv / gate_up tensors, partial rotary, LongRoPE
    "gemma3": Gemma3ForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,  # + a sigmoid-gated shared expert, q/k/v biases
}
# GGUF general.architecture -> ModelArch.name (llama.cpp's names).
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma3": "gemma3",
}
# GGUF general.architecture of a file with experts (expert_count > 0) -> ModelArch.name.
GGUF_MOE_ARCHITECTURES = {"llama": "mixtral", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# HF config.json "architectures" -> ModelArch.name.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}
# HF architectures refused with a reason of their own.
HF_REFUSED = {
    "Gemma3ForConditionalGeneration": "the multimodal Gemma 3 checkpoint (vision tower + text) "
    "is not loaded; use a text-only Gemma3ForCausalLM checkpoint (gemma-3-1b / 270m) or its GGUF",
}


def gguf_arch_name(architecture: str | None, path: str = "", experts: int = 0) -> str:
    """GGUF general.architecture (and its expert_count) -> ModelArch.name; ValueError naming what
    is supported."""
    if experts > 0:
        if architecture not in GGUF_MOE_ARCHITECTURES:
            raise ValueError(
                f"{path}: GGUF architecture {architecture!r} with {experts} experts is not "
                f"supported (mixture of experts: {', '.join(sorted(GGUF_MOE_ARCHITECTURES))})"
            )
        return GGUF_MOE_ARCHITECTURES[architecture]
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {architecture!r} is not supported "
            f"(supported: {', '.join(sorted(GGUF_ARCHITECTURES))})"
        )
    return GGUF_ARCHITECTURES[architecture]


def hf_arch_name(architectures: list[str] | None, path: str = "") -> str:
    """HF config.json `architectures` -> ModelArch.name; ValueError naming what is supported."""
    archs = list(architectures or [])
    for a in archs:
        if a in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[a]
    for a in archs:
        if a in HF_REFUSED:
            raise ValueError(f"{path}: {a}: {HF_REFUSED[a]}")
    raise ValueError(
        f"{path}: architecture {archs} is not supported "
        f"(supported: {', '.join(sorted(HF_ARCHITECTURES))})"
    )


def build_model(arch: ModelArch, dtype: torch.dtype, max_positions: int | None = None) -> CausalLM:
    """The model of `arch` (weights not loaded yet)."""
    cls = MODEL_CLASSES.get(arch.name)
    if cls is None:
        raise ValueError(
            f"no model file builds architecture {arch.name!r} "
            f"(supported: {', '.join(sorted(MODEL_CLASSES))})"
        )
    return cls(arch, dtype, max_positions)
