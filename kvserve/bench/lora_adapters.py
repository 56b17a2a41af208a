"""Random LoRA adapters for `bench latency --lora-mix`: PEFT-format directories (what
`save_pretrained` of a PEFT LoraConfig model writes) shaped for a model, so the cost of serving
adapters can be measured on any size without training or downloading any. Speed does not depend
on the values: A ~ N(0, 1/in), B ~ N(0, 0.01^2), every projection of every layer targeted.

    python3 -m kvserve.bench.lora_adapters --model /tmp/1b-q4_0.gguf --count 4 --rank 16 \\
        -o /tmp/lora1b        # writes /tmp/lora1b/a0 .. a3
"""

from __future__ import annotations

import argparse
import json
import os
import sys

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def model_shapes(path: str) -> tuple[int, dict[str, tuple[int, int]]]:
    """(layers, {module: (in, out)}) of a Llama-shaped GGUF file or Hugging Face directory."""
    if os.path.isdir(path):
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            c = json.load(f)
        layers, hidden, heads = c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"]
        kv_heads, ffn = c.get("num_key_value_heads", heads), c["intermediate_size"]
        head_dim = c.get("head_dim") or hidden // heads
    else:
        from gguf import GGUFReader

        reader = GGUFReader(path)
        arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

        def meta(key: str, default=None):
            field = reader.fields.get(f"{arch}.{key}")
            return default if field is None else int(field.parts[-1][0])

        layers, hidden = meta("block_count"), meta("embedding_length")
        heads, ffn = meta("attention.head_count"), meta("feed_forward_length")
        kv_heads = meta("attention.head_count_kv", heads)
        head_dim = meta("attention.key_length", hidden // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    return layers, {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, ffn),
        "up_proj": (hidden, ffn),
        "down_proj": (ffn, hidden),
    }


def write_adapter(path: str, layers: int, shapes: dict, rank: int, alpha: int, seed: int) -> None:
    """One adapter directory at `path` targeting every module of `shapes` in every layer."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module, (n_in, n_out) in shapes.items():
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(shapes),
        "lora_dropout": 0.0,
        "bias": "none",
    }
    with open(os.path.join(path, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python3 -m kvserve.bench.lora_adapters",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="a GGUF file or Hugging Face directory")
    p.add_argument("--count", type=int, default=4, help="adapters to write (default: %(default)s)")
    p.add_argument("--rank", type=int, default=16, help="their rank r (default: %(default)s)")
    p.add_argument("--alpha", type=int, default=32, help="lora_alpha (default: %(default)s)")
    p.add_argument("-o", "--output", required=True, help="directory for a0, a1, ...")
    args = p.parse_args(argv)
    if args.count < 1 or args.rank < 1:
        p.error("--count and --rank must be at least 1")
    layers, shapes = model_shapes(args.model)
    for i in range(args.count):
        write_adapter(os.path.join(args.output, f"a{i}"), layers, shapes, args.rank, args.alpha, i)
    names = " ".join(f"a{i}={os.path.join(args.output, f'a{i}')}" for i in range(args.count))
    print(f"wrote {args.count} adapters; --lora-modules {names}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
