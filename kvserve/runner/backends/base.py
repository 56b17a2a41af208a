"""The interface every step backend implements, and the flat batch it runs.

A backend runs the model over one step's flat batch (ModelRunner.prepare) and returns the logits
of the rows the step needs; everything else (the KV pools, sampling, grammar masks, speculative
verification, prompt logprobs) is the runner's, shared by every backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.core.scheduler import SchedulerOutput
from kvserve.ops.attention import AttentionMetadata


@dataclass
class StepBatch:
    """One step flattened (ModelRunner.prepare) and the flat rows whose logits it needs."""

    out: SchedulerOutput
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    rows: torch.Tensor  # int64: the sampling chunks' rows first, then prompt-logprob rows
    num_sample_rows: int = 0  # rows[:num_sample_rows]: last known token and drafts per chunk
    # (chunk, first flat row, rows, first target position) per chunk with prompt logprobs
    spans: list[tuple] = field(default_factory=list)
    # every sampling chunk is a plain greedy one (ModelRunner._sample takes one argmax)
    greedy: bool = False


class StepBackend:
    """How a step runs. `name`: a short tag; `describe()`: the one line that start-up logs and
    benchmarks record (ModelRunner.step_path); `declined`: the condition that keeps the C layer
    stack off (None where it runs, or on the GPU where it does not apply)."""

    name = "base"
    declined: str | None = None

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.model = model
        self.kv_caches = kv_caches

    def describe(self) -> str:
        raise NotImplementedError

    def hidden(self, batch: StepBatch) -> torch.Tensor:
        """The final hidden states at batch.rows, [len(rows), hidden]."""
        raise NotImplementedError

    def logits(self, batch: StepBatch) -> torch.Tensor:
        """The logits at batch.rows (float32, [len(rows), vocab]); the step writes its KV even
        when there is no row."""
        hidden = self.hidden(batch)
        return self.model.compute_logits(hidden) if hidden.shape[0] else hidden

    def sync_copies(self, copies: list[tuple[int, int, int]]) -> None:
        """A step without chunks that copies KV blocks: ranks elsewhere apply the copies too."""
