"""GGUF weights and hyper-parameters -> ModelArch and (HF name, tensor) pairs.

Block formats are dequantized to float32: Q4_0, Q4_1 and Q8_0 (the default model's) with torch
ops here (bit-identical to gguf.quants, and faster), everything else with
gguf.quants.dequantize.

llama.cpp's converter permutes the rows of Q and K for the "llama" architecture (its rope pairs
adjacent dimensions; HF's pairs i with i + head_dim/2). We undo that permutation on the raw
rows, so every loader hands the model the same HF layout. (Its "qwen2", "qwen3", "phi3" and
"gemma3" files keep HF's row order.) For "gemma3" it stores every norm weight as 1 + w; we hand
over HF's w.

With `keep_blocks` (the qtypes the chosen weight format keeps packed: quant.KEEP_BLOCKS, e.g. the
`gguf` format's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/IQ4_NL/IQ4_XS/Q3_K-Q6_K), matrices of those types are
handed over still packed (kvserve.model.quant.BlockTensor): the weight format takes the file's
blocks as they are.
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.model import gemma3, registry
from kvserve.model.arch import ModelArch
from kvserve.model.gguf_file import GGUFFile, GGUFTensor
from kvserve.model.quant import BlockTensor
from kvserve.ops.gguf_types import GGMLQuantizationType as Q


def dequantize_rows(raw: np.ndarray, qtype: Q) -> torch.Tensor:
    """[rows, bytes_per_row] uint8 -> [rows, elements_per_row] float32."""
    rows = raw.shape[0]
    b = torch.from_numpy(raw)
    if qtype == Q.F32:
        return b.view(torch.float32)
    if qtype in (Q.F16, Q.BF16):
        return b.view(torch.float16 if qtype == Q.F16 else torch.bfloat16).float()
    if qtype in (Q.Q4_0, Q.Q4_1):  # per 32 weights: f16 scale d, [f16 min m], 16 bytes of nibbles
        b = b.view(-1, 18 if qtype == Q.Q4_0 else 20)
        d = b[:, 0:2].contiguous().view(torch.float16).float()
        qs = b[:, -16:]
        q = torch.stack((qs & 0xF, qs >> 4), dim=1).view(-1, 32).float()  # low nibbles first
        if qtype == Q.Q4_0:
            return q.sub_(8).mul_(d).view(rows, -1)
        m = b[:, 2:4].contiguous().view(torch.float16).float()
        return q.mul_(d).add_(m).view(rows, -1)
    if qtype == Q.Q8_0:  # per 32 weights: f16 scale d, 32 int8
        b = b.view(-1, 34)
        d = b[:, 0:2].contiguous().view(torch.float16).float()
        return b[:, 2:].view(torch.int8).float().mul_(d).view(rows, -1)
    from gguf.constants import GGMLQuantizationType  # the package only for the types decoded by it
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(raw, GGMLQuantizationType(int(qtype))))


def load_tensor(g: GGUFFile, t: GGUFTensor, row_order: np.ndarray | None = None) -> torch.Tensor:
    """Dequantized float32 tensor in PyTorch shape (rows reordered by `row_order` first, if
    given)."""
    data = g.raw(t)
    if row_order is not None and len(t.shape) > 1:
        data = data[row_order]  # whole rows of blocks: works on packed data too
    out = dequantize_rows(data, t.qtype).reshape(t.shape)
    if row_order is not None and len(t.shape) == 1:
        out = out[torch.from_numpy(row_order)]  # a bias
    return out


# ---------------------------------------------------------------- hyper-parameters and names


def gguf_arch(g: GGUFFile) -> ModelArch:
    md = g.metadata
    a = md.get("general.architecture")
    name = registry.gguf_arch_name(a, g.path, md.get(f"{a}.expert_count", 0))
    hidden, heads = md[f"{a}.embedding_length"], md[f"{a}.attention.head_count"]
    head_dim = md.get(f"{a}.attention.key_length", hidden // heads)
    rope_dims = md.get(f"{a}.rope.dimension_count", head_dim)
    if rope_dims != head_dim and name != "phi3":
        raise ValueError(
            f"{g.path}: partial rotary ({rope_dims} of {head_dim} dims) is not supported"
        )
    vocab = md.get(f"{a}.vocab_size") or len(md["tokenizer.ggml.tokens"])
    scaling = None
    if "rope_freqs.weight" in g.tensors:  # llama3-style scaling stored as per-frequency divisors
        factors = load_tensor(g, g.tensors["rope_freqs.weight"]).flatten().tolist()
        scaling = {"rope_type": "freq_factors", "factors": factors}
    elif "rope_factors_long.weight" in g.tensors:  # Phi-3 LongRoPE: both factor sets
        scaling = _longrope(g, a)
    elif md.get(f"{a}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": md[f"{a}.rope.scaling.factor"]}
    elif md.get(f"{a}.rope.scaling.type") not in (None, "none"):
        raise ValueError(
            f"{g.path}: rope scaling {md[f'{a}.rope.scaling.type']!r} is not supported "
            "(supported: linear, llama3 rope_freqs)"
        )
    eos = md.get("tokenizer.ggml.eos_token_id")
    layers = md[f"{a}.block_count"]
    window = md.get(f"{a}.attention.sliding_window") or None  # 0: none (llama.cpp's Phi-3)
    arch = ModelArch(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=md.get(f"{a}.attention.head_count_kv", heads),
        head_dim=head_dim,
        intermediate_size=md[f"{a}.feed_forward_length"],
        vocab_size=vocab,
        max_position_embeddings=md[f"{a}.context_length"],
        rope_theta=float(md.get(f"{a}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(md[f"{a}.attention.layer_norm_rms_epsilon"]),
        tie_word_embeddings="output.weight" not in g.tensors,
        attention_bias="blk.0.attn_q.bias" in g.tensors,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids={eos} if eos is not None else set(),
        sliding_window=window,
        num_experts=md.get(f"{a}.expert_count", 0),
        num_experts_per_tok=md.get(f"{a}.expert_used_count", 0),
    )
    arch.qk_norm = name in ("qwen3", "qwen3_moe")
    if name == "qwen3_moe":  # the experts' width; llama.cpp renormalizes the top k
        arch.intermediate_size = md[f"{a}.expert_feed_forward_length"]
        arch.norm_topk_prob = bool(md.get(f"{a}.expert_weights_norm", True))
    if name == "qwen2_moe":  # llama.cpp's qwen2moe keeps the top k's softmax weights as they are
        arch.intermediate_size = md[f"{a}.expert_feed_forward_length"]
        arch.shared_expert_size = md.get(f"{a}.expert_shared_feed_forward_length", 0)
        arch.norm_topk_prob = False
    scale = md.get(f"{a}.expert_weights_scale", 0.0)
    if scale not in (0.0, 1.0):
        raise ValueError(f"{g.path}: expert_weights_scale {scale} is not supported (only 1)")
    if name == "phi3":
        arch.rotary_dim = rope_dims if rope_dims != head_dim else None
    if name == "gemma3":
        arch.sliding_window = None
        # Not in the file: every sixth layer global (rope.freq_base), the others local (base 10k).
        arch.layer_windows = gemma3.layer_windows(layers, window)
        arch.rope_local_theta = gemma3.LOCAL_ROPE_BASE
        # llama.cpp's rule: Gemma 3 27B (62 layers) scales by hidden/heads, the others by head_dim.
        arch.query_pre_attn_scalar = hidden // heads if layers == 62 else head_dim
    return arch


def _longrope(g: GGUFFile, a: str) -> dict:
    """Phi-3's LongRoPE from llama.cpp's file: rope_factors_short/long tensors, the pretraining
    length and the attention factor its converter computed."""
    md = g.metadata
    orig_key = f"{a}.rope.scaling.original_context_length"
    if orig_key not in md or "rope_factors_short.weight" not in g.tensors:
        raise ValueError(
            f"{g.path}: rope_factors_long.weight needs rope_factors_short.weight and {orig_key}"
        )
    return {
        "rope_type": "longrope",
        "long_factor": load_tensor(g, g.tensors["rope_factors_long.weight"]).flatten().tolist(),
        "short_factor": load_tensor(g, g.tensors["rope_factors_short.weight"]).flatten().tolist(),
        "original_max_position_embeddings": md[orig_key],
        "attention_factor": float(md.get(f"{a}.rope.scaling.attn_factor", 1.0)),
    }


_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Per architecture, GGUF block tensor -> HF module. The norms differ: in "llama" ffn_norm is the
# norm before the MLP, HF's post_attention_layernorm; Gemma 3 has four norms per layer and q/k
# norms.
_BLOCK = {
    "llama": {**_LINEARS, "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"},
    "gemma3": {
        **_LINEARS,
        "attn_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    },
}
_BLOCK["qwen2"] = _BLOCK["mistral"] = _BLOCK["llama"]
# Qwen3: the Llama names plus per-head q/k norms. Phi-3: q/k/v in one tensor (attn_qkv), gate and
# up in ffn_up (gate rows first), as HF's qkv_proj / gate_up_proj; the model splits them.
_BLOCK["qwen3"] = {
    **_BLOCK["llama"],
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_BLOCK["phi3"] = {
    **_BLOCK["llama"],
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}
# Mixtral: the router, and the experts' stacked [E, rows, cols] tensors (split by _experts) or,
# in older files, one tensor per expert (blk.N.ffn_gate.E.weight).
_BLOCK["mixtral"] = {**_BLOCK["llama"], "ffn_gate_inp": "block_sparse_moe.gate"}
_BLOCK["qwen3_moe"] = {**_BLOCK["qwen3"], "ffn_gate_inp": "mlp.gate"}
# Qwen2-MoE: Qwen2's names (q/k/v biases), the router, and a shared expert with its sigmoid gate
# (ffn_gate_inp_shexp: [H] in llama.cpp's files, HF's [1, H]).
_BLOCK["qwen2_moe"] = {
    **_BLOCK["qwen2"],
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Per MoE architecture: the HF module of the experts, and GGUF expert tensor -> HF weight.
_EXPERTS = {
    "mixtral": ("block_sparse_moe", {"ffn_gate": "w1", "ffn_up": "w3", "ffn_down": "w2"}),
    "qwen3_moe": ("mlp", {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}),
}
_EXPERTS["qwen2_moe"] = _EXPERTS["qwen3_moe"]


def hf_name(gguf_name: str, arch_name: str = "llama") -> str | None:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight (None: not a model weight)."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    block = _BLOCK[arch_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in block:
        return f"model.layers.{parts[1]}.{block[parts[2]]}.{parts[3]}"
    if arch_name in _EXPERTS and len(parts) == 5 and parts[2] in _EXPERTS[arch_name][1]:
        moe, names = _EXPERTS[arch_name]
        return f"model.layers.{parts[1]}.{moe}.experts.{parts[3]}.{names[parts[2]]}.{parts[4]}"
    if gguf_name in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
        return None  # read into ModelArch.rope_scaling
    raise KeyError(f"unexpected GGUF tensor {gguf_name!r} for architecture {arch_name!r}")


def unpermute_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's Q/K permutation: within each head, GGUF stores the
    rotary pairs interleaved (row 2j, 2j+1); HF stores them as halves (row j, j + head_dim/2)."""
    head_dim = n_rows // n_heads
    return np.arange(n_rows).reshape(n_heads, head_dim // 2, 2).transpose(0, 2, 1).reshape(-1)


def iter_gguf_weights(g: GGUFFile, arch: ModelArch, keep_blocks=()):
    """Yield (hf_name, float32 tensor) for every model weight in the file; tensors whose qtype is
    in `keep_blocks` come as quant.BlockTensor (the raw blocks, rows already in HF order)."""
    for name, t in g.tensors.items():
        if arch.name in _EXPERTS and name.endswith("_exps.weight"):
            yield from _experts(g, t, arch.name, keep_blocks)
            continue
        target = hf_name(name, arch.name)
        if target is None:
            continue
        if arch.name == "gemma3" and "norm" in target:
            yield target, load_tensor(g, t) - 1.0  # the file's 1 + w -> HF's w
            continue
        if target.endswith("shared_expert_gate.weight"):  # one row, kept dense: [H] -> [1, H]
            yield target, load_tensor(g, t).reshape(1, -1)
            continue
        order = None
        if arch.name in ("llama", "mixtral") and (".attn_q." in name or ".attn_k." in name):
            heads = arch.num_heads if ".attn_q." in name else arch.num_kv_heads
            order = unpermute_rows(t.shape[0], heads)
        if t.qtype in keep_blocks and len(t.shape) == 2:
            data = g.raw(t)
            yield target, BlockTensor(data[order] if order is not None else data, t.qtype, t.shape)
        else:
            w = load_tensor(g, t, order)
            w.gguf_qtype = t.qtype  # the file's type: a weight format names it when kept dense
            yield target, w


def _experts(g: GGUFFile, t: GGUFTensor, arch_name: str, keep_blocks):
    """A stacked expert tensor blk.N.ffn_{gate,up,down}_exps.weight [E, rows, cols] -> one
    (HF name, weight) per expert: blocks (quant.BlockTensor) when its qtype is in `keep_blocks`,
    so each expert's Linear takes them as a 2-D weight, else float32."""
    _, layer, kind, _ = t.name.split(".")
    moe, names = _EXPERTS[arch_name]
    w = names.get(kind.removesuffix("_exps"))
    if w is None or len(t.shape) != 3:
        raise KeyError(f"unexpected GGUF expert tensor {t.name!r} of shape {t.shape}")
    experts, rows, cols = t.shape
    data = g.raw(t)  # [experts * rows, bytes per row]
    for e in range(experts):
        target = f"model.layers.{layer}.{moe}.experts.{e}.{w}.weight"
        part = data[e * rows : (e + 1) * rows]
        if t.qtype in keep_blocks:
            yield target, BlockTensor(part, t.qtype, (rows, cols))
        else:
            out = dequantize_rows(part, t.qtype).reshape(rows, cols)
            out.gguf_qtype = t.qtype
            yield target, out
