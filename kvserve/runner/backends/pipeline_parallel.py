"""Pipeline parallelism: the step's chunks cut into micro-batches that flow down the stages
(runner/pipeline_parallel.py); rank 0 runs stage 0 and receives the logits from the last stage.
Each stage runs its layers on the C layer stack when it takes them (as one process would), else on
the PyTorch forward."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.core.scheduler import SchedulerOutput
from kvserve.runner.backends.base import StepBackend, StepBatch
from kvserve.runner.pipeline_parallel import (
    PipelineGroup,
    lora_slots,
    micro_batches,
    stage_stack,
)


class PipelineParallelBackend(StepBackend):
    name = "pipeline_parallel"

    def __init__(
        self,
        group: PipelineGroup,
        model,
        kv_caches,
        vocab_size: int,
        prepare: Callable,
    ) -> None:
        """`prepare`: ModelRunner.prepare, which flattens each micro-batch's chunks (and sets
        their tokens' LoRA adapter slots). Stage 0's C layer stack (`stack`) is built here;
        `declined`/`fix`: why not, and what brings it back."""
        super().__init__(model, kv_caches)
        self.group, self.vocab_size, self.prepare = group, vocab_size, prepare
        self.stack, why = stage_stack(model, kv_caches)
        self.declined = why.why if why else None
        self.fix = why.fix if why else None

    def describe(self) -> str:
        if self.stack is not None:
            path = f"C layer stack, {self.stack.isa} kernels"
        else:
            path = f"PyTorch forward ({self.declined})"
        return f"{path}, {self.group.world} pipeline stages (gloo)"

    def logits(self, batch: StepBatch) -> torch.Tensor:
        """Micro-batch k holds a run of whole chunks, flat rows [lo, hi) of the batch: it computes
        the batch's rows in that range, and they go back to their places in batch.rows."""
        qsl, rows = batch.meta.query_start_loc, batch.rows.tolist()
        parts, places = [], []
        for run in micro_batches(batch.out, self.group.world):
            lo, hi = qsl[run[0]], qsl[run[-1] + 1]
            sub = SchedulerOutput([batch.out.chunks[i] for i in run], [], [], hi - lo)
            ids, positions, meta, _ = self.prepare(sub)
            mine = [j for j, r in enumerate(rows) if lo <= r < hi]
            local = torch.tensor([rows[j] - lo for j in mine], dtype=torch.long)
            prompt_lens = [c.seq.num_prompt_tokens for c in sub.chunks]
            parts.append((ids, positions, meta, local, prompt_lens, lora_slots(self.model)))
            places.append(mine)
        logits = self.group.run_step(
            self.model, self.kv_caches, self.vocab_size, parts, batch.out.copy_blocks, self.stack
        )
        out = torch.empty(len(rows), self.vocab_size)
        for mine, part in zip(places, logits):
            out[mine] = part
        return out

    def sync_copies(self, copies: list[tuple[int, int, int]]) -> None:
        self.group.broadcast(("step", copies, None))
