"""ModelArch: the hyper-parameters a model is built from, whichever file they came from."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.config import KVShape


@dataclass
class ModelArch:
    name: str  # "llama" | "mistral" | "qwen2" | "qwen3" | "phi3" | "gemma3" | ... (model.registry)
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF style: {"rope_type": "llama3", "factor": ...}
    # RoPE base of the sliding-window layers when it differs from rope_theta (Gemma 3: 10k local,
    # 1M global); rope_scaling applies to the global (full-attention) layers only.
    rope_local_theta: float | None = None
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 (Gemma); None: head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    o_proj_bias: bool = False  # the output projection too (Llama's attention_bias=True)
    bos_token_id: int | None = None
    eos_token_ids: set[int] = field(default_factory=set)
    sliding_window: int | None = None
    # Per layer, the window of its attention (None: full attention), for models that mix both
    # (Gemma 3). Empty: every layer uses `sliding_window` (the Llama family, Mistral).
    layer_windows: list[int | None] = field(default_factory=list)
    # Mixture of experts (Mixtral, Qwen3-MoE): experts per layer (0: a dense MLP) and how many
    # each token uses.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = True  # the top-k routing weights renormalized to sum to 1
    # Qwen2-MoE: the width of each layer's shared expert (0: none), gated by a sigmoid.
    shared_expert_size: int = 0

    # Per-head RMSNorm of q and k before RoPE (Qwen3's self_attn.q_norm / k_norm).
    qk_norm: bool = False
    # How many leading dimensions of each head RoPE rotates (partial_rotary_factor); None: all.
    rotary_dim: int | None = None
    # The context length the engine serves (None: max_position_embeddings). LongRoPE (Phi-3)
    # picks its short or long factors by it, as llama.cpp does by its context size.
    context_len: int | None = None

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer `layer`'s attention (None: it sees the whole context)."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    def kv_shape(self, dtype_bytes: int) -> KVShape:
        return KVShape(self.num_layers, self.num_kv_heads, self.head_dim, dtype_bytes)
