"""The C layer stack (runner/layer_stack.py, ops/csrc/layer_stack.c): every layer of every step
in one C call, for a Llama-family model whose linears all hold packed GGUF blocks."""

from __future__ import annotations

import torch

from kvserve.runner.backends.base import StepBackend, StepBatch
from kvserve.runner.layer_stack import CLayerStack


class LayerStackBackend(StepBackend):
    name = "layer_stack"

    def __init__(self, stack: CLayerStack, kv_caches) -> None:
        super().__init__(stack.model, kv_caches)
        self.stack = stack

    def describe(self) -> str:
        return f"C layer stack, {self.stack.isa} kernels"

    def hidden(self, batch: StepBatch) -> torch.Tensor:
        prompt_lens = [c.seq.num_prompt_tokens for c in batch.out.chunks]
        return self.stack(
            batch.input_ids, batch.positions, batch.meta, self.kv_caches, batch.rows, prompt_lens
        )
