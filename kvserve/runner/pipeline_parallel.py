"""Pipeline parallelism on torch.distributed (gloo on CPU): the layers split into stages, one
process per stage, micro-batches in flight so the stages overlap.

    stage 0 (rank 0, the engine process)   embedding, layers [0, L1)
    stage s (rank s)                       layers [Ls, Ls+1)
    stage P-1                              its layers, the final norm, the LM head

Each stage keeps the KV pools of its own layers, for the block tables every stage shares. A step's
chunks are cut into micro-batches (runs of whole chunks, about equal in tokens, at most P of them
and never fewer tokens than MIN_MICRO_TOKENS each). Rank 0 broadcasts the micro-batches'
positions, attention metadata and logit rows, then runs stage 0 on each micro-batch in turn and
sends its hidden states on without waiting (isend); stage s receives, runs its layers and sends
on, so stage 1 works on micro-batch 1 while stage 0 works on micro-batch 2. The last stage sends
each micro-batch's logits back to rank 0, which samples.

The layers are those of the loaded model (any weight format the PyTorch forward runs: GGUF
packed, int8, float), run by the same modules in the same order as without stages, so the
numbers are those of a single process's PyTorch forward. The Llama family, one KV group.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch import nn

from kvserve.core.scheduler import SchedulerOutput
from kvserve.runner.ranks import Ranks, receive, start_ranks, steps
from kvserve.runner.tensor_parallel import even_split

log = logging.getLogger("kvserve")
__all__ = ["PipelineGroup", "stage_layers", "start"]

MIN_MICRO_TOKENS = 8


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """The layers of `stage`: contiguous, as even as they go."""
    if stages > num_layers:
        raise ValueError(
            f"--pipeline-parallel-size {stages} is more than the model's {num_layers} layers"
        )
    return even_split(num_layers, stages, stage)


def keep_stage(loaded, stage: int, stages: int):
    """`loaded` with only `stage`'s layers (the others' weights are freed), as a LoadedModel whose
    arch counts them."""
    import dataclasses

    model = loaded.model
    layers = stage_layers(loaded.arch.num_layers, stages, stage)
    model.layers = nn.ModuleList(list(model.layers)[layers.start : layers.stop])
    arch = dataclasses.replace(
        loaded.arch,
        num_layers=len(layers),
        layer_windows=list(loaded.arch.layer_windows[layers.start : layers.stop]),
    )
    model.arch = arch
    return dataclasses.replace(loaded, arch=arch)


def micro_batches(out: SchedulerOutput, stages: int) -> list[list[int]]:
    """The step's chunk indices cut into runs of about equal tokens (at most `stages` runs)."""
    n = len(out.chunks)
    total = sum(len(c.token_ids) for c in out.chunks)
    parts = max(1, min(stages, n, total // MIN_MICRO_TOKENS))
    target = total / parts
    runs, run, tokens = [], [], 0
    for i, c in enumerate(out.chunks):
        run.append(i)
        tokens += len(c.token_ids)
        if (
            tokens >= target * (len(runs) + 1)
            and len(runs) < parts - 1
            and n - i - 1 >= parts - len(runs) - 1
        ):
            runs.append(run)
            run = []
    if run:
        runs.append(run)
    return runs


def run_layers(model, h: torch.Tensor, positions: torch.Tensor, meta, kv_caches) -> torch.Tensor:
    """The stage's layers on hidden states h (LlamaForCausalLM.forward without embedding and
    norm)."""
    rope = model.rotary.tables(positions, h.dtype)
    for i, (layer, (k, v)) in enumerate(zip(model.layers, kv_caches, strict=True)):
        h = layer(rope, h, meta.for_layer(i), k, v)
    return h


class PipelineGroup(Ranks):
    """Rank 0's side: stage 0's part of a step, and the logits coming back from the last stage
    (the step's backend, runner/backends/pipeline_parallel.py, cuts it into micro-batches)."""

    def run_step(
        self, model, kv_caches, vocab_size: int, parts: list[tuple], copy_blocks
    ) -> list[torch.Tensor]:
        """parts: per micro-batch (input_ids, positions, meta, rows); returns their logits."""
        self.broadcast(
            (
                "step",
                copy_blocks,
                [(pos, meta, rows, ids.shape[0]) for ids, pos, meta, rows in parts],
            )
        )
        pending = []
        try:
            with torch.inference_mode():
                for ids, positions, meta, _ in parts:
                    h = run_layers(model, model.embed_tokens(ids), positions, meta, kv_caches)
                    pending.append((h, dist.isend(h.contiguous(), dst=1)))
            logits = []
            for _, _, _, rows in parts:
                out = torch.empty(len(rows), vocab_size)
                if len(rows):  # no row, nothing sent back
                    dist.recv(out, src=self.world - 1)
                logits.append(out)
            for _, req in pending:
                req.wait()
        except RuntimeError as e:
            raise self.lost("a send or receive between stages", e) from e
        return logits


def start(config) -> PipelineGroup:
    """Start the other stages (each loads the model and keeps its layers) and join them as rank
    0."""
    return start_ranks(PipelineGroup, config)


def worker_main(rank: int, stages: int, config) -> None:
    """Stage `rank`: receive each micro-batch's hidden states, run its layers, send them on (the
    last stage: the logits back to rank 0), until told to stop."""
    from kvserve.model.loader import load_model
    from kvserve.runner.model_runner import ModelRunner

    loaded = load_model(config.model)
    loaded = keep_stage(loaded, rank, stages)
    context = config.model.context_len(loaded.arch.max_position_embeddings)
    # the KV blocks rank 0 sized; this loop runs the stage's layers itself (worker=True)
    runner = ModelRunner(loaded, config, receive(), max_model_len=context, worker=True)
    model, hidden_size, last = runner.model, loaded.arch.hidden_size, rank == stages - 1
    log.info(
        "pipeline stage %d/%d ready (pid %d, %d layers)",
        rank,
        stages,
        os.getpid(),
        len(model.layers),
    )
    for parts in steps(runner):
        sends = []
        with torch.inference_mode():
            for positions, meta, rows, tokens in parts:
                h = torch.empty(tokens, hidden_size)
                dist.recv(h, src=rank - 1)
                h = run_layers(model, h, positions, meta, runner.kv_caches)
                if last:
                    if len(rows):
                        out = model.compute_logits(model.norm(h)[rows]).contiguous()
                        sends.append((out, dist.isend(out, dst=0)))
                else:
                    h = h.contiguous()
                    sends.append((h, dist.isend(h, dst=rank + 1)))
        for _, req in sends:
            req.wait()
    dist.destroy_process_group()
