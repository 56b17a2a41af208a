"""The model's own PyTorch forward: any model, any weight format, on the CPU."""

from __future__ import annotations

import torch

from kvserve.runner.backends.base import StepBackend, StepBatch


class TorchForward(StepBackend):
    name = "torch"

    def __init__(self, model, kv_caches, declined: str | None = None) -> None:
        """`declined`: why the C layer stack does not run this model (the description names it)."""
        super().__init__(model, kv_caches)
        self.declined = declined

    def describe(self) -> str:
        return f"PyTorch forward ({self.declined})" if self.declined else "PyTorch forward"

    def hidden(self, batch: StepBatch) -> torch.Tensor:
        return self.model(batch.input_ids, batch.positions, batch.meta, self.kv_caches)[batch.rows]
