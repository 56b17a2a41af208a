"""Tensor parallelism on torch.distributed (gloo on CPU): one engine process, N-1 worker processes.

Sharding (Megatron's, on a loaded Llama-family model with float weights):

    attention   rank r holds a contiguous run of KV heads (uneven splits allowed: 3 heads over 2
                ranks are 2 + 1) and the query heads that attend to them; qkv_proj is split by
                rows (column-parallel), o_proj by columns (row-parallel), then one all-reduce.
    MLP         gate/up split by rows, down by columns, then one all-reduce.
    LM head     split by vocabulary rows; the logits are all-gathered.
    KV cache    each rank's pool holds its own KV heads, for the same block tables.

The engine process is rank 0: its scheduler decides, its ModelRunner prepares each step's flat
batch and its step backend (runner/backends/tensor_parallel.py) broadcasts it; every rank runs the
same forward on its shard, and rank 0 samples from the gathered logits. Workers (`worker_main`)
only execute.

The processes, where they run and their failures (a dead rank raises RankLost at the next step, a
stalled collective after 30 s) are runner/ranks.py's; runner/worker.py starts a worker rank.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvserve.runner.ranks import RankLost, Ranks, receive, start_ranks, steps

log = logging.getLogger("kvserve")
__all__ = ["RankLost", "TensorParallelGroup", "shard_model", "start"]


def kv_head_split(num_kv_heads: int, world: int) -> list[range]:
    """Contiguous KV heads per rank, as even as they go (3 over 2: [0, 1], [2])."""
    if world > num_kv_heads:
        raise ValueError(
            f"--tensor-parallel-size {world} is more than the model's {num_kv_heads} KV heads: "
            f"use at most {num_kv_heads}"
        )
    base, extra = divmod(num_kv_heads, world)
    out, start = [], 0
    for r in range(world):
        n = base + (1 if r < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def even_split(n: int, world: int, rank: int) -> range:
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


class AllReduced(nn.Module):
    """A row-parallel linear: this rank's partial product, summed over the ranks (its bias once)."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        dist.all_reduce(y)
        return y


def _set_weight(
    linear, weight: torch.Tensor, shard_sizes: list[int], bias: torch.Tensor | None
) -> None:
    linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    linear.shard_sizes = shard_sizes
    linear.out_features, linear.in_features = weight.shape
    linear.bias = None if bias is None else nn.Parameter(bias.contiguous(), requires_grad=False)


def _mlps(mlp: nn.Module) -> list[nn.Module]:
    """The linears of a layer's MLP: a dense SwiGLU's two, or every expert's (and the shared
    expert's) of a mixture of experts."""
    gated = [mlp]
    if hasattr(mlp, "experts"):
        gated = [*mlp.experts, *filter(None, [getattr(mlp, "shared_expert", None)])]
    return [lin for g in gated for lin in (g.gate_up_proj, g.down_proj)]


def _shard_gated(mlp: nn.Module, cut: range, width: int, hidden: int, rank: int) -> None:
    """A SwiGLU (fused gate/up, down) cut to the `cut` columns of its `width`: gate and up keep
    those rows, down those columns; down's bias is added by rank 0 only."""
    gu, d = mlp.gate_up_proj, mlp.down_proj
    idx = torch.tensor([*cut] + [width + i for i in cut], dtype=torch.long)
    _set_weight(gu, gu.weight[idx], [len(cut), len(cut)], None if gu.bias is None else gu.bias[idx])
    bias = d.bias if (d.bias is not None and rank == 0) else None
    _set_weight(d, d.weight[:, cut.start : cut.stop], [hidden], bias)


def shard_model(loaded, rank: int, world: int):
    """`loaded` (a LoadedModel of the Llama family with float weights) cut to rank `rank`'s shard,
    in place; returns the LoadedModel with the shard's arch (its heads, its MLP width)."""
    model, arch = loaded.model, loaded.arch
    for layer in model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, *_mlps(layer.mlp)):
            if (
                not hasattr(lin, "weight")
                or lin.weight is None
                or not lin.weight.is_floating_point()
            ):
                raise ValueError(
                    "tensor parallelism runs float weights: load the model with --quantization none"
                )
    kv = kv_head_split(arch.num_kv_heads, world)[rank]
    per_kv = arch.num_heads // arch.num_kv_heads
    hd = arch.head_dim
    q_rows = range(kv.start * per_kv * hd, kv.stop * per_kv * hd)
    kv_rows = range(kv.start * hd, kv.stop * hd)
    inter = even_split(arch.intermediate_size, world, rank)
    shared_cut = even_split(arch.shared_expert_size, world, rank)  # Qwen2-MoE's shared expert
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        q_size, kv_size = attn.q_size, attn.kv_size
        w = attn.qkv_proj.weight
        rows = [*q_rows] + [q_size + i for i in kv_rows] + [q_size + kv_size + i for i in kv_rows]
        idx = torch.tensor(rows, dtype=torch.long)
        b = attn.qkv_proj.bias
        _set_weight(
            attn.qkv_proj,
            w[idx],
            [len(q_rows), len(kv_rows), len(kv_rows)],
            None if b is None else b[idx],
        )
        attn.num_heads, attn.num_kv_heads = len(q_rows) // hd, len(kv_rows) // hd
        attn.q_size, attn.kv_size = len(q_rows), len(kv_rows)
        o = attn.o_proj
        _set_weight(
            o,
            o.weight[:, q_rows.start : q_rows.stop],
            [arch.hidden_size],
            o.bias if (o.bias is not None and rank == 0) else None,
        )
        attn.o_proj = AllReduced(o)
        if hasattr(mlp, "experts"):  # a mixture of experts: every expert's width is cut
            for expert in mlp.experts:
                _shard_gated(expert, inter, arch.intermediate_size, arch.hidden_size, rank)
            shared = getattr(mlp, "shared_expert", None)
            if shared is not None:
                _shard_gated(shared, shared_cut, arch.shared_expert_size, arch.hidden_size, rank)
            layer.mlp = AllReduced(mlp)  # the router's weights sum the ranks' partial outputs
        else:
            _shard_gated(mlp, inter, arch.intermediate_size, arch.hidden_size, rank)
            mlp.down_proj = AllReduced(mlp.down_proj)
    vocab = even_split(arch.vocab_size, world, rank)
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.tp_head = head[vocab.start : vocab.stop].contiguous()
    shard_arch = dataclasses.replace(
        arch,
        num_heads=len(q_rows) // hd,
        num_kv_heads=len(kv_rows) // hd,
        intermediate_size=len(inter),
        shared_expert_size=len(shared_cut),
    )
    model.arch = shard_arch
    return dataclasses.replace(loaded, arch=shard_arch)


def shard_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """This rank's vocabulary slice of the logits."""
    return F.linear(hidden, model.tp_head).float()


def gather_vocab(local: torch.Tensor, vocab_size: int, world: int) -> torch.Tensor:
    """Every rank's vocabulary slice of the logits (shard_logits), side by side: [rows, vocab]."""
    parts = [
        torch.empty(local.shape[0], len(even_split(vocab_size, world, r)), dtype=local.dtype)
        for r in range(world)
    ]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=1)


class TensorParallelGroup(Ranks):
    """Rank 0's side of tensor parallelism: the ranks, and the gather of a step's logits."""

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        try:
            return gather_vocab(local, vocab_size, self.world)
        except RuntimeError as e:
            raise self.lost("the all-gather of the logits", e) from e


def start(config) -> TensorParallelGroup:
    """Start the other ranks (each loads and shards the model) and join them as rank 0."""
    return start_ranks(TensorParallelGroup, config)


def worker_main(rank: int, world: int, config) -> None:
    """A worker rank: load, shard, then run every step rank 0 broadcasts until told to stop."""
    from kvserve.model.loader import load_model
    from kvserve.runner.model_runner import ModelRunner

    loaded = shard_model(load_model(config.model), rank, world)
    context = config.model.context_len(loaded.arch.max_position_embeddings)
    # the KV groups rank 0 sized; this loop runs the shard's steps itself (worker=True)
    runner = ModelRunner(loaded, config, receive(), max_model_len=context, worker=True)
    vocab = loaded.arch.vocab_size
    log.info("tensor-parallel rank %d/%d ready (pid %d)", rank, world, os.getpid())
    for input_ids, positions, meta, rows in steps(runner):
        with torch.inference_mode():
            hidden = runner.model(input_ids, positions, meta, runner.kv_caches)[rows]
            gather_vocab(shard_logits(runner.model, hidden), vocab, world)
    dist.destroy_process_group()
