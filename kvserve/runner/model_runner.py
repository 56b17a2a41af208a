"""ModelRunner: the one place that turns scheduler decisions into tensors.

Each step it flattens every scheduled chunk (prompt chunks and decodes alike) into one
unpadded batch — input_ids[T], positions[T], slot_mapping[T] plus per-request query spans,
context lengths and block tables — runs the model once, takes logits only at the last
position of chunks that sample, and samples.

How a step runs is decided here: through the C layer stack (runner/layer_stack.py) when the
model's weights allow it, else through the model's PyTorch forward.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kvserve.config import EngineConfig
from kvserve.core.scheduler import SchedulerOutput
from kvserve.model.loader import TORCH_DTYPES as _TORCH_DTYPES   # canonical dtype name -> torch.dtype
from kvserve.ops import kv_int8
from kvserve.ops.attention import AttentionMetadata
from kvserve.runner.layer_stack import CLayerStack
from kvserve.runner.sampler import Sampler, SamplingRow, TokenLogprobs, apply_token_bitmask, token_logprobs

log = logging.getLogger("kvserve")


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros from calloc (numpy): a large pool gets kernel-zeroed pages that cost RAM only once
    written, where torch.zeros would touch every page (9 s and 6 GB of RSS for a 6 GB pool)."""
    import numpy as np
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


@dataclass
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens start, start + 1, ... (start >= 1) computed by one chunk."""
    start: int
    entries: list[TokenLogprobs]


@dataclass
class StepOutput:
    sampled: dict[str, SampledToken] = field(default_factory=dict)         # by request id
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)

    def update(self, other: "StepOutput") -> None:
        self.sampled.update(other.sampled)
        self.prompt_logprobs.update(other.prompt_logprobs)


class ModelRunner:
    def __init__(self, loaded, config: EngineConfig, num_blocks: int):
        self.model = loaded.model
        self.arch = loaded.arch
        self.block_size = config.cache.block_size
        self.num_blocks = num_blocks
        self.seed = config.seed
        self.kv_dtype = _TORCH_DTYPES[config.cache.resolved_kv_dtype(config.model.dtype)]
        shape = (num_blocks, self.block_size, self.arch.num_kv_heads, self.arch.head_dim)
        if self.kv_dtype == torch.int8:       # rows of int8 values + a float32 scale (ops/kv_int8.py)
            shape = kv_int8.pool_shape(*shape)
        # One preallocated pool per layer for K and for V, zero-filled (masked padding in the batched
        # decode attention reads unwritten slots: garbage there could be NaN, and 0 * NaN = NaN).
        self.kv_caches = [(_lazy_zeros(shape, self.kv_dtype), _lazy_zeros(shape, self.kv_dtype))
                          for _ in range(self.arch.num_layers)]
        self.sampler = Sampler()
        self.layer_stack = CLayerStack.build(self.model)
        if self.layer_stack is not None:
            log.info("every step runs the C layer stack (%s build, ops/csrc/layer_stack.c)",
                     self.layer_stack.isa)
        else:
            log.info("steps run the PyTorch forward (no C layer stack for these weights)")
        self._generators: dict[str, torch.Generator] = {}
        torch.manual_seed(config.seed)

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)

    def free_request(self, request_id: str) -> None:
        """Forget per-request state (its seeded generator) once it has finished."""
        self._generators.pop(request_id, None)

    def forget_requests(self) -> None:
        """Drop the per-request state of every request (the engine reset)."""
        self._generators.clear()

    def _generator(self, request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        g = self._generators.get(request.request_id)
        if g is None:
            g = torch.Generator().manual_seed(seed)
            self._generators[request.request_id] = g
        return g

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long)
        for k, v in self.kv_caches:
            k[dst] = k[src]
            v[dst] = v[src]

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten the scheduled chunks into one batch; returns (input_ids, positions, meta, sample_idx)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        sample_idx: list[int] = []
        max_blocks = max(len(c.block_table) for c in out.chunks)
        tables = torch.zeros((len(out.chunks), max_blocks), dtype=torch.long)
        for i, c in enumerate(out.chunks):
            n = len(c.token_ids)
            end = c.start_pos + n
            input_ids.extend(c.token_ids)
            pos = range(c.start_pos, end)
            positions.extend(pos)
            table = c.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(end)
            tables[i, :len(table)] = torch.tensor(table, dtype=torch.long)
            if c.sample:
                sample_idx.append(query_start_loc[-1] - 1)
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long),
                                 query_start_loc=query_start_loc, seq_lens=seq_lens,
                                 block_tables=tables, block_size=bs)
        return (torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                meta, sample_idx)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, grammar=None) -> StepOutput:
        """Run one step: the sampled token of every chunk with sample=True, and the prompt
        logprobs of the chunks whose request asked for them. `grammar`: the step's grammar mask
        (`rows` by request id; `wait()` for the bitmask, which the engine may be filling while
        the forward pass runs), applied to the constrained rows before sampling."""
        if out.copy_blocks:
            self._copy_blocks(out.copy_blocks)
        if not out.chunks:
            return StepOutput()
        input_ids, positions, meta, sample_idx = self.prepare(out)
        spans = self._prompt_logprob_spans(out, meta.query_start_loc)
        rows = torch.tensor(sample_idx + [r for _, first, n, _ in spans for r in range(first, first + n)],
                            dtype=torch.long)
        if self.layer_stack is not None and self.layer_stack.runs(self.kv_caches):
            hidden = self.layer_stack(input_ids, positions, meta, self.kv_caches, rows,
                                      [c.request.num_prompt_tokens for c in out.chunks])
        else:
            hidden = self.model(input_ids, positions, meta, self.kv_caches)[rows]
        if rows.numel() == 0:
            return StepOutput()
        logits = self.model.compute_logits(hidden)
        step = StepOutput(prompt_logprobs=self._prompt_logprobs(spans, logits[len(sample_idx):]))
        sampling = [c for c in out.chunks if c.sample]
        if not sampling:
            return step
        constrained = [grammar is not None and c.request.request_id in grammar.rows for c in sampling]
        sample_logits = logits[:len(sample_idx)]
        if any(constrained):      # waits for the mask only when this batch has a constrained row
            bitmask = grammar.wait()
            apply_token_bitmask(sample_logits, [j for j, on in enumerate(constrained) if on],
                                bitmask[[grammar.rows[c.request.request_id] for c, on in zip(sampling, constrained)
                                         if on]])
        rows = [SamplingRow(params=c.request.sampling_params,
                            prompt_token_ids=c.request.prompt_token_ids,
                            output_token_ids=c.request.output_token_ids,
                            generator=self._generator(c.request),
                            eos_token_ids=c.request.eos_token_ids, constrained=on)
                for c, on in zip(sampling, constrained)]
        saved = [(r.generator, r.generator.get_state()) for r in rows if r.generator is not None]
        try:
            sampled = self.sampler(sample_logits, rows)
        except Exception:  # a failed step draws nothing: the engine may run it again
            for g, state in saved:
                g.set_state(state)
            raise
        step.sampled = {c.request.request_id: SampledToken(tok, lp)
                        for c, tok, lp in zip(sampling, sampled.token_ids, sampled.logprobs)}
        return step

    @staticmethod
    def _prompt_logprob_spans(out: SchedulerOutput, query_start_loc: list[int]) -> list[tuple]:
        """(chunk, first flat row, rows, first target position) for each chunk that computes
        prompt positions whose next token is a prompt token, of a request with prompt_logprobs."""
        spans = []
        for i, c in enumerate(out.chunks):
            req = c.request
            if req.sampling_params.prompt_logprobs is None:
                continue
            end = min(c.start_pos + len(c.token_ids), req.num_prompt_tokens - 1)
            if end > c.start_pos:
                spans.append((c, query_start_loc[i], end - c.start_pos, c.start_pos + 1))
        return spans

    @staticmethod
    def _prompt_logprobs(spans: list[tuple], logits: torch.Tensor) -> dict[str, PromptLogprobs]:
        result, row = {}, 0
        for c, _, n, start in spans:
            req = c.request
            targets = req.prompt_token_ids[start:start + n]
            result[req.request_id] = PromptLogprobs(
                start, token_logprobs(logits[row:row + n], targets, req.sampling_params.prompt_logprobs))
            row += n
        return result
