"""Whole steps of a Llama-family model as one C call (kvserve/ops/csrc/layer_stack.c), Qwen3's
q/k norms and Phi-3's partial rotary and LongRoPE tables included.

When every linear of the model holds GGUF-packed weights (quant.GgufMethod; a dense float32
model's are packed so at start, quant.gguf.pack_dense_model) and the C kernels are built, the
runner's step backend (runner/backends/layer_stack.py) sends every step here, prompt chunks and
decodes alike: same weights and same math as LlamaForCausalLM.forward (tests compare the two),
no Python between layers, and each token's numbers computed on their own in a fixed order, so a
request's tokens at temperature 0 do not depend on the thread count, on how its prompt was
chunked, on what else shares the step, nor on the ISA build. Other models (int4/int8 weights,
bf16, families it does not run) take the PyTorch forward; `refusal()` names what keeps one off
and the setting that brings it back.

LoRA adapters (--enable-lora) run here too: the model's LoRAManager (model.lora_step) holds each
targeted linear's stacked A and scaled B per slot; the C side gets them as a table per layer,
linear and slot (rebuilt whenever an adapter is loaded or unloaded) and each token's slot per step.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.quant import GgufMethod
from kvserve.model.quant.gguf import FLOAT_ACTS, pack_dense_model, packed_linear
from kvserve.ops import cpu_kernels
from kvserve.ops.attention import AttentionMetadata


class CLayerStack:
    def __init__(self, model: LlamaForCausalLM, parts: str = "two"):
        self.model = model
        self.isa = cpu_kernels.selected_isa()  # the kernel build, fixed for the engine's life
        self.parts = parts  # the activations' 8-bit parts (cpu_kernels.ACT_PARTS); other than
        # "two" (gguf-a8, gguf-mixed): every token on the integer GEMV; FLOAT_ACTS (a dense
        # float32 model, pack_dense_model): every token on the float32 GEMM
        self._kv_caches = None  # the pools the layer table points at
        self._layers = None
        self._struct = None
        self._lora_key = None  # (struct, manager version) the LoRA table was built for
        self._lora_table = None  # the StackLora array and the tensors it points into

    @classmethod
    def build(cls, model) -> CLayerStack | None:
        """A CLayerStack for `model`, or None when some part has no C path (declined() says
        which)."""
        return cls.build_with_reason(model)[0]

    @classmethod
    def build_with_reason(cls, model, kv_caches=None) -> tuple[CLayerStack | None, Refusal | None]:
        """(a CLayerStack, None) for `model` (and its KV pools when given), or (None, why not):
        the tensor or condition that keeps it on the PyTorch forward and the setting that brings
        it back, for the start-up log. A model the stack takes but for its dense float32 linears
        (--quantization none) is packed for it first (pack_dense_model: float32 GEMMs whose sums
        keep one order, whatever the batch)."""
        why = cls.refusal(model)
        if why is not None and why.fix == GGUF_FIX:
            declined = pack_dense_model(model)
            if declined is None:
                why = cls.refusal(model)
            elif packed_linear(model) is None:  # dense, yet not packed: say why
                why = Refusal(f"dense weights not packed for it: {declined}", GGUF_FIX)
        if why is None and kv_caches is not None and not cls.runs(kv_caches):
            why = Refusal(
                f"the KV cache is {kv_caches[0][0].dtype}; the C attention reads float32, "
                "float16 or int8 rows (--kv-cache-dtype)",
                "--kv-cache-dtype float32, float16 or int8",
            )
        return (None, why) if why else (cls(model, parts=_act_parts(model)), None)

    @staticmethod
    def declined(model) -> str | None:
        """Why `model` cannot run as a C layer stack, naming the tensor or condition (None: it
        can): not a Llama-family float32 model, no C kernels, a linear without packed GGUF
        weights (and the reason it was kept dense), biases the stack does not take."""
        why = CLayerStack.refusal(model)
        return None if why is None else why.why

    @staticmethod
    def refusal(model) -> Refusal | None:
        """declined(), with the setting that gets the stack back where one does."""
        experts = getattr(getattr(model, "arch", None), "num_experts", 0)
        if experts:
            return Refusal(
                f"{experts} experts per layer (mixture of experts): the C stack runs dense MLPs"
            )
        if not isinstance(model, LlamaForCausalLM):
            return Refusal(f"{type(model).__name__} is not a Llama-family model")
        if model.dtype != torch.float32:
            return Refusal(
                f"the model computes in {model.dtype}, the C stack in float32", "--dtype float32"
            )
        if not cpu_kernels.available():
            return Refusal(
                "the C kernels are not built (no C compiler)",
                "a C compiler (cc) on the PATH, so that the kernels build at start",
            )
        attn = model.layers[0].self_attn
        if attn.num_heads // attn.num_kv_heads > cpu_kernels.MAX_GROUP:
            return Refusal(
                f"{attn.num_heads // attn.num_kv_heads} query heads per KV head, more than "
                f"{cpu_kernels.MAX_GROUP}"
            )
        embed = model.embed_tokens.weight
        if (
            embed is None
            and model.embed_tokens.packed is None
            and not (model.tied_head and getattr(model.lm_head, "gguf_packed", None) is not None)
        ):
            return Refusal(
                "the embedding's rows are read from a head that is not one packed matrix"
            )
        if embed is not None and embed.dtype != torch.float32:
            return Refusal(f"the embedding is {embed.dtype}")
        for i, layer in enumerate(model.layers):
            why = _layer_refusal(i, layer)
            if why is not None:
                return why
        if len({lin.quant_method.parts for lin in _linears(model)}) != 1:
            return Refusal(
                "the linears quantize activations differently (one precision for the whole stack)"
            )
        return None

    @staticmethod
    def runs(kv_caches) -> bool:
        """Whether the KV pool is one the C attention reads (float32, float16 or int8 rows)."""
        return kv_caches[0][0].dtype in cpu_kernels.KV_FORMATS

    def _bind(self, kv_caches) -> None:
        """The C tables of weights and pools (pointers into tensors that live as long as the
        model)."""
        m = self.model
        arch = m.arch
        layers = (cpu_kernels.StackLayer * len(m.layers))()

        def ptr(t):
            return None if t is None else t.data_ptr()

        def part(lin):
            w, kind, rows = lin.gguf_parts[0]
            return cpu_kernels.StackPart(w.data_ptr(), kind, rows)

        def parts(lin):
            out = (cpu_kernels.StackPart * cpu_kernels.STACK_MAX_PARTS)()
            for j, (w, kind, rows) in enumerate(lin.gguf_parts):
                out[j] = cpu_kernels.StackPart(w.data_ptr(), kind, rows)
            return out

        for i, (layer, (k, v)) in enumerate(zip(m.layers, kv_caches, strict=True)):
            a, f = layer.self_attn, layer.mlp
            layers[i] = cpu_kernels.StackLayer(
                ptr(layer.input_layernorm.weight),
                ptr(layer.post_attention_layernorm.weight),
                parts(a.qkv_proj),
                part(a.o_proj),
                parts(f.gate_up_proj),
                part(f.down_proj),
                ptr(a.qkv_proj.bias),
                ptr(a.o_proj.bias),
                ptr(k),
                ptr(v),
                ptr(a.q_norm.weight) if a.q_norm is not None else None,  # Qwen3
                ptr(a.k_norm.weight) if a.k_norm is not None else None,
            )
        a = m.layers[0].self_attn
        self._struct = cpu_kernels.StackModel(
            len(m.layers),
            arch.hidden_size,
            a.num_heads,
            a.num_kv_heads,
            a.head_dim,
            arch.intermediate_size,
            kv_caches[0][0].shape[1],
            a.sliding_window or 0,
            cpu_kernels.kv_format(kv_caches[0][0].dtype),
            m.layers[0].input_layernorm.eps,
            a.scale,
            ptr(m.embed_tokens.weight),  # None: rows from packed blocks (its own or the head's)
            *self._embed_packed(),
            ptr(m.norm.weight),
            ptr(m.rotary.cos),
            ptr(m.rotary.sin),
            ctypes.cast(layers, ctypes.POINTER(cpu_kernels.StackLayer)),
            cpu_kernels.ACT_PARTS["two" if self.parts == FLOAT_ACTS else self.parts],
            m.rotary.cos.shape[1],  # rotated dims (partial rotary: fewer than head_dim)
        )
        self._layers, self._kv_caches = layers, kv_caches
        self._lora_key = None  # a new struct: its LoRA table is set on the next step with adapters

    def _embed_packed(self) -> tuple:
        """(pointer, kind) of the packed blocks the embedding's rows are read from, if any."""
        e, head = self.model.embed_tokens, self.model.lm_head
        if e.weight is not None:
            return None, 0
        if e.packed is not None:
            return e.packed.data_ptr(), e.kind
        return head.gguf_packed.data_ptr(), head.gguf_kind

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches,
        out_rows: torch.Tensor,
        prompt_lens: list[int],
        h_in: torch.Tensor | None = None,
        final_norm: bool = True,
    ) -> torch.Tensor:
        """Run every layer on the flat batch; returns the final-normed hidden states of the rows
        `out_rows` (int64), [len(out_rows), hidden]. `prompt_lens`: each sequence's prompt
        length; its tokens at positions below it are prompt tokens (their linears run the float32
        GEMM, the others the integer GEMV; a generated token recomputed after preemption is not
        one; see csrc/gguf_gemv.h). With parts other than "two" every token runs the integer
        GEMV, with FLOAT_ACTS the float32 GEMM. A pipeline stage (a model holding only its
        layers): `h_in` [T, hidden], the previous stage's hidden states, replaces the embedding,
        and final_norm=False returns the rows unnormed, for the next stage."""
        if kv_caches is not self._kv_caches:
            self._bind(kv_caches)
        qsl = meta.query_start_loc
        q_lens = torch.tensor([qsl[b + 1] - qsl[b] for b in range(meta.num_seqs)], dtype=torch.long)
        seq = torch.repeat_interleave(torch.arange(meta.num_seqs, dtype=torch.long), q_lens)
        if self.parts == FLOAT_ACTS:
            prompt = torch.ones(positions.shape[0], dtype=torch.bool)
        else:
            prompt = positions < torch.repeat_interleave(
                torch.tensor(prompt_lens, dtype=torch.long), q_lens
            )
        out = torch.empty(out_rows.shape[0], self.model.arch.hidden_size)
        lora_slots = self._lora_slots(input_ids.shape[0])
        cpu_kernels.layer_stack(
            self._struct,
            input_ids.contiguous(),
            positions.contiguous(),
            meta.slot_mapping.contiguous(),
            seq,
            prompt,
            meta.block_tables.contiguous(),
            out_rows.contiguous(),
            out,
            isa=self.isa,
            h_in=None if h_in is None else h_in.contiguous(),
            final_norm=final_norm,
            lora_slots=lora_slots,
        )
        return out

    def _lora_slots(self, T: int) -> torch.Tensor | None:
        """This step's per-token adapter slots for the C call (None: every token is the base
        model's), the LoRA table brought up to date with the loaded adapters first."""
        step = getattr(self.model, "lora_step", None)
        if step is None or not step.groups:
            return None
        if step.indices is None or step.indices.shape[0] != T:
            n = 0 if step.indices is None else step.indices.shape[0]
            raise RuntimeError(f"LoRA step holds {n} token slots, the C stack got {T} tokens")
        manager = step.manager
        key = (id(self._struct), manager.version)
        if key != self._lora_key:
            self._lora_table = _lora_table(self.model, manager.max_loras)
            table = self._lora_table[0]
            self._struct.lora = ctypes.cast(table, ctypes.POINTER(cpu_kernels.StackLora))
            self._struct.lora_slots = manager.max_loras
            self._lora_key = key
        return step.indices.to(torch.int64).contiguous()


class Refusal(NamedTuple):
    """Why the C layer stack does not run a model, and the setting that brings it back (None:
    none does; the model's family or shape)."""

    why: str
    fix: str | None = None


GGUF_FIX = "a GGUF file with --quantization gguf-mixed (its default), gguf-a8 or gguf"


def _layer_refusal(i: int, layer) -> Refusal | None:
    attn, mlp = layer.self_attn, layer.mlp
    for name, lin in (
        ("attn qkv", attn.qkv_proj),
        ("attn o", attn.o_proj),
        ("mlp gate_up", mlp.gate_up_proj),
        ("mlp down", mlp.down_proj),
    ):
        if not isinstance(lin.quant_method, GgufMethod):
            method = type(lin.quant_method).__name__
            return Refusal(f"layer {i} {name}: weights in {method}, not GGUF blocks", GGUF_FIX)
        if not lin.gguf_parts:
            why = lin.dense_reason or "not packed"
            for j, shard in enumerate(_SHARDS.get(name, ())):  # "part 2:" -> "part v:"
                why = why.replace(f"part {j}:", f"part {shard}:")
            return Refusal(f"layer {i} {name}: kept dense ({why})")
        if name in ("attn o", "mlp down") and len(lin.gguf_parts) != 1:
            parts = len(lin.gguf_parts)
            return Refusal(f"layer {i} {name}: {parts} packed parts, the stack takes one")
    if mlp.down_proj.bias is not None or mlp.gate_up_proj.bias is not None:
        return Refusal(f"layer {i}: the MLP has biases")
    return None


_SHARDS = {"attn qkv": ("q", "k", "v"), "mlp gate_up": ("gate", "up")}  # fused shards, in order


def _linears(model):
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        yield from (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)


def _lora_table(model, slots: int) -> tuple:
    """(StackLora array [layers][LORA_LINEARS][slots], the bfloat16 tensors it points into) from
    the adapters installed on the model's linears (lora/manager.py's LoRALinear slots, whose
    values are bfloat16 values already: the conversion is exact). Each B^T [r, width] is stored
    by blocks of `cols` columns, each block [r, its columns] contiguous (csrc/lora_delta.h)."""
    n, cols = cpu_kernels.LORA_LINEARS, 64  # LORA_COLS in csrc/lora_delta.h
    table = (cpu_kernels.StackLora * (len(model.layers) * n * slots))()
    keep = []
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for j, lin in enumerate((attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            lora = getattr(lin, "lora", None)
            for s in range(slots):
                entry = None if lora is None else lora.slots.get(s)
                if entry is None:
                    continue
                a_t, plan = entry  # A^T [in, sum of ranks], per part B^T [r, width] scaled
                a_t = a_t.to(torch.bfloat16).contiguous()
                e = table[(i * n + j) * slots + s]
                e.a, e.rank = a_t.data_ptr(), a_t.shape[1]
                keep.append(a_t)
                for p, (offset, width, r0, r, b_t) in enumerate(plan):
                    b_t = b_t.to(torch.bfloat16)
                    full = width // cols * cols
                    blocks = b_t[:, :full].reshape(r, full // cols, cols).transpose(0, 1)
                    b_t = torch.cat([blocks.reshape(-1), b_t[:, full:].reshape(-1)])
                    keep.append(b_t)
                    e.b[p] = b_t.data_ptr()
                    e.off[p], e.width[p], e.r0[p], e.r[p] = offset, width, r0, r
    return table, keep


def _act_parts(model) -> str:
    return next(_linears(model)).quant_method.parts
