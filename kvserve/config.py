"""Every knob of kvserve and its default, in one place.

Nothing here imports the rest of kvserve (or torch): the scheduler, the runner, the CLI
and the server all read these dataclasses.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
               "int8": 1, "fp8": 1}

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "t": 1e12, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str | int | float) -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, 1000 -> 1000."""
    if isinstance(text, (int, float)):
        return int(text)
    m = _SIZE_RE.match(text)
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ValueError(f"cannot read memory size {text!r}: write it like 2GiB, 512MiB or 1e9")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def available_memory_bytes() -> int:
    """Free RAM as the kernel reports it (MemAvailable), or 4 GiB when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30


@dataclass(frozen=True)
class KVShape:
    """What one token of KV costs: the model facts the cache is sized from."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def bytes_per_token(self) -> int:
        # K and V, every layer, every KV head (GQA/MQA: kv_heads < query heads).
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass
class ModelConfig:
    model: str | None = None          # GGUF file or HF directory; None: the default model
    dtype: str = "float32"            # compute dtype (bf16 is slower than fp32 on AVX2 CPUs)
    quantization: str | None = None   # None: the loader's best default; none|int8|int4|gguf
    max_model_len: int | None = None  # None: the model's own context length
    tokenizer: str | None = None      # tokenizer.json path when not in the model file


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None   # bytes; None: kv_cache_fraction of free RAM
    kv_cache_fraction: float = 0.25
    kv_cache_dtype: str = "auto"         # auto (= model dtype) | float32 | bfloat16 | int8
    enable_prefix_caching: bool = True
    num_blocks_override: int | None = None  # tests: an exact pool size

    def num_blocks(self, kv: KVShape) -> int:
        if self.num_blocks_override is not None:
            return self.num_blocks_override
        budget = self.kv_cache_memory
        if budget is None:
            budget = int(available_memory_bytes() * self.kv_cache_fraction)
        blocks = budget // (kv.bytes_per_token * self.block_size)
        if blocks < 1:
            raise ValueError(
                f"KV cache budget {budget} bytes holds no block of {self.block_size} tokens "
                f"({kv.bytes_per_token} bytes/token): raise --kv-cache-memory")
        return int(blocks)


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 512   # the unified per-step token budget
    max_num_seqs: int = 64              # running requests at once
    max_waiting: int = 1024             # admission cap (server answers 429 past it)
    chunked_prefill: bool = True


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0
    num_threads: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))
    device: str = "cpu"
