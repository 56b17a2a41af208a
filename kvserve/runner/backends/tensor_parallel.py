"""Tensor parallelism: rank 0 broadcasts each step to the other ranks (runner/tensor_parallel.py),
every rank runs the PyTorch forward on its shard (all-reduces inside), and the vocabulary slices
of the logits are gathered on rank 0."""

from __future__ import annotations

import torch

from kvserve.runner.backends.base import StepBackend, StepBatch
from kvserve.runner.tensor_parallel import TensorParallelGroup, shard_logits


class TensorParallelBackend(StepBackend):
    name = "tensor_parallel"
    declined = "the C layer stack runs one whole model in one process"

    def __init__(self, group: TensorParallelGroup, model, kv_caches, vocab_size: int) -> None:
        super().__init__(model, kv_caches)
        self.group, self.vocab_size = group, vocab_size

    def describe(self) -> str:
        return f"PyTorch forward, {self.group.world} tensor-parallel ranks (gloo)"

    def logits(self, batch: StepBatch) -> torch.Tensor:
        b = batch
        self.group.broadcast(
            ("step", b.out.copy_blocks, (b.input_ids, b.positions, b.meta, b.rows))
        )
        try:
            hidden = self.model(b.input_ids, b.positions, b.meta, self.kv_caches)[b.rows]
        except RuntimeError as e:  # an all-reduce failed or timed out: a rank is gone
            raise self.group.lost("the step's all-reduces", e) from e
        return self.group.gather_logits(shard_logits(self.model, hidden), self.vocab_size)

    def sync_copies(self, copies: list[tuple[int, int, int]]) -> None:
        self.group.broadcast(("step", copies, None))
