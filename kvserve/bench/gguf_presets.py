"""Random-weight Llama-shaped GGUF files of real sizes, in the type mixes llama-quantize writes.

`python3 -m kvserve.bench.gguf_presets --size 1b --preset q4_k_m -o /tmp/1b-q4_k_m.gguf` writes a
model with the shapes of a 1B or 8B Llama (or a small 12-layer one, or a tiny one for tests), the
default model's tokenizer, and every weight as blocks of the preset's types, as llama-quantize's
llama_tensor_get_type picks them for a Llama: Q4_K_M keeps attn_v and ffn_down as Q6_K in the
layers llama-quantize gives more bits (the first and last eighth, and every third between), the
rest Q4_K, the output Q6_K; Q2_K, Q3_K_S/M/L, Q4_K_S, Q5_K_S, IQ4_NL and IQ4_XS raise attn_v,
attn_output and ffn_down as it does; F16 and BF16 keep every matrix in that float type. The
blocks are random bytes with small finite scales and mins that centre every weight on zero (so a
model's hidden states depend on its input, as tests comparing two paths need): decode speed does
not depend on the values, and every type's layout is the file format's own, so loaders and
kernels run exactly what they run on a downloaded file. No download, no llama.cpp.
"""

from __future__ import annotations

import argparse
import functools
import sys

import numpy as np

SIZES = {  # layers, hidden, heads, kv heads, ffn
    "tiny": (4, 256, 4, 2, 512),
    "small": (12, 1024, 16, 4, 3584),
    "1b": (16, 2048, 32, 8, 8192),
    "8b": (32, 4096, 32, 8, 14336),
}
# qtype name -> (weights per block, bytes per block, byte offsets of its fp16 scales)
LAYOUT = {
    "Q4_0": (32, 18, (0,)),
    "Q8_0": (32, 34, (0,)),
    "Q4_K": (256, 144, (0, 2)),
    "Q5_K": (256, 176, (0, 2)),
    "Q6_K": (256, 210, (208,)),
    "Q5_0": (32, 22, (0,)),
    "Q2_K": (256, 84, (80, 82)),
    "Q3_K": (256, 110, (108,)),
    "IQ4_NL": (32, 18, (0,)),
    "IQ4_XS": (256, 136, (0,)),
    "IQ2_XXS": (256, 66, (0,)),
    "F16": (1, 2, ()),
    "BF16": (1, 2, ()),
}
PRESETS = (
    "q4_0",
    "q8_0",
    "q4_k_m",
    "q5_k_m",
    "q2_k",
    "q3_k_s",
    "q3_k_m",
    "q3_k_l",
    "q4_k_s",
    "q5_k_s",
    "iq4_nl",
    "iq4_xs",
    "f16",
    "bf16",
)
# preset -> the type of every weight it does not raise (llama-quantize's default type)
BASE = {
    "q2_k": "Q2_K",
    "q3_k_s": "Q3_K",
    "q3_k_m": "Q3_K",
    "q3_k_l": "Q3_K",
    "q4_k_s": "Q4_K",
    "q4_k_m": "Q4_K",
    "q5_k_s": "Q5_K",
    "q5_k_m": "Q5_K",
    "iq4_nl": "IQ4_NL",
    "iq4_xs": "IQ4_XS",
}
SCALE = np.float16(2e-4)  # w stays within about +-0.5 for every type


def more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's use_more_bits: the layers whose attn_v / ffn_down get the larger type."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(preset: str, role: str, layer: int, layers: int, gqa: int = 1) -> str:
    """The GGUF type of one weight (role: attn_q/k/v/output, ffn_gate/up/down, token_embd,
    output) of a Llama with `gqa` query heads per KV head, as llama-quantize picks it."""
    if preset in ("q4_0", "q8_0", "f16", "bf16"):
        base = preset.upper()
        return "Q6_K" if role == "output" and preset == "q4_0" else base
    base = BASE[preset]
    if role == "output":
        return "Q6_K"
    if role == "attn_v":
        return {
            "q2_k": "Q4_K" if gqa >= 4 else "Q3_K",
            "q3_k_m": "Q5_K" if layer < 2 else "Q4_K",
            "q3_k_l": "Q5_K",
            "iq4_nl": "Q5_K" if gqa >= 4 else base,
            "iq4_xs": "Q5_K" if gqa >= 4 else base,
            "q4_k_m": "Q6_K" if more_bits(layer, layers) else base,
            "q5_k_m": "Q6_K" if more_bits(layer, layers) else base,
            "q4_k_s": "Q5_K" if layer < 4 else base,
        }.get(preset, base)
    if role == "ffn_down":
        return {
            "q2_k": "Q3_K",
            "q3_k_m": "Q5_K" if layer < layers // 16 else "Q4_K",
            "q3_k_l": "Q5_K",
            "q4_k_m": "Q6_K" if more_bits(layer, layers) else base,
            "q5_k_m": "Q6_K" if more_bits(layer, layers) else base,
            "q4_k_s": "Q5_K" if layer < layers // 8 else base,
            "iq4_nl": "Q5_K" if layer < layers // 8 else base,  # without an imatrix
            "iq4_xs": "Q5_K" if layer < layers // 8 else base,
        }.get(preset, base)
    if role == "attn_output":
        return {"q2_k": "Q3_K", "q3_k_m": "Q4_K", "q3_k_l": "Q5_K"}.get(preset, base)
    return base


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """rows x cols weights of `qtype` as raw block bytes: random integers, small fp16 scales."""
    per, size, halves = LAYOUT[qtype]
    if cols % per:
        raise ValueError(f"{qtype} needs rows of a multiple of {per} weights, not {cols}")
    if qtype in ("F16", "BF16"):  # normal values of about SCALE 1000, either sign
        w = rng.standard_normal((rows, cols)).astype(np.float32) * np.float32(SCALE * 1000)
        if qtype == "F16":
            return w.astype(np.float16).view(np.uint8)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # truncated to bf16
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    for at in halves:
        raw[..., at : at + 2] = np.array([SCALE], np.float16).view(np.uint8)
    if qtype == "Q6_K":  # 8-bit sub-block scales: keep them small too
        raw[..., 192:208] = rng.integers(1, 16, (rows, cols // per, 16), dtype=np.uint8)
    if qtype in ("Q4_K", "Q5_K"):  # each sub-block's min mid-range: w = d sc (q - mid)
        s = raw[..., 4:16]  # (min index = scale index, dmin = d mid)
        s[..., 4:8] = s[..., 0:4]
        s[..., 8:12] = (s[..., 8:12] & 0x0F) * np.uint8(0x11)
        mid = 8 if qtype == "Q4_K" else 16
        raw[..., 2:4] = np.array([SCALE * mid], np.float16).view(np.uint8)
    if qtype == "Q2_K":  # each 16 weights' min = its scale, dmin = 1.5 d: w = d sc (q - 1.5)
        s = raw[..., 0:16]
        s[...] = (s & 0x0F) * np.uint8(0x11)
        raw[..., 82:84] = np.array([SCALE * 1.5], np.float16).view(np.uint8)
    if qtype == "IQ4_XS":  # 6-bit sub-scales: ls - 32 in 0..15 (high 2 bits 2)
        raw[..., 2:4] = np.array([0xAAAA], np.uint16).view(np.uint8)
    return raw.reshape(rows, -1)


def write_model(
    path: str,
    size: str,
    preset: str,
    seed: int = 0,
    tokenizer_from: str | None = None,
    types: dict[str, str] | None = None,
) -> None:
    """Write the `size` model in `preset` to `path` (the tokenizer of `tokenizer_from`, by default
    the default model's); `types` overrides the type of named tensors ("blk.2.attn_v.weight":
    "IQ2_XXS")."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    from kvserve.bench.common import model_path

    if size not in SIZES or preset not in PRESETS:
        raise ValueError(f"size is one of {sorted(SIZES)}, preset one of {PRESETS}")
    layers, hidden, heads, kv_heads, ffn = SIZES[size]
    head_dim = hidden // heads
    tokenizer = _tokenizer_fields(model_path(tokenizer_from))
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(f"random {size} {preset}")
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    for key, value, kind in tokenizer:
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(key, value)
        else:
            writer.add_key_value(key, value, kind)
    vocab = next(len(v) for k, v, _ in tokenizer if k == "tokenizer.ggml.tokens")
    writer.add_vocab_size(vocab)
    rng = np.random.default_rng(seed)

    gqa = heads // kv_heads

    def add(name: str, qtype: str, rows: int, cols: int) -> None:
        qtype = (types or {}).get(name, qtype)
        writer.add_tensor(name, random_blocks(qtype, rows, cols, rng), raw_dtype=Q[qtype])

    add("token_embd.weight", tensor_type(preset, "token_embd", 0, layers), vocab, hidden)
    add("output.weight", tensor_type(preset, "output", 0, layers), vocab, hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    shapes = {
        "attn_q": (hidden, hidden),
        "attn_k": (kv_heads * head_dim, hidden),
        "attn_v": (kv_heads * head_dim, hidden),
        "attn_output": (hidden, hidden),
        "ffn_gate": (ffn, hidden),
        "ffn_up": (ffn, hidden),
        "ffn_down": (hidden, ffn),
    }
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        for role, (rows, cols) in shapes.items():
            add(f"blk.{i}.{role}.weight", tensor_type(preset, role, i, layers, gqa), rows, cols)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@functools.lru_cache(maxsize=4)
def _tokenizer_fields(path: str) -> tuple:
    """The tokenizer.* fields of the GGUF file at `path` as (key, value, value type)
    tuples: read once per file (reading a tokenizer's fields takes seconds), then written
    into every model made with it."""
    import gguf

    reader = gguf.GGUFReader(path)
    fields = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            value = [
                bytes(field.parts[i]).decode("utf-8", "surrogateescape")
                if sub == gguf.GGUFValueType.STRING
                else field.parts[i].tolist()[0]
                for i in field.data
            ]
        elif kind == gguf.GGUFValueType.STRING:
            value = bytes(field.parts[field.data[0]]).decode("utf-8")
        else:
            value = field.parts[field.data[0]].tolist()[0]
        fields.append((key, value, kind))
    return tuple(fields)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="1b")
    p.add_argument("--preset", choices=PRESETS, default="q4_k_m")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", required=True)
    args = p.parse_args(argv)
    write_model(args.output, args.size, args.preset, args.seed)
    print(f"wrote {args.output}: {args.size} {args.preset}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
