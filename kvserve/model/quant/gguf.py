"""gguf: the file's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, IQ4_XS and the K-quants Q2_K,
Q3_K, Q4_K, Q5_K, Q6_K) and float weights (F32, F16, BF16), run by the C kernel
(ops/csrc/gguf_gemv.c)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.model import packed_cache
from kvserve.model.layers import Linear, UnquantizedMethod, dense
from kvserve.model.quant.base import _PackedMethod
from kvserve.model.quant.blocks import BlockTensor
from kvserve.ops import cpu_kernels
from kvserve.ops.gguf_blocks import (
    FLOAT_KIND,
    FLOAT_TYPES,
    pack_float_parts,
    pack_gguf_parts,
    packed_kind,
    unpack_gguf_rows,
)
from kvserve.ops.gguf_types import GGMLQuantizationType

FLOAT_ACTS = "float"  # GgufMethod's parts for float32 activations on every token (no 8-bit parts)


class GgufMethod(_PackedMethod):
    """The file's blocks, decoded without changing a value and interleaved 16 rows at a time
    (kvserve.ops.gguf_blocks: Q4_0/Q4_1 as 4-bit kind 4, Q8_0/Q5_0/IQ4_NL as 8-bit kind 8, Q4_K
    as 4-bit kind 14, Q5_K as 5-bit kind 15, Q6_K as 6-bit kind 26, Q3_K as 3-bit kind 13,
    IQ4_XS as kind 24 (its 4-bit indices), Q2_K as kind 10, all with the file's super-block
    scales, Q5_1 as kind 19, F16 and BF16 tensors in their 16 bits as kinds 33 and 34, F32 ones
    (and fused shards of mixed float types) as float32 kind 32) and run by the C kernel
    kvserve/ops/csrc/gguf_gemv.c
    at every batch size, on every ISA build: integer dot products of the weights with the
    activations as two 8-bit parts per block of 32 (~15 bits), weights read once per call for any
    number of rows. No other copy of the weights exists. Fused shards (q/k/v, gate/up) pack
    together when their types share a kind (Q5_0 with Q8_0); shards of different kinds (Q4_K_M's
    Q6_K v beside Q4_K q and k) pack as consecutive parts, one per run of a kind, each run by the
    kernel into its own output columns (`gguf_parts`: the same bits as one matrix, row for row). A
    weight the loader has already dequantized (a type without a kind, such as IQ2_XXS, or a float
    checkpoint that is not a GGUF file) stays a dense float32 tensor, and `dense_reason` says why.

    Used when the C kernels are built (cpu_kernels.available()); otherwise the gguf format falls
    back to torch kernels (kvserve.model.quant.method_for).

    parts (cpu_kernels.ACT_PARTS, csrc/gguf_gemv.h): "two" (the gguf format); "one" (gguf-a8),
    the activations as one 8-bit part per block, llama.cpp's precision, at half the integer work;
    "mixed" (gguf-mixed), one part except in the blocks whose second part carries enough (an
    outlier's block), close to one part's work at well inside the quality bound. With one or mixed
    parts the layer stack runs prompt tokens through the integer GEMV too (csrc/layer_stack.c).
    FLOAT_ACTS ("float"): float32 activations for every token, through the float32 GEMM (a dense
    float32 model packed for the C kernels, pack_dense_model)."""

    def __init__(self, parts: str = "two"):
        if parts not in (*cpu_kernels.ACT_PARTS, FLOAT_ACTS):
            choices = sorted((*cpu_kernels.ACT_PARTS, FLOAT_ACTS))
            raise ValueError(f"parts must be one of {choices}, got {parts!r}")
        self.isa = cpu_kernels.selected_isa()  # the kernel build, fixed for the layer's life
        self.parts = parts

    def load(self, layer, w, offset: int, whole: bool) -> None:
        parts = self._stage(layer, offset, w, w.shape[0])  # blocks stay blocks until pack
        if parts is not None:
            self.pack(layer, parts)

    def pack(self, layer, parts):
        kinds = [_kind(p) for p in parts]
        runs: list[list] = []  # consecutive shards of one kind pack together
        for part, kind in zip(parts, kinds):
            if runs and runs[-1][0] == kind:
                runs[-1][1].append(part)
            else:
                runs.append([kind, [part]])
        layer.gguf_kind, layer.gguf_parts = 0, []
        layer.dense_reason = _dense_reason(parts, kinds, runs)
        if layer.dense_reason is not None:
            layer.gguf_packed = None
            weight = torch.cat([dense(p).float() for p in parts]).contiguous()
            layer.register_buffer("dense_weight", weight, persistent=False)
            return
        layer.dense_weight = None
        for i, (k, run) in enumerate(runs):
            packer = pack_float_parts if k == FLOAT_KIND else pack_gguf_parts
            packed, kind = packed_cache.pack(run, packer)
            name = "gguf_packed" if len(runs) == 1 else f"gguf_packed_part{i}"
            layer.register_buffer(name, packed, persistent=False)
            layer.gguf_parts.append((packed, kind, sum(p.shape[0] for p in run)))
        if len(runs) == 1:
            layer.gguf_kind = layer.gguf_parts[0][1]
        else:
            layer.gguf_packed = None

    def apply(self, layer, x):
        if layer.dense_weight is not None:
            bias = layer.bias.float() if layer.bias is not None else None
            return F.linear(x.float(), layer.dense_weight, bias).to(x.dtype)

        f32 = self.parts == FLOAT_ACTS
        parts = "two" if f32 else self.parts

        def kernel(x2):
            x2 = x2.float().contiguous()
            outs = [
                cpu_kernels.gguf_gemv(w, kind, rows, x2, isa=self.isa, parts=parts, f32=f32)
                for w, kind, rows in layer.gguf_parts
            ]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

        return self._run_2d(layer, x, kernel)

    def row_reader(self, layer):
        """ids [R] -> the packed weight's rows as float32 [R, in_features], each read from its
        part (None: a dense weight)."""
        if not getattr(layer, "gguf_parts", None):
            return None
        if layer.gguf_packed is not None:
            return lambda ids: cpu_kernels.gguf_rows(
                layer.gguf_packed,
                layer.gguf_kind,
                layer.out_features,
                layer.in_features,
                ids,
                isa=self.isa,
            )

        def read(ids):
            ids = ids.reshape(-1).to(torch.int64)
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= layer.out_features):
                raise IndexError(f"row ids must be in [0, {layer.out_features})")
            out = torch.empty(ids.numel(), layer.in_features)
            start = 0
            for w, kind, rows in layer.gguf_parts:
                sel = ((ids >= start) & (ids < start + rows)).nonzero().reshape(-1)
                if sel.numel():
                    out[sel] = cpu_kernels.gguf_rows(
                        w, kind, rows, layer.in_features, ids[sel] - start, isa=self.isa
                    )
                start += rows
            return out

        return read

    def dequantized(self, layer) -> torch.Tensor:
        if layer.dense_weight is not None:
            return layer.dense_weight
        return torch.cat(
            [
                unpack_gguf_rows(w, kind, (rows, layer.in_features))
                for w, kind, rows in layer.gguf_parts
            ]
        )


def _kind(part) -> int | None:
    """The packed kind of one shard: its blocks' (packed_kind), kind 32 for the float32 values of
    an F32, F16 or BF16 tensor of the file (pack_float_parts keeps a run of F16 or BF16 shards in
    16 bits, kinds 33, 34), None for anything else."""
    if isinstance(part, BlockTensor):
        return packed_kind(part.qtype)
    if getattr(part, "gguf_qtype", None) in FLOAT_TYPES and part.dtype == torch.float32:
        return FLOAT_KIND
    return None


def _dense_reason(parts, kinds, runs) -> str | None:
    """Why these shards cannot stay packed (None: they can); a shard of a fused weight is named
    by its index ("part 2: ...")."""
    for i, (part, kind) in enumerate(zip(parts, kinds)):
        if kind is None:
            qtype = (
                part.qtype if isinstance(part, BlockTensor) else getattr(part, "gguf_qtype", None)
            )
            qtype = getattr(qtype, "name", None)  # gguf_qtype: the loader dequantized it
            why = (
                f"GGUF type {qtype} has no packed kind"
                if qtype
                else "its weights are not GGUF blocks"
            )
            return f"part {i}: {why}" if len(parts) > 1 else why
    if len(runs) > 1:
        if len(runs) > cpu_kernels.STACK_MAX_PARTS:
            return f"{len(runs)} runs of packed kinds, more than {cpu_kernels.STACK_MAX_PARTS}"
        if any(sum(p.shape[0] for p in run) % 16 for _, run in runs):
            return "a part of mixed kinds does not end on a group of 16 rows"
    return None


def packed_linear(model) -> Linear | None:
    """The first linear of `model` that does not hold dense float weights (UnquantizedMethod),
    or None: a dense model, the kind pack_dense_model takes."""
    return next(
        (
            m
            for m in model.modules()
            if isinstance(m, Linear) and type(m.quant_method) is not UnquantizedMethod
        ),
        None,
    )


def pack_dense_model(model) -> str | None:
    """Pack a dense float32 model's linears (the tied LM head from the embedding, which then
    reads its rows from the head) into kind 32 with FLOAT_ACTS, in place, so the C kernels run it
    in float32 with one fixed order of every sum: a token's numbers do not depend on the other
    rows of the call, as the BLAS's do. Returns None when done, else why not (nothing changed)."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    arch = model.arch
    tied = model.lm_head is None and arch.tie_word_embeddings
    if model.dtype != torch.float32:
        return f"the model computes in {model.dtype}"
    if not cpu_kernels.available():
        return "the C kernels are not built"
    if any(p.device.type != "cpu" for p in model.parameters()):
        return "the weights are not on the CPU"
    other = packed_linear(model)
    if other is not None:
        return f"a linear holds {type(other.quant_method).__name__} weights"
    for lin in linears:
        if lin.in_features % 32:
            return f"a linear's {lin.in_features} inputs are not a multiple of 32"
    if tied and (model.embed_tokens.weight is None or arch.hidden_size % 32):
        return "the tied head's embedding is not one dense matrix of whole blocks"
    for lin in linears:
        _pack_float(lin, lin.weight.data)
    if tied:
        head = Linear(arch.hidden_size, arch.vocab_size, quant_method=GgufMethod(FLOAT_ACTS))
        _pack_float(head, model.embed_tokens.weight.data)
        model.tie_quantized_head(head)
        model.embed_tokens.read_rows_with(head.row_reader())
    return None


def _pack_float(lin, w: torch.Tensor) -> None:
    """lin's float32 weight w [out, in] -> kind 32, with float32 activations (FLOAT_ACTS)."""
    method = GgufMethod(FLOAT_ACTS)
    lin.quant_method = method
    method.create_weights(lin, torch.float32)
    del lin._staged
    w = w.contiguous()
    w.gguf_qtype = GGMLQuantizationType.F32  # float32 values: pack_float_parts' kind 32
    method.pack(lin, [w])
