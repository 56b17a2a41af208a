"""Decode steps of a Llama-family model as one C call (kvserve/ops/csrc/decode_layers.c).

A decode-only step of a few requests is small work (a ~2 MiB layer of Q4 weights read once) run
as ~60 eager PyTorch ops per layer, whose dispatch cost as much as the matmuls on SmolLM2-135M
(~10 ms of a 25 ms step). When every linear holds GGUF-packed weights (quant.GgufMethod), the
whole layer stack runs in C instead: same weights, same math as LlamaForCausalLM.forward (its
tests compare the two), no Python between layers. Other steps (prompt chunks, mixed or larger
batches) take the PyTorch path.
"""
from __future__ import annotations

import ctypes

import torch

from kvserve.model.quant import GgufMethod
from kvserve.ops import cpu_kernels
from kvserve.ops.attention import AttentionMetadata, decode_plan


class FusedDecode:
    MAX_ROWS = GgufMethod.C_ROWS      # decode rows per step; larger batches favour the fp16 GEMM

    def __init__(self, model):
        self.model = model
        self._kv_caches = None         # the pools the layer table points at
        self._layers = None
        self._struct = None

    @classmethod
    def build(cls, model) -> FusedDecode | None:
        """A FusedDecode for `model`, or None when some part has no C path (not float32, a linear
        without packed GGUF weights, no C kernels)."""
        if not (cpu_kernels.available() and cpu_kernels.gguf_gemv_fast()) or model.dtype != torch.float32:
            return None
        attn = model.layers[0].self_attn
        if attn.num_heads // attn.num_kv_heads > cpu_kernels.MAX_GROUP or model.embed_tokens.weight.dtype != torch.float32:
            return None
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                if not isinstance(lin.quant_method, GgufMethod) or lin.gguf_packed is None:
                    return None
            if mlp.down_proj.bias is not None or mlp.gate_up_proj.bias is not None:
                return None
        return cls(model)

    def runs(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches) -> bool:
        """Whether this step is decode-only, small enough, and the KV pool float32 or int8."""
        if input_ids.shape[0] > self.MAX_ROWS or kv_caches[0][0].dtype not in (torch.float32, torch.int8):
            return False
        plan = decode_plan(meta, self.model.arch.sliding_window, input_ids.device)
        return plan is not None and plan.all_decodes

    def _bind(self, kv_caches) -> None:
        """The C tables of weights and pools (pointers into tensors that live as long as the model)."""
        m = self.model
        arch = m.arch
        layers = (cpu_kernels.DecodeLayer * len(m.layers))()

        def ptr(t):
            return None if t is None else t.data_ptr()
        for i, (layer, (k, v)) in enumerate(zip(m.layers, kv_caches, strict=True)):
            a, f = layer.self_attn, layer.mlp
            layers[i] = cpu_kernels.DecodeLayer(
                ptr(layer.input_layernorm.weight), ptr(layer.post_attention_layernorm.weight),
                ptr(a.qkv_proj.gguf_packed), ptr(a.o_proj.gguf_packed),
                ptr(f.gate_up_proj.gguf_packed), ptr(f.down_proj.gguf_packed),
                a.qkv_proj.gguf_kind, a.o_proj.gguf_kind, f.gate_up_proj.gguf_kind, f.down_proj.gguf_kind,
                ptr(a.qkv_proj.bias), ptr(a.o_proj.bias), ptr(k), ptr(v))
        a = m.layers[0].self_attn
        self._struct = cpu_kernels.DecodeModel(
            len(m.layers), arch.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, arch.intermediate_size,
            kv_caches[0][0].shape[1], a.sliding_window or 0, int(kv_caches[0][0].dtype == torch.int8),
            m.layers[0].input_layernorm.eps, a.scale,
            ptr(m.embed_tokens.weight), ptr(m.norm.weight), ptr(m.rotary.cos), ptr(m.rotary.sin),
            ctypes.cast(layers, ctypes.POINTER(cpu_kernels.DecodeLayer)))
        self._layers, self._kv_caches = layers, kv_caches

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches) -> torch.Tensor:
        if kv_caches is not self._kv_caches:
            self._bind(kv_caches)
        plan = decode_plan(meta, self.model.arch.sliding_window, input_ids.device)
        out = torch.empty(input_ids.shape[0], self.model.arch.hidden_size)
        cpu_kernels.decode_layers(self._struct, input_ids.contiguous(), positions.contiguous(),
                                  meta.slot_mapping.contiguous(), plan.tables, plan.lens, out)
        return out
