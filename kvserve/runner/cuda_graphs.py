"""CUDA graphs of the decode step: the model's forward over a batch of single-token decodes,
captured once per batch size (1, 2, 4, 8, then every 16 up to the largest) and replayed with the
step's batch padded to the next captured size.

A graph replays fixed addresses, so a captured step reads its inputs from static buffers: token
ids, positions, KV slots, context lengths and block tables, copied in before each replay. Padding
rows decode token 0 at position 0 into a scratch block that the pool holds past the scheduler's
blocks (their KV is never read by a real request), so every padded replay computes real rows
exactly as an unpadded step would.
"""

from __future__ import annotations

import logging

import torch

from kvserve.ops.attention import AttentionMetadata, GpuPlan, decode_splits

log = logging.getLogger("kvserve")


def graph_sizes(max_batch: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, then multiples of 16, the last one >= max_batch."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch + 16, 16)) if max_batch > 8 else [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(
        self,
        model,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        max_batch: int,
        max_blocks: int,
        scratch_block: int,
        num_kv_heads: int,
        sm_count: int,
    ):
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.sizes = graph_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_blocks = max_blocks
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        dev = kv_caches[0][0].device
        n = self.max_batch
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), self.scratch_slot, dtype=torch.long, device=dev)
        self.lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.tables = torch.full((n, max_blocks), scratch_block, dtype=torch.int32, device=dev)
        self.rows = torch.arange(n, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.num_kv_heads, self.sm_count = num_kv_heads, sm_count
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # decode steps run from a graph

    def _meta(self, b: int) -> AttentionMetadata:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:b],
            query_start_loc=list(range(b + 1)),
            seq_lens=[1] * b,
            block_tables=self.tables[:b],
            block_size=self.block_size,
        )
        meta.gpu = GpuPlan(
            query_start_loc=self.qsl[: b + 1],
            seq_lens=self.lens[:b],
            block_tables=self.tables[:b],
            decode_rows=self.rows[:b],
            decode_lens=self.lens[:b],
            decode_tables=self.tables[:b],
            prefill_seqs=self.rows[:0],
            num_decodes=b,
            max_q_len=0,
            num_splits=decode_splits(b, self.num_kv_heads, self.sm_count),
        )
        return meta

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (compiles the Triton kernels) and capture every size, largest first, in one
        memory pool. The buffers point every row at the scratch block meanwhile."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.sizes):
                self.model(self.ids[:b], self.positions[:b], self._meta(b), self.kv_caches)
        torch.cuda.current_stream().wait_stream(stream)
        for b in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(self.ids[:b], self.positions[:b], self._meta(b), self.kv_caches)
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize()
        log.info("CUDA graphs captured for decode batches of %s", ", ".join(map(str, self.sizes)))

    def runs(self, num_seqs: int, table_width: int) -> bool:
        return bool(self.graphs) and num_seqs <= self.max_batch and table_width <= self.max_blocks

    @torch.inference_mode()
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [B, H] of a step of B single-token decodes (host tensors from
        ModelRunner.prepare), by replaying the smallest captured size >= B."""
        n = input_ids.numel()
        b = next(s for s in self.sizes if s >= n)
        width = meta.block_tables.shape[1]
        self.ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slots[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.lens[:n].copy_(torch.tensor(meta.seq_lens, dtype=torch.int32), non_blocking=True)
        self.tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if b > n:  # padding rows: the scratch block, one token
            self.ids[n:b].zero_()
            self.positions[n:b].zero_()
            self.slots[n:b].fill_(self.scratch_slot)
            self.lens[n:b].fill_(1)
            self.tables[n:b, 0].fill_(self.scratch_block)
        graph, out = self.graphs[b]
        graph.replay()
        self.replays += 1
        return out[:n]
