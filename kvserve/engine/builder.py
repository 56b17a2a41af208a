"""Everything an EngineCore needs before its first step, built once: the model, the KV cache's
size and groups, the tensor or pipeline ranks, the runner, the drafter.

The engine checks no model family: a model class says whether its layers can be split over
ranks (`supports_parallel`, kvserve/model/registry.py).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, replace

import torch

from kvserve.config import (
    DTYPE_BYTES,
    KV_SCALE_BYTES,
    EngineConfig,
    KVGroup,
    KVShape,
)
from kvserve.model.arch import ModelArch
from kvserve.model.loader import load_model
from kvserve.runner import pipeline_parallel, tensor_parallel
from kvserve.runner.device import activation_bytes, cuda_available, cuda_kv_budget
from kvserve.runner.model_runner import ModelRunner
from kvserve.spec.drafter import Drafter, load_draft
from kvserve.spec.rejection import RejectionSampler


@dataclass
class EngineParts:
    """What build_engine made, and the facts start-up prints about it."""

    config: EngineConfig
    model_path: str
    model_name: str
    quantization: str
    arch: ModelArch
    tokenizer: object
    eos_token_ids: set[int]
    max_model_len: int
    kv_shape: KVShape
    kv_groups: list[KVGroup]
    runner: ModelRunner
    drafter: Drafter | None
    ranks: object | None  # rank 0's TensorParallelGroup or PipelineGroup
    load_seconds: float

    @property
    def num_blocks(self) -> int:
        return sum(g.num_blocks for g in self.kv_groups)

    @property
    def kv_token_capacity(self) -> int:
        """Tokens of context the cache holds: the smallest group's blocks x block size (a window
        group's blocks are freed behind its window, so it serves longer sequences than that)."""
        full = [g.num_blocks for g in self.kv_groups if g.window is None]
        blocks = min(full) if full else min(g.num_blocks for g in self.kv_groups)
        return blocks * self.config.cache.block_size

    def kv_cache_line(self) -> str:
        bs, bpt = self.config.cache.block_size, self.kv_shape.bytes_per_token
        layer_block = bpt // self.arch.num_layers * bs
        total = sum(g.num_blocks * len(g.layers) * layer_block for g in self.kv_groups)
        if len(self.kv_groups) == 1:
            blocks = f"{self.num_blocks} blocks x {bs} tokens"
        else:
            blocks = " + ".join(
                f"{g.num_blocks} blocks ({len(g.layers)} layers, "
                f"{'full' if g.window is None else f'window {g.window}'})"
                for g in self.kv_groups
            )
            blocks += f" x {bs} tokens"
        cap = self.kv_token_capacity
        return (
            f"KV cache: {bpt} bytes/token, {blocks} = {cap} tokens "
            f"({total / 2**20:.0f} MiB); max concurrency at {self.max_model_len} tokens: "
            f"{cap / self.max_model_len:.2f}x"
        )

    def describe(self) -> str:
        a, cfg = self.arch, self.config
        text = (
            f"model {self.model_path}\n"
            f"  {a.num_layers} layers, {a.num_heads} query / {a.num_kv_heads} KV heads, "
            f"head_dim {a.head_dim}, context {self.max_model_len}, dtype {cfg.model.dtype}, "
            f"weights {self.quantization}, loaded in {self.load_seconds:.2f}s\n"
            f"  {self.kv_cache_line()}; "
            f"prefix caching {'on' if cfg.cache.enable_prefix_caching else 'off'}\n"
            f"  steps: {self.runner.step_path}"
        )
        reason = getattr(self.runner, "backend_reason", None)
        if reason:  # a faster path declined: the setting that brings it back
            text += f"; {reason}"
        if self.drafter is not None:
            text += f"\n  speculative decoding: {self.drafter.describe()}"
        return text


def resolve(config: EngineConfig) -> EngineConfig:
    """The configuration the engine runs: device and dtype resolved, every rank accounted for;
    ValueError in a process that is not rank 0."""
    config = config.on_device(cuda_available(config.device))
    world = config.distributed.world
    if config.distributed.rank != 0:
        raise ValueError(
            f"this process is rank {config.distributed.rank} of {world}: only rank 0 runs the "
            "engine; start the other ranks with a kvserve command (serve, generate), which "
            "executes rank 0's steps there (docs/scale-out.md)"
        )
    return config


def build_engine(config: EngineConfig) -> EngineParts:
    """Start the ranks, load the model, size the KV cache, build the runner and the drafter."""
    config = resolve(config)
    torch.set_num_threads(config.num_threads)
    t0 = time.perf_counter()
    ranks = None  # the other ranks start first and load their shards while this one loads
    if config.tensor_parallel_size > 1:
        ranks = tensor_parallel.start(config)
    elif config.pipeline_parallel_size > 1:
        ranks = pipeline_parallel.start(config)
    try:
        loaded = load_model(config.model, config.device)
        load_seconds = time.perf_counter() - t0
        arch = loaded.arch
        max_model_len = config.model.context_len(arch.max_position_embeddings)
        kv_dtype = config.cache.resolved_kv_dtype(config.model.dtype)
        kv_shape = _kv_shape(arch, kv_dtype)
        draft = (
            load_draft(config.speculative, loaded, config)
            if config.speculative is not None
            else None
        )
        kv_groups = _kv_groups(config, arch, kv_shape, draft, kv_dtype)
        drafter = None
        if config.speculative is not None:
            most = max(g.num_blocks for g in kv_groups)
            drafter = Drafter.create(config.speculative, draft, config, most)
        if ranks is not None:
            runner = _parallel_runner(loaded, config, kv_groups, ranks, max_model_len)
        else:
            verifier = RejectionSampler() if drafter is not None else None
            runner = ModelRunner(
                loaded, config, kv_groups, max_model_len=max_model_len, verifier=verifier
            )
    except Exception:
        if ranks is not None:
            ranks.kill()
        raise
    tokenizer = loaded.tokenizer
    eos = set(getattr(tokenizer, "eos_token_ids", None) or arch.eos_token_ids)
    return EngineParts(
        config=config,
        model_path=loaded.path,
        model_name=getattr(arch, "model_name", None) or served_name(loaded.path),
        quantization=loaded.quantization,
        arch=arch,
        tokenizer=tokenizer,
        eos_token_ids=eos,
        max_model_len=max_model_len,
        kv_shape=kv_shape,
        kv_groups=kv_groups,
        runner=runner,
        drafter=drafter,
        ranks=ranks,
        load_seconds=load_seconds,
    )


def _kv_shape(arch: ModelArch, kv_dtype: str) -> KVShape:
    return KVShape(
        arch.num_layers,
        arch.num_kv_heads,
        arch.head_dim,
        DTYPE_BYTES[kv_dtype],
        KV_SCALE_BYTES.get(kv_dtype, 0),
    )


def _kv_groups(
    config: EngineConfig, arch: ModelArch, kv_shape: KVShape, draft, kv_dtype: str
) -> list[KVGroup]:
    """One KV group per attention window (full first), each sized from the budget. On a GPU
    the budget is what --gpu-memory-utilization leaves after the activations; a draft model's
    KV cache takes its share in proportion to its bytes per token."""
    cache = config.cache
    if (
        config.device != "cpu"
        and cache.kv_cache_memory is None
        and cache.num_blocks_override is None
    ):
        reserve = activation_bytes(arch, config.scheduler, DTYPE_BYTES[config.model.dtype])
        budget = cuda_kv_budget(config.device, config.gpu_memory_utilization, reserve)
        cache = replace(cache, kv_cache_memory=budget)
    if draft is not None:
        draft_bytes = _kv_shape(draft.arch, kv_dtype).bytes_per_token
        cache = cache.share(kv_shape.bytes_per_token / (kv_shape.bytes_per_token + draft_bytes))
    windows = [arch.window_of(i) for i in range(arch.num_layers)]
    return cache.kv_groups(kv_shape, windows, config.scheduler)


def _parallel_runner(
    loaded, config: EngineConfig, kv_groups: list[KVGroup], ranks, max_model_len: int
) -> ModelRunner:
    """Rank 0's runner over its shard; the other ranks learn the KV pools' sizes."""
    if not getattr(loaded.model, "supports_parallel", False):
        raise ValueError(
            f"{loaded.arch.name} models cannot be split over ranks yet: run them "
            "with --tensor-parallel-size 1 --pipeline-parallel-size 1"
        )
    if config.pipeline_parallel_size > 1:
        if len(kv_groups) > 1:
            raise ValueError("pipeline parallelism runs models with one attention window only")
        shard = pipeline_parallel.keep_stage(loaded, 0, config.pipeline_parallel_size)
        ranks.broadcast(kv_groups[0].num_blocks)  # each stage's pools: as many blocks
        return ModelRunner(
            shard, config, kv_groups[0].num_blocks, max_model_len=max_model_len, pp=ranks
        )
    shard = tensor_parallel.shard_model(loaded, 0, config.tensor_parallel_size)
    ranks.broadcast(kv_groups)  # the other ranks size their pools alike
    return ModelRunner(shard, config, kv_groups, max_model_len=max_model_len, tp=ranks)


def served_name(path: str) -> str:
    """Served model name from a path: 'SmolLM2-135M-Instruct.Q4_1.gguf' ->
    'SmolLM2-135M-Instruct'."""
    name = re.sub(r"\.gguf$", "", os.path.basename(path.rstrip("/")), flags=re.IGNORECASE)
    return re.sub(r"[.-](q\d\w*|iq\d\w*|f16|f32|bf16)$", "", name, flags=re.IGNORECASE)
