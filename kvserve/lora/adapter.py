"""Reading and checking a PEFT LoRA adapter directory: adapter_config.json with
adapter_model.safetensors.

An adapter adds scale * B @ A to some of the base model's projections (q/k/v/o, gate/up/down), with
A [r, in] and B [out, r] per layer and scale = lora_alpha / r (lora_alpha / sqrt(r) with
use_rslora). What PEFT can write but this engine does not run (DoRA, fan_in_fan_out, trained
biases, modules_to_save, per-module ranks, pickled weights) is refused with a ValueError that
names it, before the weights are read; so are shapes that do not fit the base model.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json is a few hundred bytes

# PEFT's name of a projection -> (block of the decoder layer, names of the kvserve Linear that
# computes it as (attribute, shard) candidates: unfused first, then the fused q/k/v or gate/up).
TARGETS: dict[str, tuple[str, tuple[tuple[str, int], ...]]] = {
    "q_proj": ("self_attn", (("q_proj", 0), ("qkv_proj", 0))),
    "k_proj": ("self_attn", (("k_proj", 0), ("qkv_proj", 1))),
    "v_proj": ("self_attn", (("v_proj", 0), ("qkv_proj", 2))),
    "o_proj": ("self_attn", (("o_proj", 0),)),
    "gate_proj": ("mlp", (("gate_proj", 0), ("gate_up_proj", 0))),
    "up_proj": ("mlp", (("up_proj", 0), ("gate_up_proj", 1))),
    "down_proj": ("mlp", (("down_proj", 0),)),
}
# PEFT options that change what a LoRA layer computes beyond scale * B @ A, refused when set.
UNSUPPORTED = (
    "lora_bias",
    "layer_replication",
    "use_qalora",
    "use_bdlora",
    "target_parameters",
    "alora_invocation_tokens",
    "trainable_token_indices",
)
_TENSOR = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$"
)


@dataclass
class LoRAAdapter:
    """One adapter read from its directory: per (layer, PEFT module name) its A [r, in] and
    B [out, r] in the model dtype, and the scale its delta is multiplied by. Layers are indices
    into the model's `layers`: a pipeline stage keeps the matrices of its own layers only."""

    name: str
    path: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)


def find_linear(model, layer: int, module: str):
    """(Linear, shard) of the base model computing PEFT module `module` in decoder layer `layer`,
    or None when the model has none (a mixture-of-experts MLP, say)."""
    block_name, candidates = TARGETS[module]
    block = getattr(model.layers[layer], block_name, None)
    for attr, shard in candidates:
        linear = getattr(block, attr, None)
        if (
            linear is not None
            and hasattr(linear, "shard_sizes")
            and shard < len(linear.shard_sizes)
        ):
            return linear, shard
    return None


def model_layers(model) -> tuple[int, int]:
    """(the global index of model.layers[0], the whole model's layer count): a pipeline stage
    holds a run of the layers (runner/pipeline_parallel.keep_stage), one process all of them."""
    return getattr(model, "first_layer", 0), getattr(model, "num_model_layers", len(model.layers))


def max_weights_bytes(model, max_rank: int) -> int:
    """The largest adapter_model.safetensors an adapter of rank <= max_rank on `model` can need
    (every module of every layer of the whole model targeted, float64 at most; a stage's layers
    stand for the others, all alike), plus room for the file's header."""
    total = 0
    for i in range(len(model.layers)):
        for module in TARGETS:
            found = find_linear(model, i, module)
            if found is not None:
                linear, shard = found
                total += max_rank * (linear.in_features + linear.shard_sizes[shard]) * 8
    return total * model_layers(model)[1] // len(model.layers) + (1 << 20)


def _read_config(path: str, name: str) -> dict:
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {name!r}: {path} has no {CONFIG_FILE}")
    if os.path.getsize(config_path) > MAX_CONFIG_BYTES:
        raise ValueError(f"LoRA adapter {name!r}: {config_path} is larger than 1 MiB")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {config_path}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {name!r}: {config_path} is not a JSON object")
    return config


def _check_config(config: dict, name: str, max_rank: int) -> tuple[int, float, tuple[str, ...]]:
    """(rank, scaling, target modules) of a PEFT LoRA config, or a ValueError naming what this
    engine does not run."""
    where = f"LoRA adapter {name!r}"
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type {peft_type!r} is not supported (only LORA)")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: r must be an integer >= 1, got {rank!r}")
    if rank > max_rank:
        raise ValueError(
            f"{where}: rank r={rank} is above --max-lora-rank {max_rank}: raise --max-lora-rank"
        )
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    if config.get("use_dora"):
        raise ValueError(f"{where}: DoRA adapters (use_dora) are not supported")
    for key in UNSUPPORTED:
        if config.get(key):
            raise ValueError(f"{where}: {key}={config[key]!r} is not supported")
    if config.get("fan_in_fan_out"):
        raise ValueError(
            f"{where}: fan_in_fan_out adapters (GPT-2 style Conv1D layers) are not supported"
        )
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: trained biases (bias={config['bias']!r}) are not supported")
    if config.get("modules_to_save"):
        raise ValueError(
            f"{where}: modules_to_save {config['modules_to_save']!r} is not supported (only "
            "LoRA matrices on the projections)"
        )
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(f"{where}: per-module ranks ({key}) are not supported")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise ValueError(
            f'{where}: target_modules must list the projections, e.g. ["q_proj", "v_proj"], '
            f"got {targets!r}"
        )
    unknown = sorted({t.rsplit(".", 1)[-1] for t in targets} - set(TARGETS))
    if unknown:
        raise ValueError(
            f"{where}: unknown target module(s) {unknown}: supported are {list(TARGETS)}"
        )
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling), tuple(sorted({t.rsplit(".", 1)[-1] for t in targets}))


def load_adapter(
    name: str, path: str, model, max_rank: int, dtype: torch.dtype = torch.float32
) -> LoRAAdapter:
    """Read and check the adapter at directory `path` for `model` (a kvserve causal LM with
    `layers`): ValueError naming the problem (missing files, pickled weights, an unsupported
    option, a rank above `max_rank`, a file too large for such a rank, tensors whose shapes do not
    match the base model's projections)."""
    from safetensors import SafetensorError, safe_open

    where = f"LoRA adapter {name!r}"
    if not isinstance(path, str) or not path:
        raise ValueError(f"{where}: the path must be a directory")
    if not os.path.isdir(path):
        raise ValueError(f"{where}: {path} is not a directory (a PEFT adapter directory)")
    config = _read_config(path, name)
    rank, scaling, targets = _check_config(config, name, max_rank)
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        pickled = [
            f
            for f in ("adapter_model.bin", "adapter_model.pt")
            if os.path.exists(os.path.join(path, f))
        ]
        if pickled:
            raise ValueError(
                f"{where}: {pickled[0]} is a pickle, which is not loaded: save the adapter with "
                f"safe_serialization=True ({WEIGHTS_FILE})"
            )
        raise ValueError(f"{where}: {path} has no {WEIGHTS_FILE}")
    limit = max_weights_bytes(model, rank)
    size = os.path.getsize(weights_path)
    if size > limit:
        raise ValueError(
            f"{where}: {WEIGHTS_FILE} is {size} bytes, more than a rank-{rank} adapter of this "
            f"model can hold ({limit} bytes): it does not belong to this base model"
        )
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(weights_path, framework="pt") as f:
            for key in f.keys():
                m = _TENSOR.search(key)
                if m is None:
                    raise ValueError(
                        f"{where}: tensor {key!r} is not a LoRA matrix of a decoder layer's "
                        f"projection (supported: {list(TARGETS)})"
                    )
                layer, block, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
                if module not in TARGETS or TARGETS[module][0] != block:
                    raise ValueError(
                        f"{where}: tensor {key!r}: unknown target module {block}.{module}"
                    )
                found.setdefault((layer, module), {})[ab] = f.get_tensor(key)
    except SafetensorError as e:
        raise ValueError(f"{where}: {WEIGHTS_FILE} is not a valid safetensors file: {e}") from None
    except OSError as e:
        raise ValueError(f"{where}: cannot read {weights_path}: {e}") from None
    if not found:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no LoRA matrices")
    first, num_layers = model_layers(model)
    mine = range(first, first + len(model.layers))
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in sorted(found.items()):
        if layer >= num_layers:
            raise ValueError(
                f"{where}: layer {layer} of {module} is beyond the base model's {num_layers} layers"
            )
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise ValueError(f"{where}: layer {layer} {module} has no {missing} matrix")
        # another stage's layer is checked against this stage's first (the layers are alike)
        target = find_linear(model, layer - first if layer in mine else 0, module)
        if target is None:
            raise ValueError(f"{where}: the base model has no {module} in layer {layer}")
        linear, shard = target
        a, b = ab["A"], ab["B"]
        want_a = (rank, linear.in_features)
        want_b = (linear.shard_sizes[shard], rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise ValueError(
                f"{where}: layer {layer} {module}: lora_A is {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}, the base model wants {want_a} and {want_b} (rank {rank}): "
                "the adapter was trained for another model"
            )
        if not (a.is_floating_point() and b.is_floating_point()):
            raise ValueError(f"{where}: layer {layer} {module}: LoRA matrices must be floats")
        a, b = a.to(dtype).contiguous(), b.to(dtype).contiguous()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ValueError(f"{where}: layer {layer} {module} holds inf or nan")
        if layer in mine:  # by the index in model.layers
            weights[(layer - first, module)] = (a, b)
    return LoRAAdapter(name, path, rank, scaling, targets, weights)
