"""Building blocks: Linear (owns its weight through a quant method), RMSNorm (and Gemma's (1 + w)
variant), rotary embedding.

Loaders hand plain tensors (HF layout, [out, in]) to `Linear.load_weight`; a layer never parses a
file format. How a weight is stored and multiplied lives in the layer's `quant_method`:
`UnquantizedMethod` keeps a dense tensor in the model dtype; the packed int8/int4/GGUF methods
(kvserve.model.quant) use the same three hooks (create_weights, load, apply). A loader may hand
a `quant.BlockTensor` (GGUF blocks not yet dequantized) instead of a tensor: a method that cannot
use the blocks dequantizes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def dense(w) -> torch.Tensor:
    """A float tensor from a tensor or a kvserve.model.quant.BlockTensor."""
    return w if isinstance(w, torch.Tensor) else w.dequantize()


class UnquantizedMethod:
    """A dense [out, in] weight in the model dtype: y = x W^T + b."""

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        # torch.empty touches no memory: pages appear only when a loader writes them.
        layer.weight = nn.Parameter(
            torch.empty(layer.out_features, layer.in_features, dtype=dtype), requires_grad=False
        )

    def load(self, layer: Linear, w: torch.Tensor, offset: int, whole: bool) -> None:
        w = dense(w)
        if whole:  # take the tensor as it is (no copy when dtype already matches)
            layer.weight = nn.Parameter(w.to(layer.weight.dtype).contiguous(), requires_grad=False)
        else:  # one shard of a fused weight (q/k/v, gate/up): rows [offset, offset + n)
            layer.weight.data[offset : offset + w.shape[0]].copy_(w)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def dequantized(self, layer: Linear) -> torch.Tensor:
        return layer.weight.float()


class Linear(nn.Module):
    """y = x W^T + b. `out_features` may be a list: the output is those shards side by side
    (fused q/k/v or gate/up), and each shard is loaded separately with its index.

    `lora`: None, or the LoRA adapters of this layer (kvserve.lora.manager.LoRALinear), called
    with (x, y) to add each token's adapter delta to the output."""

    lora = None

    def __init__(
        self,
        in_features: int,
        out_features: int | list[int],
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        quant_method=None,
    ):
        super().__init__()
        self.shard_sizes = (
            list(out_features) if isinstance(out_features, (list, tuple)) else [out_features]
        )
        self.in_features = in_features
        self.out_features = sum(self.shard_sizes)
        self.quant_method = quant_method or UnquantizedMethod()
        self.quant_method.create_weights(self, dtype)
        self.bias = (
            nn.Parameter(torch.zeros(self.out_features, dtype=dtype), requires_grad=False)
            if bias
            else None
        )

    def _span(self, shard: int, rows: int) -> tuple[int, bool]:
        if rows != self.shard_sizes[shard]:
            raise ValueError(f"shard {shard} has {self.shard_sizes[shard]} rows, got {rows}")
        return sum(self.shard_sizes[:shard]), len(self.shard_sizes) == 1

    def load_weight(self, w: torch.Tensor, shard: int = 0) -> None:
        if w.shape[-1] != self.in_features:
            raise ValueError(
                f"weight has {w.shape[-1]} input features, layer wants {self.in_features}"
            )
        offset, whole = self._span(shard, w.shape[0])
        self.quant_method.load(self, w, offset, whole)

    def load_bias(self, b: torch.Tensor, shard: int = 0) -> None:
        if self.bias is None:
            raise ValueError("checkpoint has a bias for a layer built without one")
        offset, _ = self._span(shard, b.shape[0])
        self.bias.data[offset : offset + b.shape[0]].copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x)
        return y if self.lora is None else self.lora(x, y)

    def row_reader(self):
        """A function ids [R] -> float32 [R, in_features], the weight's rows read from its stored
        form, or None when the quant method keeps no form it reads rows from."""
        reader = getattr(self.quant_method, "row_reader", None)
        return reader(self) if reader is not None else None

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.shard_sizes}, bias={self.bias is not None}, "
            f"quant={type(self.quant_method).__name__}"
        )


class Embedding(nn.Module):
    """Token ids -> rows of `weight` [vocab, dim]. A tied model whose head keeps the embedding
    packed reads the rows from that head instead (`read_rows_with`) and keeps no dense copy; an
    untied one may keep the file's blocks packed itself (`load_packed`: `packed`, `kind`)."""

    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, dim, dtype=dtype), requires_grad=False
        )
        self.dtype = dtype
        self.rows = None  # ids [R] -> float32 [R, dim] in place of `weight` (read_rows_with)
        self.register_buffer("packed", None, persistent=False)  # load_packed's blocks
        self.kind = 0

    def load_packed(self, w) -> bool:
        """Keep GGUF blocks `w` packed (kvserve.ops.gguf_blocks) and read rows from them: the
        file's values, without a float32 copy of the whole table. False (nothing kept) when `w`
        is not blocks of a packed kind, the model is not float32, or no C kernels are built."""
        from kvserve.model import packed_cache
        from kvserve.ops import cpu_kernels
        from kvserve.ops.gguf_blocks import pack_gguf_parts, packed_kind

        qtype = getattr(w, "qtype", None)
        if (
            qtype is None
            or packed_kind(qtype) is None
            or self.dtype != torch.float32
            or not cpu_kernels.available()
        ):
            return False
        n, k = self.weight.shape
        if tuple(w.shape) != (n, k):
            raise ValueError(f"embedding is {(n, k)}, got {tuple(w.shape)}")
        packed, kind = packed_cache.pack([w], pack_gguf_parts)
        self.packed, self.kind = packed, kind
        isa = cpu_kernels.selected_isa()
        self.read_rows_with(lambda ids: cpu_kernels.gguf_rows(packed, kind, n, k, ids, isa=isa))
        return True

    def load_weight(self, w: torch.Tensor) -> None:
        w = dense(w)
        if w.shape != self.weight.shape:
            raise ValueError(f"embedding is {tuple(self.weight.shape)}, got {tuple(w.shape)}")
        self.weight = nn.Parameter(w.to(self.dtype).contiguous(), requires_grad=False)

    def read_rows_with(self, rows) -> None:
        """Look rows up with `rows` (ids [R] -> float32 [R, dim]); the dense weight is dropped."""
        self.weight = None
        self.rows = rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.rows is not None:
            return self.rows(ids.reshape(-1)).to(self.dtype).reshape(*ids.shape, -1)
        return F.embedding(ids, self.weight)


class TiedHeadMixin:
    """The LM head of a causal LM with an `embed_tokens` Embedding and an `lm_head` (None: tied,
    logits from the embedding's rows). A tied model may take a packed copy of the embedding as
    its head (`tie_quantized_head`): it is loaded from the embedding's weight, and when the head
    can give single rows back (Linear.row_reader) the lookup reads them there, so the weight is
    held once, packed."""

    lm_head: "Linear | None"
    tied_head: bool = False
    lora_step = None  # set by a LoRAManager on the model (a class default: a cheap lookup)

    def tie_quantized_head(self, head: Linear) -> None:
        self.lm_head = head
        self.tied_head = True

    def load_embedding(self, w) -> None:
        """The embedding's weight (and the tied head's, loaded from it)."""
        if self.tied_head:
            self.lm_head.load_weight(w)
            rows = self.lm_head.row_reader()
            if rows is not None:
                self.embed_tokens.read_rows_with(rows)
                return
        elif self.lm_head is not None and self.embed_tokens.load_packed(w):  # an untied head
            return
        self.embed_tokens.load_weight(w)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] in float32."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()


class RMSNorm(nn.Module):
    """x / rms(x) * w, computed in float32 (as Llama's reference does)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def load_weight(self, w: torch.Tensor) -> None:
        self.weight.data.copy_(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from kvserve.ops import triton_norm  # triton: imported only where it runs

            return triton_norm.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(
                x, self.weight.shape, self.weight, self.eps
            )  # one fused op, same math
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_and_norm(
        self, residual: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, norm(residual + delta)): the residual add and the next norm, one
        kernel on the GPU."""
        if residual.is_cuda:
            from kvserve.ops import triton_norm

            return triton_norm.add_rms_norm(residual, delta, self.weight, self.eps)
        h = residual + delta
        return h, self(h)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused in one matmul: SwiGLU with act = silu (Llama),
    GeGLU with act = gelu_tanh (Gemma)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act, dtype: torch.dtype):
        super().__init__()
        self.act = act
        self.gate_up_proj = Linear(hidden_size, [intermediate_size] * 2, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, dtype=dtype)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class OffsetRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w), computed in float32 and cast back (Gemma): checkpoints store w, the
    offset from 1. The layer keeps the float32 scale 1 + w, whatever the model dtype."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__(dim, eps, torch.float32)

    def load_weight(self, w: torch.Tensor) -> None:
        if w.shape != self.weight.shape:
            raise ValueError(f"norm weight is {tuple(self.weight.shape)}, got {tuple(w.shape)}")
        self.weight.data.copy_(1.0 + w.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding (float32), with optional scaling:
    - {"rope_type": "llama3", factor, low_freq_factor, high_freq_factor,
       original_max_position_embeddings}
    - {"rope_type": "linear", factor}
    - {"rope_type": "freq_factors", "factors": [...]}  (GGUF rope_freqs.weight: divides each
      frequency)
    - {"rope_type": "longrope", short_factor, long_factor, original_max_position_embeddings,
       context_len}  (Phi-3: per-frequency divisors, the long set when the served context_len
       exceeds the pretraining length; cos/sin are also scaled, rope_attention_factor)
    `head_dim`: the rotated dimensions (all of a head's, or partial_rotary_factor's share).
    """
    powers = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    inv_freq = 1.0 / powers
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if kind == "longrope":
        orig = scaling["original_max_position_embeddings"]
        long = scaling.get("context_len", orig) > orig
        ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        if ext.shape != inv_freq.shape:
            raise ValueError(
                f"longrope {'long' if long else 'short'}_factor has {ext.numel()} values, the "
                f"rotary embedding {inv_freq.numel()} frequencies (rotated dims / 2)"
            )
        return 1.0 / (ext * powers)
    if kind == "llama3":
        factor, low, high = (
            scaling["factor"],
            scaling["low_freq_factor"],
            scaling["high_freq_factor"],
        )
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(
        f"rope scaling {kind!r} is not supported (supported: llama3, linear, longrope)"
    )


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor cos and sin are multiplied by: LongRoPE's attention_factor (the loaders fill it
    in, as transformers or llama.cpp compute it), else 1."""
    if (scaling or {}).get("rope_type") != "longrope":
        return 1.0
    return float(scaling.get("attention_factor") or 1.0)


@dataclass(frozen=True)
class RopeTables:
    """One step's rotation (RotaryEmbedding.tables), the same type on every device. Without
    `positions`: cos and signed sin of the step's positions, [T, 1, head_dim] in the compute dtype.
    With `positions` (the GPU): cos and sin are the float32 [max_positions, head_dim] tables and
    the Triton kernel gathers the step's rows itself."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor | None = None


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, "rotate half" layout (HF Llama): dimension i pairs with
    i + head_dim/2. cos/sin are precomputed for every position up to max_positions.

    `tables(positions)` gathers a step's cos/sin once (every layer shares them); `apply` rotates
    queries and keys of all heads in one pass: x * cos + cat(x2, x1) * (-sin, sin).

    `cached=False` keeps no [max_positions, head_dim] tables (for long contexts and wide heads,
    where they would be hundreds of MB): each step computes its positions' rows, the same values
    (float32 position x inv_freq, as the tables hold).

    `head_dim` is the rotated width: a model with partial rotary passes its rotary_dim, and
    `apply` rotates the first rotary_dim dimensions of each head, passing the rest through."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict | None = None,
        cached: bool = True,
    ):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        self.attention_factor = rope_attention_factor(scaling)
        cos, sin = self._rows(torch.arange(max_positions)) if cached else (None, None)
        self.register_buffer("cos", cos, persistent=False)  # [max_positions, head_dim]
        self.register_buffer("sin", sin, persistent=False)  # sign of rotate_half folded in

    def _rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(positions.to(torch.float32), self.inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """The step's rotation, shared by every layer (RopeTables): its positions' cos and signed
        sin rows in `dtype`; on the GPU (cached tables) the float32 tables themselves and the
        positions, which the Triton kernel reads in place."""
        if positions.is_cuda and self.cos is not None:
            return RopeTables(self.cos, self.sin, positions)
        cos, sin = (
            (self.cos[positions], self.sin[positions])
            if self.cos is not None
            else self._rows(positions)
        )
        return RopeTables(cos[:, None, :].to(dtype), sin[:, None, :].to(dtype))

    @staticmethod
    def apply(x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
        """x: [T, H, D] -> x rotated by its token's position (a new tensor). Tables narrower
        than D (partial rotary) rotate the first dimensions and pass the others through."""
        rot = tables.cos.shape[-1]
        if rot != x.shape[-1]:
            return torch.cat(
                (RotaryEmbedding.apply(x[..., :rot].contiguous(), tables), x[..., rot:]), dim=-1
            )
        if tables.positions is not None:
            from kvserve.ops import triton_norm

            return triton_norm.rope(x, tables.positions, tables.cos, tables.sin)
        x1, x2 = x.chunk(2, dim=-1)
        return x * tables.cos + torch.cat((x2, x1), dim=-1) * tables.sin
