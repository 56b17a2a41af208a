"""The GPU: the model's PyTorch forward with attention in the Triton kernels
(ops/triton_attention.py), and decode-only steps replayed from CUDA graphs (runner/cuda_graphs.py)
when the model has one KV group. Under TRITON_INTERPRET=1 the same backend runs on CPU tensors
(tests/model/test_triton_path_cpu.py), without graphs."""

from __future__ import annotations

import torch

from kvserve.ops.attention import gpu_plan
from kvserve.runner.backends.base import StepBackend, StepBatch
from kvserve.runner.cuda_graphs import DecodeGraphs


class CudaBackend(StepBackend):
    name = "cuda"

    def __init__(
        self,
        model,
        kv_caches,
        device: torch.device,
        num_kv_heads: int,
        sm_count: int = 4,
        graphs: DecodeGraphs | None = None,
        no_graphs: str | None = None,
    ) -> None:
        """`graphs`: the captured decode graphs, or None (`no_graphs` says why)."""
        super().__init__(model, kv_caches)
        self.device, self.num_kv_heads, self.sm_count = device, num_kv_heads, sm_count
        self.graphs, self.no_graphs = graphs, no_graphs

    @classmethod
    def build(
        cls,
        model,
        kv_caches,
        kv_groups,
        device: torch.device,
        *,
        block_size,
        max_num_seqs,
        max_model_len,
        num_kv_heads,
    ) -> CudaBackend:
        """The backend for `device`, with its decode graphs captured (one KV group only: a graph
        takes one block table). Each pool holds a scratch block past the scheduler's, where the
        padding rows of a graph write."""
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        if len(kv_groups) != 1:
            return cls(model, kv_caches, device, num_kv_heads, sm_count, None, "several KV groups")
        graphs = DecodeGraphs(
            model,
            kv_caches,
            block_size,
            max_num_seqs,
            -(-max_model_len // block_size),
            kv_groups[0].num_blocks,
            num_kv_heads,
            sm_count,
        )
        graphs.capture()
        return cls(model, kv_caches, device, num_kv_heads, sm_count, graphs)

    def describe(self) -> str:
        if self.graphs is not None:
            graphs = f"CUDA graphs for decode batches up to {self.graphs.max_batch}"
        else:
            graphs = f"no CUDA graphs ({self.no_graphs})" if self.no_graphs else "no CUDA graphs"
        return f"PyTorch forward on {self.device}, Triton attention, {graphs}"

    def hidden(self, batch: StepBatch) -> torch.Tensor:
        meta, rows = batch.meta, batch.rows.to(self.device)
        if (
            self.graphs is not None
            and batch.input_ids.numel() == meta.num_seqs
            and self.graphs.runs(meta.num_seqs, meta.block_tables.shape[1])
        ):
            return self.graphs(batch.input_ids, batch.positions, meta)[rows]
        input_ids, positions = batch.input_ids.to(self.device), batch.positions.to(self.device)
        for m in {id(m): m for m in meta.layers or [meta]}.values():
            m.slot_mapping = m.slot_mapping.to(self.device)
            m.gpu = gpu_plan(m, self.device, self.num_kv_heads, self.sm_count)
        return self.model(input_ids, positions, meta, self.kv_caches)[rows]
