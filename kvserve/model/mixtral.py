"""Mixture-of-experts models: the Llama attention with a sparse mixture of SwiGLU experts in
place of the MLP. Mixtral, Qwen3-MoE (Qwen3's per-head q/k norms, arch.qk_norm), and Qwen2-MoE
(q/k/v biases, and a shared expert every token runs, scaled by sigmoid(x @ g) with its own
gate vector g, added to the routed experts' sum).

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
    GatedMLP,
    Linear,
    UnquantizedMethod,
    dense,
)
from kvserve.model.llama import LlamaForCausalLM

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


class SharedExpertMoE(SparseMoE):
    """SparseMoE plus Qwen2-MoE's shared expert: a SwiGLU of width arch.shared_expert_size that
    every token runs, scaled per token by sigmoid(x @ shared_expert_gate^T) (dense, [1, H])."""

    def __init__(self, arch: ModelArch, dtype: torch.dtype):
        super().__init__(arch, dtype)
        self.shared_expert = GatedMLP(arch.hidden_size, arch.shared_expert_size, F.silu, dtype)
        self.shared_expert_gate = nn.Parameter(
            torch.empty(1, arch.hidden_size, dtype=dtype), requires_grad=False
        )

    def load_shared_gate(self, w) -> None:
        w = dense(w).reshape(-1, w.shape[-1])
        if w.shape != self.shared_expert_gate.shape:
            raise ValueError(
                f"shared expert gate is {tuple(self.shared_expert_gate.shape)}, "
                f"got {tuple(w.shape)}"
            )
        self.shared_expert_gate.data.copy_(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(F.linear(x, self.shared_expert_gate)) * self.shared_expert(x)
        return super().forward(x) + shared


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


class MixtralForCausalLM(LlamaForCausalLM):
    """The Llama model with a SparseMoE in each layer's `mlp`; its own checkpoint names.
    Subclasses change only those names (`_MOE`, `_W`)."""

    # Tensor parallelism cuts every expert's width (runner/tensor_parallel.py); pipeline stages
    # keep whole layers.
    supports_parallel = True

    def __init__(
        self, arch: ModelArch, dtype: torch.dtype = torch.float32, max_positions: int | None = None
    ):
        if arch.num_experts <= 0:
            raise ValueError(f"{arch.name}: a mixture-of-experts model needs num_experts > 0")
        super().__init__(arch, dtype, max_positions)
        self._format_logged = False

    def make_mlp(self, arch: ModelArch, dtype: torch.dtype) -> nn.Module:
        return SparseMoE(arch, dtype)

    # ---- weights (HF names: the per-expert layout of the checkpoints) ----
    _MOE = "block_sparse_moe"  # the MoE block's module name
    _W = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", 0)}
    _MOE_PART = re.compile(r"^model\.layers\.(\d+)\.(\w+)\.(?:experts\.(\d+)\.(\w+)|gate)\.weight$")

    def mlp_weight_names(self, p: str) -> set[str]:
        """The router and the experts of a layer (the per-expert layout of the checkpoints)."""
        return {f"{p}{self._MOE}.gate.weight"} | {
            f"{p}{self._MOE}.experts.{e}.{w}.weight"
            for e in range(self.arch.num_experts)
            for w in self._W
        }

    def load_weight(self, name: str, w) -> None:
        """Load one tensor named as in a HF checkpoint (Mixtral: model.layers.3.block_sparse_moe.
        experts.5.w1.weight); GGUF files come here under the same names (gguf_loader). All but
        the router and the experts load as the Llama model's."""
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
        elif ".mlp." in name:
            raise KeyError(f"unexpected weight {name!r} (the experts are under {self._MOE})")
        else:
            super().load_weight(name, w)

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


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen2MoeForCausalLM (Qwen1.5-MoE, Qwen2-57B-A14B): every layer sparse, experts named as
    Qwen3-MoE's, q/k/v biases (arch.attention_bias), no q/k norms, and a shared expert per layer
    (mlp.shared_expert.{gate,up,down}_proj, mlp.shared_expert_gate) beside the routed ones."""

    _SHARED = re.compile(
        r"^model\.layers\.(\d+)\.mlp\.(?:shared_expert\.(gate_proj|up_proj|down_proj)|"
        r"(shared_expert_gate))\.weight$"
    )

    def __init__(
        self, arch: ModelArch, dtype: torch.dtype = torch.float32, max_positions: int | None = None
    ):
        if arch.shared_expert_size <= 0:
            raise ValueError(
                f"{arch.name}: Qwen2-MoE needs shared_expert_intermediate_size > 0, got "
                f"{arch.shared_expert_size}"
            )
        super().__init__(arch, dtype, max_positions)

    def make_mlp(self, arch: ModelArch, dtype: torch.dtype) -> nn.Module:
        return SharedExpertMoE(arch, dtype)

    def mlp_weight_names(self, p: str) -> set[str]:
        shared = {f"{p}mlp.shared_expert.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj")}
        return super().mlp_weight_names(p) | shared | {f"{p}mlp.shared_expert_gate.weight"}

    def load_weight(self, name: str, w) -> None:
        m = self._SHARED.match(name)
        if m is None:
            super().load_weight(name, w)
            return
        layer, proj, gate = m.groups()
        moe = self.layers[int(layer)].mlp
        if gate:
            moe.load_shared_gate(w)
            return
        target, shard = self._W[proj]
        getattr(moe.shared_expert, target).load_weight(w, shard)
