"""Mixture-of-experts models: the Llama attention with a sparse mixture of SwiGLU experts in
place of the MLP. Mixtral, and Qwen3-MoE (Qwen3's per-head q/k norms, arch.qk_norm).

    for each layer:  h = h + Attention(RMSNorm(h));  h = h + MoE(RMSNorm(h))
    MoE(x) = sum over x's top-k experts e:  p_e * expert_e(x)
             router logits x @ G^T [E]; p: the softmax over all E experts at the k largest,
             renormalized to sum to 1 (Mixtral always; Qwen3-MoE when norm_topk_prob)

Each expert is a GatedMLP (w1 and w3 fused as gate/up, w2 as down), so every weight format
applies to the experts as to any Linear: the GGUF blocks stay packed for the C kernels, int8 and
int4 pack them. The router stays dense (small, and a packed router could move tokens between
experts). The experts run grouped: the (token, expert) pairs are sorted by expert, each
expert multiplies its tokens in one matmul, and one index_add scatters the weighted rows back.
"""

from __future__ import annotations

import logging
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
    UnquantizedMethod,
    dense,
)
from kvserve.model.llama import DecoderLayer
from kvserve.ops.attention import AttentionMetadata

log = logging.getLogger("kvserve.model")


def route(logits: torch.Tensor, top_k: int, normalize: bool = True):
    """Router logits [T, E] -> (weights float32 [T, k], expert ids int64 [T, k]): the softmax over
    all experts, its k largest, renormalized to sum to 1 when `normalize` (Mixtral; equal to a
    softmax over the k largest logits)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts
) -> torch.Tensor:
    """sum_k weights[t, k] * experts[ids[t, k]](x[t]) for every token t, one call per expert that
    has tokens: the T*k (token, expert) pairs are sorted by expert (stable: a token's rows keep
    their order), each expert runs on its contiguous run of gathered rows, and the weighted rows
    are added back to their tokens. x [T, H], ids/weights [T, k] -> [T, H] in x's dtype."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(experts)).tolist()  # one host sync per layer
    tokens = order // k
    rows = x[tokens]
    out_rows = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n:
            out_rows[start : start + n] = experts[e](rows[start : start + n])
            start += n
    scale = weights.reshape(-1)[order].unsqueeze(-1)
    out = torch.zeros_like(x)
    return out.index_add_(0, tokens, (out_rows * scale).to(x.dtype))


def all_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts) -> torch.Tensor:
    """grouped_experts' sum with no host sync: every expert runs on every token and a [T, E]
    weight matrix (zero where a token did not pick the expert) combines them. E/k times the
    matmul work; for a CUDA graph being captured, where the grouped path's per-expert token
    counts cannot be read."""
    combine = torch.zeros(x.shape[0], len(experts), dtype=weights.dtype, device=x.device)
    combine.scatter_add_(1, ids, weights)
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        out = out + (expert(x) * combine[:, e : e + 1]).to(x.dtype)
    return out


class SparseMoE(nn.Module):
    """Router `gate` [E, H] (dense, model dtype) and E SwiGLU experts; top-k of E per token."""

    def __init__(self, arch: ModelArch, dtype: torch.dtype):
        super().__init__()
        if not 0 < arch.num_experts_per_tok <= arch.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts={arch.num_experts}], "
                f"got {arch.num_experts_per_tok}"
            )
        self.top_k = arch.num_experts_per_tok
        self.normalize = arch.norm_topk_prob
        self.gate = nn.Parameter(
            torch.empty(arch.num_experts, arch.hidden_size, dtype=dtype), requires_grad=False
        )
        self.experts = nn.ModuleList(
            GatedMLP(arch.hidden_size, arch.intermediate_size, F.silu, dtype)
            for _ in range(arch.num_experts)
        )

    def load_gate(self, w) -> None:
        w = dense(w)
        if w.shape != self.gate.shape:
            raise ValueError(f"router gate is {tuple(self.gate.shape)}, got {tuple(w.shape)}")
        self.gate.data.copy_(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(F.linear(x, self.gate), self.top_k, self.normalize)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return all_experts(x, ids, weights, self.experts)
        return grouped_experts(x, ids, weights, self.experts)


def expert_format(linear: Linear, gguf: bool) -> str:
    """How one expert's weight is stored and multiplied, for the start-up log (`gguf`: it came
    from a GGUF file)."""
    method = linear.quant_method
    if isinstance(method, UnquantizedMethod):
        if gguf:
            return (
                f"dense {linear.weight.dtype}: weight format none dequantizes the GGUF blocks at "
                "load (--quantization gguf keeps them packed)"
            )
        return f"dense {linear.weight.dtype}, the checkpoint's float weights"
    if getattr(linear, "dense_reason", None):
        return f"dense float32, {linear.dense_reason}"
    if getattr(linear, "gguf_parts", None):
        return "the file's GGUF blocks, run by the C kernels one expert at a time"
    return f"packed by {type(method).__name__}"


class MixtralForCausalLM(TiedHeadMixin, nn.Module):
    """MixtralForCausalLM; subclasses change only the checkpoint's names (`_MOE`, `_W`)."""

    # Not sharded: runner/tensor_parallel.py and pipeline_parallel.py know the dense MLP's names.
    supports_parallel = False

    def __init__(
        self, arch: ModelArch, dtype: torch.dtype = torch.float32, max_positions: int | None = None
    ):
        super().__init__()
        if arch.num_experts <= 0:
            raise ValueError(f"{arch.name}: a mixture-of-experts model needs num_experts > 0")
        self.arch = arch
        self.dtype = dtype
        self.rotary = RotaryEmbedding(
            arch.head_dim,
            max_positions or arch.max_position_embeddings,
            arch.rope_theta,
            arch.rope_scaling,
        )
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, self.rotary, dtype, i, mlp=SparseMoE(arch, dtype))
            for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.lm_head = (
            None
            if arch.tie_word_embeddings
            else Linear(arch.hidden_size, arch.vocab_size, dtype=dtype)
        )
        self.tied_head = False
        self._format_logged = False

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
        rope = self.rotary.tables(positions, h.dtype)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            h = layer(rope, h, meta.for_layer(i), k_cache, v_cache)
        return self.norm(h)

    # ---- weights (HF names: the per-expert layout of the checkpoints) ----
    _MOE = "block_sparse_moe"  # the MoE block's module name
    _W = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", 0)}
    _ATTN = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qkvo])_(proj|norm)\.(weight|bias)$")
    _MOE_PART = re.compile(r"^model\.layers\.(\d+)\.(\w+)\.(?:experts\.(\d+)\.(\w+)|gate)\.weight$")
    _NORM = re.compile(
        r"^model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight$"
    )

    def weight_names(self) -> set[str]:
        """Every tensor (HF names, the per-expert layout) the checkpoint must provide."""
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if self.lm_head is not None and not self.tied_head:
            names.add("lm_head.weight")
        for i in range(self.arch.num_layers):
            p = f"model.layers.{i}."
            names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
            names |= {f"{p}self_attn.{x}_proj.weight" for x in "qkvo"}
            if self.arch.attention_bias:
                names |= {f"{p}self_attn.{x}_proj.bias" for x in "qkv"}
            if self.arch.o_proj_bias:
                names.add(f"{p}self_attn.o_proj.bias")
            if self.arch.qk_norm:
                names |= {f"{p}self_attn.{x}_norm.weight" for x in "qk"}
            names.add(f"{p}{self._MOE}.gate.weight")
            names |= {
                f"{p}{self._MOE}.experts.{e}.{w}.weight"
                for e in range(self.arch.num_experts)
                for w in self._W
            }
        return names

    def load_weight(self, name: str, w) -> None:
        """Load one tensor named as in a HF checkpoint (Mixtral: model.layers.3.block_sparse_moe.
        experts.5.w1.weight); GGUF files come here under the same names (gguf_loader)."""
        if (m := self._MOE_PART.match(name)) and m.group(2) == self._MOE:
            layer, _, expert, which = m.groups()
            moe = self.layers[int(layer)].mlp
            if expert is None:
                moe.load_gate(w)
                return
            if which not in self._W:
                raise KeyError(f"unexpected weight {name!r}")
            target, shard = self._W[which]
            linear = getattr(moe.experts[int(expert)], target)
            linear.load_weight(w, shard)
            self._log_expert_format(linear, gguf=hasattr(w, "qtype") or hasattr(w, "gguf_qtype"))
        elif m := self._ATTN.match(name):
            layer, proj, part, kind = m.groups()
            attn = self.layers[int(layer)].self_attn
            if part == "norm":  # Qwen3's per-head q/k norms
                if proj not in "qk" or getattr(attn, "q_norm", None) is None or kind != "weight":
                    raise KeyError(f"unexpected weight {name!r} (this model has no {proj}_norm)")
                getattr(attn, f"{proj}_norm").load_weight(w)
                return
            target, shard = ("o_proj", 0) if proj == "o" else ("qkv_proj", "qkv".index(proj))
            linear = getattr(attn, target)
            (linear.load_weight if kind == "weight" else linear.load_bias)(w, shard)
        elif m := self._NORM.match(name):
            getattr(self.layers[int(m.group(1))], m.group(2)).load_weight(w)
        elif name == "model.embed_tokens.weight":
            self.load_embedding(w)
        elif name == "lm_head.weight":
            if self.lm_head is not None and not self.tied_head:
                self.lm_head.load_weight(w)
        elif name == "model.norm.weight":
            self.norm.load_weight(w)
        elif "rotary_emb.inv_freq" in name:
            pass  # recomputed from rope_theta
        else:
            raise KeyError(f"unexpected weight {name!r}")

    def _log_expert_format(self, linear: Linear, gguf: bool) -> None:
        """Once, when the first expert weight is complete: how the experts run (dense, and why)."""
        if self._format_logged or hasattr(linear, "_staged"):
            return
        self._format_logged = True
        log.info(
            "experts: %d per layer, top %d per token, weights %s",
            self.arch.num_experts,
            self.arch.num_experts_per_tok,
            expert_format(linear, gguf),
        )


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    """Qwen3MoeForCausalLM: every layer sparse (decoder_sparse_step 1, no mlp_only_layers), no
    shared expert; q/k norms per head (arch.qk_norm), experts named mlp.experts.E.gate_proj."""

    _MOE = "mlp"
    _W = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
        "down_proj": ("down_proj", 0),
    }
