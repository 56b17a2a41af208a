"""Packed weight formats for `Linear` (the quant-method hooks of kvserve.model.layers), one module
per format:

    none   UnquantizedMethod (kvserve.model.layers): dense weights in the model dtype (GGUF blocks
           dequantized to fp32); where the C layer stack runs the model (float32 on a CPU) its
           start packs them for the float32 GEMM (gguf.pack_dense_model)
    int8   (int8.py) per-output-channel symmetric int8 weights, LM head included; weight-only kernel
           (_weight_int8pack_mm, bf16 activations) by default, fbgemm's dynamic int8 linear with
           KVSERVE_INT8_KERNEL=fbgemm (faster; activations quantized per token, at some cost in
           top-1 agreement: see Int8Method)
    int4   (int4.py) group-32 asymmetric int4 weights, run by torch's int4pack CPU kernel (bf16
           activations: its float32 path is a slow reference loop). GGUF Q4_0/Q4_1 blocks are taken
           as they are (same group of 32, same 16 levels): no dequantize/requantize round trip.
           The LM head is int8.
    gguf   (gguf.py) the file's own blocks: Q4_0/Q4_1/Q8_0 (the default model's layers and its tied
           Q8_0 LM head), Q5_0, Q5_1, IQ4_NL, IQ4_XS, the K-quants Q2_K/Q3_K/Q4_K/Q5_K/Q6_K
           and F16/BF16/F32 matrices (as float32),
           decoded without changing a value and interleaved 16 rows at a time
           (kvserve.ops.gguf_blocks) and run by kvserve's C kernels (ops/csrc/gguf_gemv*.c:
           AVX-512 VNNI, AVX2, AVX-VNNI, Arm NEON or portable C,
           the same bits on each; activations as two 8-bit parts per block of 32) at every batch
           size (GgufMethod). Other GGUF types (IQ1-IQ3, TQ*) are dequantized to float32.
           Without a C compiler: Q4 blocks in int4pack for 1-2 rows, fbgemm fp16 above, and a
           fp16 LM head (Int4Method(batch_fp16=True), Fp16Method (fp16.py)) where
           torch has fbgemm (x86); dense float32 weights where it has not (Arm).
    gguf-a8 gguf with the activations as one 8-bit part per block of 32 (llama.cpp's precision)
           instead of two: half the integer work per token, and prompt tokens take the integer
           GEMV too; outside eval-quality's bound on the default model, so never the default.
           Without the C kernels it falls back as gguf does.
    gguf-mixed  (the default for GGUF files) gguf with the activations as one 8-bit part per
           block, except the blocks whose second part carries at least 2^-14 of the block's
           energy (an outlier's block): near gguf-a8's work,
           prompt tokens on the integer GEMV too, and inside eval-quality's bound. Falls back as
           gguf does.

GPTQ and AWQ checkpoints (hf_int4.py): HF directories whose linears hold 4-bit qweight / qzeros /
scales become Q4_1 BlockTensors at load (per block of 32: d = s, m = -z s in fp16), so the gguf
formats above (their default) run them as a Q4_1 file's weights; layouts that do not map are
dequantized, with the reason logged.

blocks.py holds BlockTensor (GGUF blocks not dequantized), base.py the shard staging all packed
formats share. The default for GGUF models is the fastest format within the quality bound of
`kvserve eval-quality` (DEFAULT_GGUF below). Kernel timings and quality figures of the formats:
docs/benchmarks.md.
"""

from __future__ import annotations

from torch import nn

from kvserve.model.layers import Linear
from kvserve.model.quant import hf_int4
from kvserve.model.quant.blocks import GROUP, BlockTensor, _packable_types, _q4_types, is_q4
from kvserve.model.quant.fp16 import Fp16Method, fp16_prepack
from kvserve.model.quant.gguf import GgufMethod
from kvserve.model.quant.int4 import Int4Method, quantize_int4_rows
from kvserve.model.quant.int8 import Int8Method, quantize_int8_rows
from kvserve.ops import cpu_kernels

# The block packing lives next to its kernel (kvserve.ops.gguf_blocks); re-exported here.
from kvserve.ops.gguf_blocks import pack_gguf_parts, pack_gguf_rows, unpack_gguf_rows

__all__ = [
    "FORMATS",
    "GGUF_FORMATS",
    "GROUP",
    "KEEP_BLOCKS",
    "DEFAULT_GGUF",
    "DESCRIPTION",
    "BlockTensor",
    "is_q4",
    "Int8Method",
    "quantize_int8_rows",
    "Int4Method",
    "quantize_int4_rows",
    "Fp16Method",
    "fp16_prepack",
    "GgufMethod",
    "hf_int4",
    "pack_gguf_parts",
    "pack_gguf_rows",
    "unpack_gguf_rows",
    "method_for",
    "head_method_for",
    "apply_quantization",
]

FORMATS = ("none", "int8", "int4", "gguf", "gguf-a8", "gguf-mixed")
GGUF_FORMATS = {
    "gguf": "two",
    "gguf-a8": "one",
    "gguf-mixed": "mixed",
}  # format -> the activations' parts


# ---------------------------------------------------------------- choosing methods


def has_fbgemm() -> bool:
    """Whether this torch has fbgemm's quantized kernels (x86 builds; Arm builds have not)."""
    import torch

    return "fbgemm" in torch.backends.quantized.supported_engines


def method_for(fmt: str, in_features: int, out_features: int):
    """The quant method for one Linear under format `fmt` (None: keep the dense default)."""
    if fmt in (None, "none"):
        return None
    if fmt == "int8":
        return Int8Method()
    if fmt in GGUF_FORMATS and cpu_kernels.available():
        return GgufMethod(parts=GGUF_FORMATS[fmt]) if in_features % GROUP == 0 else None
    if fmt in GGUF_FORMATS and not has_fbgemm():
        return None  # no C kernels and no fbgemm (Arm without a compiler): dense float32
    if fmt == "int4" or fmt in GGUF_FORMATS:
        return Int4Method(batch_fp16=fmt != "int4") if Int4Method.supports(in_features) else None
    raise ValueError(f"quantization {fmt!r} is not supported (choose from {list(FORMATS)})")


def head_method_for(fmt: str, in_features: int, out_features: int):
    """The LM head's method: gguf keeps the file's Q8_0 blocks for the C kernel (without C kernels:
    the same values as fbgemm fp16 weights with fp32 activations where torch has fbgemm, not an
    int8-activation head; dense float32 where it has not); int4 uses int8 for the head (an int4
    head loses too much quality; the figures: docs/benchmarks.md)."""
    if fmt in GGUF_FORMATS:
        if cpu_kernels.available() and in_features % GROUP == 0:
            return GgufMethod(parts=GGUF_FORMATS[fmt])
        return Fp16Method() if has_fbgemm() else None
    if fmt == "int4":
        return Int8Method()
    return method_for(fmt, in_features, out_features)


def apply_quantization(model: nn.Module, fmt: str) -> None:
    """Give every Linear of `model` the method of format `fmt` (before any weight is loaded), and
    a quantized LM head when the head is tied to the embedding."""
    if fmt in (None, "none"):
        return
    for module in list(model.modules()):
        if isinstance(module, Linear):
            if module is getattr(model, "lm_head", None):
                method = head_method_for(fmt, module.in_features, module.out_features)
            else:
                method = method_for(fmt, module.in_features, module.out_features)
            if method is not None:
                module.quant_method = method
                method.create_weights(module, model.dtype)
    arch = model.arch
    if model.lm_head is None and arch.tie_word_embeddings:
        method = head_method_for(fmt, arch.hidden_size, arch.vocab_size)
        if method is not None:
            model.tie_quantized_head(
                Linear(arch.hidden_size, arch.vocab_size, dtype=model.dtype, quant_method=method)
            )


# GGUF qtypes the loader hands over as blocks (not dequantized), per format.
KEEP_BLOCKS = {"int4": _q4_types(), **{fmt: _packable_types() for fmt in GGUF_FORMATS}}

# The default for GGUF models: the fastest format within the quality bound of `kvserve eval-quality`
# (the figures: docs/benchmarks.md).
DEFAULT_GGUF = "gguf-mixed"

DESCRIPTION = {
    "none": "dense weights in the model dtype, GGUF blocks dequantized (float32 on a CPU: "
    "packed for the C layer stack's float32 GEMM when it runs the model)",
    "int8": "per-channel int8 weights (weight-only int8pack, bf16 activations), LM head included",
    "int4": "group-32 int4 weights (int4pack, bf16 activations), GGUF Q4 blocks as they are, "
    "LM head included",
    "gguf": "GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, IQ4_NL/IQ4_XS and Q2_K-Q6_K blocks and F16/BF16/F32 "
    "matrices run by "
    "kvserve's C kernels (the build for this CPU's instruction set) at every batch size, "
    "activations as two 8-bit parts per block (the most accurate)",
    "gguf-a8": "gguf with activations as one 8-bit part per block (llama.cpp's precision): "
    "faster batches and prompts, less accurate",
    "gguf-mixed": "gguf with activations as one 8-bit part per block except where an outlier "
    "needs the second: near gguf-a8's speed, within the quality bound",
}
