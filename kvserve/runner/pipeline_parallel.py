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

Each stage runs its layers on the path one process would run them on: the C layer stack
(runner/layer_stack.py) over the stage's own layer table when it takes the model (GGUF blocks,
float32; stage 0 embeds, the last stage applies the final norm; the hidden states between stages
are float32 rows, exactly what the next layer would read in one process), else the same PyTorch
modules in the same order (any weight format: int8, float). On the C stack every token's numbers
are computed on their own, so the tokens equal one process's exactly; on the PyTorch forward only
the shapes of the matrix products change (micro-batches). Each stage's start-up log names its
path and why. The Llama family, one KV group.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch import nn

from kvserve.core.scheduler import SchedulerOutput
from kvserve.runner.layer_stack import CLayerStack, Refusal
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
    # where its layers sit in the whole model (a LoRA adapter names layers by that index)
    model.first_layer, model.num_model_layers = layers.start, loaded.arch.num_layers
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


def stage_stack(model, kv_caches) -> tuple[CLayerStack | None, Refusal | None]:
    """(the C layer stack over this stage's layers and KV pools, None), or (None, why not): what
    select_backend decides for one process, for the stage's share of the model (LoRA adapters
    included: the stack reads them from the stage model's LoRAManager)."""
    windows = {model.arch.window_of(i) for i in range(len(model.layers))}
    if len(windows) != 1:
        return None, Refusal("the C layer stack takes one attention window for every layer")
    return CLayerStack.build_with_reason(model, kv_caches)


def stage_path(stack: CLayerStack | None, why: Refusal | None) -> str:
    """The path a stage's steps take, for its start-up log."""
    if stack is not None:
        return f"C layer stack, {stack.isa} kernels"
    return f"PyTorch forward ({why.why if why else 'no C layer stack'})"


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
        self,
        model,
        kv_caches,
        vocab_size: int,
        parts: list[tuple],
        copy_blocks,
        stack: CLayerStack | None = None,
    ) -> list[torch.Tensor]:
        """parts: per micro-batch (input_ids, positions, meta, rows, prompt_lens, lora_slots);
        returns their logits. `stack`: stage 0's C layer stack (None: the PyTorch forward);
        `lora_slots`: each token's adapter slot (None without --enable-lora)."""
        self.broadcast(
            (
                "step",
                copy_blocks,
                [(p[1], p[2], p[3], p[0].shape[0], p[4], p[5]) for p in parts],
            )
        )
        pending = []
        try:
            with torch.inference_mode():
                for ids, positions, meta, _, lens, slots in parts:
                    set_lora_slots(model, slots)
                    if stack is not None:
                        every = torch.arange(ids.shape[0])
                        h = stack(ids, positions, meta, kv_caches, every, lens, final_norm=False)
                    else:
                        h = run_layers(model, model.embed_tokens(ids), positions, meta, kv_caches)
                    pending.append((h, dist.isend(h.contiguous(), dst=1)))
            logits = []
            for _, _, _, rows, _, _ in parts:
                out = torch.empty(len(rows), vocab_size)
                if len(rows):  # no row, nothing sent back
                    dist.recv(out, src=self.world - 1)
                logits.append(out)
            for _, req in pending:
                req.wait()
        except RuntimeError as e:
            raise self.lost("a send or receive between stages", e) from e
        return logits


def set_lora_slots(model, slots: torch.Tensor | None) -> None:
    """Give the stage model's LoRA step a micro-batch's per-token adapter slots."""
    if slots is not None:
        model.lora_step.set(slots)


def lora_slots(model) -> torch.Tensor | None:
    """The per-token adapter slots the last flattening set (None: no LoRA adapters served)."""
    step = getattr(model, "lora_step", None)
    return None if step is None else step.indices


def start(config) -> PipelineGroup:
    """Start the other stages (each loads the model and keeps its layers) and join them as rank
    0."""
    return start_ranks(PipelineGroup, config)


def worker_main(rank: int, stages: int, config) -> None:
    """Stage `rank`: receive each micro-batch's hidden states, run its layers, send them on (the
    last stage: the logits back to rank 0), until told to stop."""
    from kvserve.lora.manager import LoRAManager
    from kvserve.model.loader import load_model
    from kvserve.runner.model_runner import ModelRunner

    loaded = load_model(config.model)
    layers = stage_layers(loaded.arch.num_layers, stages, rank)
    loaded = keep_stage(loaded, rank, stages)
    context = config.model.context_len(loaded.arch.max_position_embeddings)
    # the KV blocks rank 0 sized; this loop runs the stage's layers itself (worker=True)
    runner = ModelRunner(loaded, config, receive(), max_model_len=context, worker=True)
    model, hidden_size, last = runner.model, loaded.arch.hidden_size, rank == stages - 1
    if config.enable_lora:  # its adapters come as rank 0 loads them (ranks.steps)
        LoRAManager(model, config.max_loras, config.max_lora_rank)
    stack, why = stage_stack(model, runner.kv_caches)
    log.info(
        "pipeline stage %d/%d ready (pid %d, layers [%d, %d)): steps: %s",
        rank,
        stages,
        os.getpid(),
        layers.start,
        layers.stop,
        stage_path(stack, why),
    )
    for parts in steps(runner):
        sends = []
        with torch.inference_mode():
            for positions, meta, rows, tokens, lens, slots in parts:
                set_lora_slots(model, slots)
                h = torch.empty(tokens, hidden_size)
                dist.recv(h, src=rank - 1)
                if stack is not None:
                    ids = torch.zeros(tokens, dtype=torch.long)  # not read: h_in replaces them
                    out_rows = rows if last else torch.arange(tokens)
                    h = stack(
                        ids, positions, meta, runner.kv_caches, out_rows, lens, h, final_norm=last
                    )
                    if last and len(rows):
                        out = model.compute_logits(h).contiguous()
                        sends.append((out, dist.isend(out, dst=0)))
                    elif not last:
                        sends.append((h, dist.isend(h, dst=rank + 1)))
                    continue
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
