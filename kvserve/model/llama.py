"""The Llama family (Llama 2/3, Mistral, SmolLM, Qwen2, Qwen3, Phi-3) over a flat, unpadded
token batch.

    h = embed(ids)
    for each layer:  h = h + Attention(RMSNorm(h));  h = h + SwiGLU(RMSNorm(h))
    logits = RMSNorm(h) @ E^T          (E: lm_head, or the embedding when tied)

The members differ only in options of ModelArch: q/k/v biases (Qwen2), a per-head RMSNorm of q
and k before RoPE (Qwen3, arch.qk_norm), partial rotary and LongRoPE (Phi-3, whose checkpoints
store q/k/v and gate/up as one tensor each: split here into the fused Linear's parts).

Attention writes this step's K/V into the paged pool, then attends each query over its request's
whole context in the pool (kvserve.ops.attention).
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
    RMSNorm,
    RotaryEmbedding,
    TiedHeadMixin,
)
from kvserve.ops.attention import AttentionMetadata, paged_attention, write_kv


class Attention(nn.Module):
    def __init__(
        self, arch: ModelArch, rotary: RotaryEmbedding, dtype: torch.dtype, layer: int = 0
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_heads,
            arch.num_kv_heads,
            arch.head_dim,
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.sliding_window = arch.window_of(layer)
        self.qkv_proj = Linear(
            arch.hidden_size,
            [self.q_size, self.kv_size, self.kv_size],
            bias=arch.attention_bias,
            dtype=dtype,
        )
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=arch.o_proj_bias, dtype=dtype)
        self.rotary = rotary
        # Qwen3: RMSNorm over each head's dims of q and of k, before RoPE.
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, dtype) if arch.qk_norm else None

    def forward(self, rope, x, meta: AttentionMetadata, k_cache, v_cache):
        """rope: the step's RopeTables (RotaryEmbedding.tables)."""
        T = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(T, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(T, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(T, self.num_kv_heads, self.head_dim)
            qk = torch.cat((q, k), dim=1)
        qk = self.rotary.apply(qk, rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, meta, self.scale, self.sliding_window)
        return self.o_proj(o.reshape(T, self.q_size))


def swiglu_mlp(arch: ModelArch, dtype: torch.dtype) -> GatedMLP:
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    return GatedMLP(arch.hidden_size, arch.intermediate_size, F.silu, dtype)


class DecoderLayer(nn.Module):
    """`mlp`: the layer's feed-forward block (default: SwiGLU; a mixture of experts in
    kvserve/model/mixtral.py)."""

    def __init__(
        self,
        arch: ModelArch,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        layer: int = 0,
        mlp: nn.Module | None = None,
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.self_attn = Attention(arch, rotary, dtype, layer)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = swiglu_mlp(arch, dtype) if mlp is None else mlp

    def forward(self, rope, h, meta, k_cache, v_cache):
        h, x = self.post_attention_layernorm.add_and_norm(
            h, self.self_attn(rope, self.input_layernorm(h), meta, k_cache, v_cache)
        )
        return h + self.mlp(x)


class LlamaForCausalLM(TiedHeadMixin, nn.Module):
    supports_parallel = True  # runner/tensor_parallel.py and pipeline_parallel.py shard it

    def __init__(
        self, arch: ModelArch, dtype: torch.dtype = torch.float32, max_positions: int | None = None
    ):
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        scaling = arch.rope_scaling
        if scaling and scaling.get("rope_type") == "longrope":  # short or long factors
            scaling = {**scaling, "context_len": arch.context_len or arch.max_position_embeddings}
        rotary = RotaryEmbedding(
            arch.rotary_dim or arch.head_dim,
            max_positions or arch.max_position_embeddings,
            arch.rope_theta,
            scaling,
        )
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size, dtype)
        self.rotary = rotary
        self.layers = nn.ModuleList(
            DecoderLayer(arch, rotary, dtype, i, mlp=self.make_mlp(arch, dtype))
            for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.lm_head = (
            None
            if arch.tie_word_embeddings
            else Linear(arch.hidden_size, arch.vocab_size, dtype=dtype)
        )
        self.tied_head = False  # lm_head is a packed copy of the embedding (loaded with it)

    def make_mlp(self, arch: ModelArch, dtype: torch.dtype) -> nn.Module | None:
        """A layer's feed-forward block; None: SwiGLU (subclasses put experts there)."""
        return None

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
        rope = self.rotary.tables(positions, h.dtype)  # once per step, shared by every layer
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            h = layer(rope, h, meta.for_layer(i), k_cache, v_cache)
        return self.norm(h)

    # ---- weights (HF names) ----
    _FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    _LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")

    def weight_names(self) -> set[str]:
        """Every tensor (HF names) the checkpoint must provide."""
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if self.lm_head is not None and not self.tied_head:
            names.add("lm_head.weight")
        for i in range(self.arch.num_layers):
            p = f"model.layers.{i}."
            names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
            attn = ("qkv", "o") if self.arch.name == "phi3" else "qkvo"  # Phi-3: q/k/v fused
            names |= {f"{p}self_attn.{x}_proj.weight" for x in attn}
            names |= self.mlp_weight_names(p)
            if self.arch.qk_norm:
                names |= {f"{p}self_attn.{x}_norm.weight" for x in "qk"}
            if self.arch.attention_bias:
                names |= {f"{p}self_attn.{x}_proj.bias" for x in "qkv"}
            if self.arch.o_proj_bias:
                names.add(f"{p}self_attn.o_proj.bias")
        return names

    def mlp_weight_names(self, p: str) -> set[str]:
        """The tensors of the feed-forward block of the layer whose names begin with `p`."""
        mlp = ("gate_up", "down") if self.arch.name == "phi3" else ("gate", "up", "down")
        return {f"{p}mlp.{x}_proj.weight" for x in mlp}

    def load_weight(self, name: str, w: torch.Tensor) -> None:
        """Load one tensor named as in a HF checkpoint (model.layers.3.self_attn.q_proj.weight)."""
        m = self._LAYER.match(name)
        if m:
            layer, block, proj, kind = m.groups()
            module = getattr(self.layers[int(layer)], block)
            if proj in ("q_norm", "k_norm"):
                norm = getattr(module, proj, None)
                if norm is None or kind != "weight":
                    raise KeyError(f"unexpected weight {name!r}: the model has no q/k norms")
                norm.load_weight(w)
                return
            if proj in ("qkv_proj", "gate_up_proj"):  # Phi-3's fused tensors: each part alone
                linear = getattr(module, proj)
                load = linear.load_weight if kind == "weight" else linear.load_bias
                for shard, part in enumerate(split_rows(w, linear.shard_sizes)):
                    load(part, shard)
                return
            target, shard = self._FUSED.get(proj, (proj, 0))
            linear = getattr(module, target)
            (linear.load_weight if kind == "weight" else linear.load_bias)(w, shard)
        elif name == "model.embed_tokens.weight":
            self.load_embedding(w)
        elif name == "lm_head.weight":
            if self.lm_head is not None and not self.tied_head:
                self.lm_head.load_weight(w)
        elif name == "model.norm.weight":
            self.norm.load_weight(w)
        elif m := re.match(
            r"^model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight$", name
        ):
            getattr(self.layers[int(m.group(1))], m.group(2)).load_weight(w)
        elif "rotary_emb.inv_freq" in name:
            pass  # recomputed from rope_theta
        else:
            raise KeyError(f"unexpected weight {name!r}")


def split_rows(w, sizes: list[int]) -> list:
    """A fused weight (a tensor, or quant.BlockTensor: whole rows of blocks) -> its parts of
    `sizes` rows, in order. A part keeps the file's qtype (gguf_qtype) when the whole had one."""
    if sum(sizes) != w.shape[0]:
        raise ValueError(
            f"fused weight has {w.shape[0]} rows, its parts {sizes} sum to {sum(sizes)}"
        )
    if isinstance(w, torch.Tensor):
        parts = list(w.split(sizes, dim=0))
        if hasattr(w, "gguf_qtype"):
            for part in parts:
                part.gguf_qtype = w.gguf_qtype
        return parts
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [type(w)(w.raw[a : a + n], w.qtype, (n, *w.shape[1:])) for a, n in zip(starts, sizes)]
