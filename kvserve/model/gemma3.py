"""Gemma 3 (text) over a flat, unpadded token batch (Gemma Team, "Gemma 3 Technical Report", 2025).

    h = embed(ids) * sqrt(hidden)                   (the scale cast to the model dtype, as HF does)
    for each layer l:
        h = h + PostAttnNorm(Attention_l(InputNorm(h)))
        h = h + PostFFNorm(GeGLU(PreFFNorm(h)))
    logits = Norm(h) @ E^T                          (the LM head is the embedding)

    Norm(x) = x / rms(x) * (1 + w)                  (every norm, in float32)
    GeGLU(x) = down(gelu_tanh(gate(x)) * up(x))
    Attention_l: q = RoPE_l(QNorm(x Wq)), k = RoPE_l(KNorm(x Wk)), v = x Wv  (QNorm/KNorm per head)
                 o = softmax(q k^T * query_pre_attn_scalar^-1/2 + mask_l) v,   out = o Wo

Layers interleave five local layers for each global one (layer l is global when (l + 1) % 6 == 0,
or as config.json's `layer_types` says): a local layer's query i sees keys j with i - j < W (W =
the sliding window, 512 for the 270M model) and rotates with RoPE base 10k; a global layer sees the
whole context and rotates with base 1M (and the checkpoint's rope scaling, if any). Which window a
layer has is ModelArch.window_of(l); both RoPE tables are gathered once per step.

Weights carry Hugging Face Gemma3ForCausalLM names (model.layers.N.self_attn.q_norm.weight, ...);
norm weights are the offsets w, as HF stores them.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.arch import ModelArch
from kvserve.model.layers import (
    Embedding,
    GatedMLP,
    Linear,
    OffsetRMSNorm,
    RotaryEmbedding,
    TiedHeadMixin,
)
from kvserve.ops.attention import AttentionMetadata, paged_attention, write_kv

# The family's defaults where a file does not say (llama.cpp's GGUFs never store them; HF's
# Gemma3TextConfig defaults): every sixth layer is global, local layers rotate with base 10k.
GLOBAL_EVERY = 6
LOCAL_ROPE_BASE = 10000.0


def layer_windows(
    num_layers: int, window: int | None, global_every: int = GLOBAL_EVERY
) -> list[int | None]:
    """The 5:1 pattern: layer l is global (None) when (l + 1) % global_every == 0, else local
    (window)."""
    return [None if (i + 1) % global_every == 0 else window for i in range(num_layers)]


class Gemma3Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer: int, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_heads,
            arch.num_kv_heads,
            arch.head_dim,
        )
        self.sliding_window = arch.window_of(layer)
        self.scale = (arch.query_pre_attn_scalar or arch.head_dim) ** -0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # Separate projections: a GGUF may store each in its own block type.
        self.q_proj = Linear(arch.hidden_size, q_size, bias=arch.attention_bias, dtype=dtype)
        self.k_proj = Linear(arch.hidden_size, kv_size, bias=arch.attention_bias, dtype=dtype)
        self.v_proj = Linear(arch.hidden_size, kv_size, bias=arch.attention_bias, dtype=dtype)
        self.o_proj = Linear(q_size, arch.hidden_size, bias=arch.attention_bias, dtype=dtype)
        self.q_norm = OffsetRMSNorm(self.head_dim, arch.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, arch.rms_norm_eps)

    def forward(self, rope, x, meta: AttentionMetadata, k_cache, v_cache):
        """rope: this layer's RopeTables of the step (the local or the global rotation)."""
        T = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(T, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(T, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        q, k = RotaryEmbedding.apply(q, rope), RotaryEmbedding.apply(k, rope)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, meta, self.scale, self.sliding_window)
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer: int, dtype: torch.dtype):
        super().__init__()
        eps = arch.rms_norm_eps
        self.is_local = arch.window_of(layer) is not None
        self.input_layernorm = OffsetRMSNorm(arch.hidden_size, eps)
        self.self_attn = Gemma3Attention(arch, layer, dtype)
        self.post_attention_layernorm = OffsetRMSNorm(arch.hidden_size, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(arch.hidden_size, eps)
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, gelu_tanh, dtype)  # GeGLU
        self.post_feedforward_layernorm = OffsetRMSNorm(arch.hidden_size, eps)

    def forward(self, rope, h, meta, k_cache, v_cache):
        h = h + self.post_attention_layernorm(
            self.self_attn(rope, self.input_layernorm(h), meta, k_cache, v_cache)
        )
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3ForCausalLM(TiedHeadMixin, nn.Module):
    supports_parallel = False  # its sliding windows and norms are not sharded yet

    def __init__(
        self, arch: ModelArch, dtype: torch.dtype = torch.float32, max_positions: int | None = None
    ):
        super().__init__()
        if not arch.tie_word_embeddings:
            raise ValueError(
                "Gemma 3 ties its LM head to the embedding; this checkpoint has a separate "
                "lm_head.weight, which kvserve's gemma3 model does not take"
            )
        self.arch = arch
        self.dtype = dtype
        positions = max_positions or arch.max_position_embeddings
        # Two RoPE tables: global layers (rope_theta, with the checkpoint's scaling) and local
        # ones (rope_local_theta). Rows computed per step: 256-wide heads over a 32k context
        # would make cached tables of 64 MB each.
        self.rotary_global = RotaryEmbedding(
            arch.head_dim, positions, arch.rope_theta, arch.rope_scaling, cached=False
        )
        self.rotary_local = RotaryEmbedding(
            arch.head_dim, positions, arch.rope_local_theta or arch.rope_theta, cached=False
        )
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size, dtype)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(arch, i, dtype) for i in range(arch.num_layers)
        )
        self.norm = OffsetRMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = None  # tied: the embedding, or a packed copy of it (tie_quantized_head)
        self.tied_head = False

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, H] (final norm applied)."""
        h = self.embed_tokens(input_ids)
        h = h * torch.tensor(self.arch.hidden_size**0.5, dtype=h.dtype)
        local = self.rotary_local.tables(positions, h.dtype)  # once per step, for every local layer
        glob = self.rotary_global.tables(positions, h.dtype)  # and every global one
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            h = layer(local if layer.is_local else glob, h, meta.for_layer(i), k_cache, v_cache)
        return self.norm(h)

    # ---- weights (HF Gemma3ForCausalLM names) ----
    _LINEAR = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.(weight|bias)$")
    _NORM = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn\.)?(\w+_norm|\w+_layernorm)\.weight$")
    _FUSED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    _LAYER_NORMS = (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    )

    def weight_names(self) -> set[str]:
        """Every tensor (HF names) the checkpoint must provide."""
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        for i in range(self.arch.num_layers):
            p = f"model.layers.{i}."
            names |= {p + n + ".weight" for n in self._LAYER_NORMS}
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
            names |= {f"{p}self_attn.{x}_proj.weight" for x in "qkvo"}
            names |= {f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
            if self.arch.attention_bias:
                names |= {f"{p}self_attn.{x}_proj.bias" for x in "qkvo"}
        return names

    def load_weight(self, name: str, w: torch.Tensor) -> None:
        """Load one tensor named as in a HF Gemma3ForCausalLM checkpoint."""
        if m := self._LINEAR.match(name):
            layer, block, proj, kind = m.groups()
            target, shard = self._FUSED.get(proj, (proj, 0))
            linear = getattr(getattr(self.layers[int(layer)], block), target)
            (linear.load_weight if kind == "weight" else linear.load_bias)(w, shard)
        elif m := self._NORM.match(name):
            layer = self.layers[int(m.group(1))]
            owner = layer.self_attn if m.group(2) in ("q_norm", "k_norm") else layer
            getattr(owner, m.group(2)).load_weight(w)
        elif name == "model.embed_tokens.weight":
            self.load_embedding(w)
        elif name == "model.norm.weight":
            self.norm.load_weight(w)
        elif name == "lm_head.weight" or "rotary_emb" in name:
            pass  # the tied head repeated in the file; RoPE buffers are recomputed
        else:
            raise KeyError(f"unexpected weight {name!r}")
