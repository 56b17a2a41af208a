"""ModelRunner: the one place that turns scheduler decisions into tensors.

Each step it flattens every scheduled chunk (prompt chunks and decodes alike) into one
unpadded batch — input_ids[T], positions[T], slot_mapping[T] plus per-request query spans,
context lengths and block tables — runs the model once, takes logits only at the last
position of chunks that sample, and samples.

A chunk with draft tokens (speculative decoding) gets logits at its last token and at every
draft; the verifier handed in by the engine (kvserve/spec/rejection.py, injected: the runner
does not import spec) turns them into the accepted drafts plus one token. Draft positions are
past the prompt, so the C layer stack computes them as it computes decodes (integer GEMV):
a verified token has the very logits it would have had decoded alone.

How a step runs is decided here, once at start: through the C layer stack (runner/layer_stack.py)
when the model's weights allow it, its layers share one KV group and the C attention reads its
KV pool, else through the model's PyTorch forward; start-up logs which, and names the tensor or
condition that kept the stack off (`why_not_layer_stack`).

KV groups (config.KVGroup: the layers with one attention window): each layer's K and V pools
hold its group's number of blocks, and each step gets one slot mapping and one set of block
tables per group; the metadata hands every layer its group's (AttentionMetadata.for_layer).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvserve.config import EngineConfig, KVGroup
from kvserve.core.scheduler import SchedulerOutput
from kvserve.model.loader import TORCH_DTYPES as _TORCH_DTYPES   # canonical dtype name -> torch.dtype
from kvserve.ops import kv_int8
from kvserve.ops.attention import AttentionMetadata, gpu_plan
from kvserve.runner.layer_stack import CLayerStack
from kvserve.runner.sampler import (Sampler, SamplerOutput, SamplingRow, TokenLogprobs, apply_token_bitmask,
                                    argmax_rows, take_rows, token_logprobs)

# (logits [R, V], one SamplingRow per fed position, draft token ids per request) -> per request
# the accepted drafts + one token: kvserve.spec.rejection.RejectionSampler
Verifier = Callable[[torch.Tensor, list[SamplingRow], list[list[int]]], list[SamplerOutput]]

log = logging.getLogger("kvserve")


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros from calloc (numpy): a large pool gets kernel-zeroed pages that cost RAM only once
    written, where torch.zeros would touch every page (9 s and 6 GB of RSS for a 6 GB pool)."""
    import numpy as np
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def _device_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros on a device, filled as bytes (fp8 has no fill kernel everywhere)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.zeros(nbytes, dtype=torch.uint8, device=device).view(dtype).view(shape)


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
    # by request id: one token, or with drafts the accepted ones then one more
    sampled: dict[str, list[SampledToken]] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)

    def update(self, other: "StepOutput") -> None:
        self.sampled.update(other.sampled)
        self.prompt_logprobs.update(other.prompt_logprobs)


class ModelRunner:
    def __init__(self, loaded, config: EngineConfig, num_blocks: int | list[KVGroup],
                 verifier: Verifier | None = None, tp=None, pp=None, own_layers: bool = False):
        """`num_blocks`: the KV groups with their pool sizes (config.CacheConfig.kv_groups), or a
        block count for one group holding every layer. `tp`: rank 0's TensorParallelGroup
        (runner/tensor_parallel.py) when the model is a tensor-parallel shard: each step is
        broadcast to the other ranks and the logits gathered from them. `pp`: rank 0's
        PipelineGroup (runner/pipeline_parallel.py) when the model holds pipeline stage 0.
        `own_layers`: the caller runs the model's layers itself (a pipeline stage's worker)."""
        self.tp = tp
        self.pp = pp
        self.vocab_size = loaded.arch.vocab_size
        self.model = loaded.model
        self.arch = loaded.arch
        self.block_size = config.cache.block_size
        if isinstance(num_blocks, int):
            num_blocks = [KVGroup(None, tuple(range(self.arch.num_layers)), num_blocks)]
        self.kv_groups = num_blocks
        self.layer_group = [0] * self.arch.num_layers     # layer -> its KV group
        for g, group in enumerate(self.kv_groups):
            for layer in group.layers:
                self.layer_group[layer] = g
        if sorted(l for g in self.kv_groups for l in g.layers) != list(range(self.arch.num_layers)):
            raise ValueError(f"the KV groups must hold each of the model's {self.arch.num_layers} layers once")
        self.num_blocks = sum(g.num_blocks for g in self.kv_groups)
        self.seed = config.seed
        if config.device == "auto" or config.model.dtype == "auto":
            raise ValueError("the runner takes a resolved configuration: config.on_device(cuda_available) first "
                             "(EngineCore does)")
        self.device = torch.device(config.device)
        on_gpu = self.device.type == "cuda"
        self.kv_dtype = _TORCH_DTYPES[config.cache.resolved_kv_dtype(config.model.dtype)]
        # One preallocated pool per layer for K and for V, sized by the layer's group, zero-filled
        # (masked padding in the batched decode attention reads unwritten slots: garbage there could
        # be NaN, and 0 * NaN = NaN).
        # On the GPU each pool holds one more block, past the scheduler's: the scratch block that
        # the padding rows of a captured decode graph write to (runner/cuda_graphs.py).
        self.kv_caches = []
        for layer in range(self.arch.num_layers):
            shape = (self.kv_groups[self.layer_group[layer]].num_blocks + on_gpu, self.block_size,
                     self.arch.num_kv_heads, self.arch.head_dim)
            if self.kv_dtype == torch.int8:       # rows of int8 values + a float32 scale (ops/kv_int8.py)
                shape = kv_int8.pool_shape(*shape)
            if on_gpu:
                self.kv_caches.append((_device_zeros(shape, self.kv_dtype, self.device),
                                       _device_zeros(shape, self.kv_dtype, self.device)))
            else:
                self.kv_caches.append((_lazy_zeros(shape, self.kv_dtype), _lazy_zeros(shape, self.kv_dtype)))
        self.sampler = Sampler()
        self.verifier = verifier
        # The C layer stack takes one block table and one window for every layer.
        one_window = len({self.arch.window_of(i) for i in range(self.arch.num_layers)}) == 1
        self.layer_stack, self.why_not_layer_stack = (None, None) if on_gpu else self._layer_stack(
            tp, pp, own_layers, one_window)
        # The GPU: attention in the Triton kernels (ops/triton_attention.py), decode steps replayed
        # from CUDA graphs when the model has one KV group.
        self.gpu_attention = on_gpu
        self.sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count if on_gpu else 4
        self.graphs = None
        if on_gpu and len(self.kv_groups) == 1 and tp is None and pp is None and not own_layers:
            from kvserve.runner.cuda_graphs import DecodeGraphs
            max_blocks = -(-min(config.model.max_model_len or self.arch.max_position_embeddings,
                                self.arch.max_position_embeddings) // self.block_size)
            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, config.scheduler.max_num_seqs,
                                       max_blocks, self.kv_groups[0].num_blocks, self.arch.num_kv_heads,
                                       self.sm_count)
            self.graphs.capture()
        if on_gpu:
            log.info("steps run on %s: Triton attention, %s", self.device,
                     f"CUDA graphs for decode batches up to {self.graphs.max_batch}" if self.graphs
                     else "no CUDA graphs (several KV groups)")
        elif self.layer_stack is not None:
            log.info("every step runs the C layer stack (%s build, ops/csrc/layer_stack.c)",
                     self.layer_stack.isa)
        else:
            log.info("steps run the PyTorch forward: %s", self.why_not_layer_stack)
        self._generators: dict[str, torch.Generator] = {}
        torch.manual_seed(config.seed)

    def _layer_stack(self, tp, pp, own_layers, one_window) -> tuple[CLayerStack | None, str | None]:
        """(the C layer stack, None) on the CPU, or (None, the condition or tensor that keeps this
        runner off it), which start-up logs."""
        if tp is not None or pp is not None:
            return None, ("the C layer stack runs one whole model in one process "
                          "(tensor/pipeline parallel)")
        if own_layers:
            return None, "a pipeline stage's worker runs its own layers"
        if len(self.kv_groups) != 1 or not one_window:
            return None, "the C layer stack takes one attention window for every layer"
        return CLayerStack.build_with_reason(self.model, self.kv_caches)

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
            g = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[request.request_id] = g
        return g

    def _copy_blocks(self, copies: list[tuple[int, int, int]]) -> None:
        """Copy-on-write: (group, src, dst) copies block src to dst in every layer of the group."""
        for g, group in enumerate(self.kv_groups):
            pairs = [(s, d) for cg, s, d in copies if cg == g]
            if not pairs:
                continue
            src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
            dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
            for layer in group.layers:
                k, v = self.kv_caches[layer]
                k[dst] = k[src]
                v[dst] = v[src]

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten the scheduled chunks into one batch; returns (input_ids, positions, meta, sample_idx):
        sample_idx holds, per chunk that samples, the rows of its last known token and its drafts."""
        bs = self.block_size
        num_groups = len(self.kv_groups)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in range(num_groups)]
        query_start_loc = [0]
        seq_lens: list[int] = []
        sample_idx: list[int] = []
        tables = [torch.zeros((len(out.chunks), max(len(c.block_tables[g]) for c in out.chunks)), dtype=torch.long)
                  for g in range(num_groups)]
        for i, c in enumerate(out.chunks):
            n = len(c.token_ids)
            end = c.start_pos + n
            input_ids.extend(c.token_ids)
            pos = range(c.start_pos, end)
            positions.extend(pos)
            for g, table in enumerate(c.block_tables):
                slots[g].extend(table[p // bs] * bs + p % bs for p in pos)
                tables[g][i, :len(table)] = torch.tensor(table, dtype=torch.long)
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(end)
            if c.sample:      # the last known token, then every draft
                sample_idx.extend(range(query_start_loc[-1] - 1 - len(c.draft_token_ids), query_start_loc[-1]))
        metas = [AttentionMetadata(slot_mapping=torch.tensor(slots[g], dtype=torch.long),
                                   query_start_loc=query_start_loc, seq_lens=seq_lens,
                                   block_tables=tables[g], block_size=bs) for g in range(num_groups)]
        meta = metas[0]
        if num_groups > 1:
            meta.layers = [metas[g] for g in self.layer_group]
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
            ranks = self.tp or self.pp
            if ranks is not None and out.copy_blocks:      # the other ranks copy their pools' blocks too
                ranks.broadcast(("step", out.copy_blocks, None))
            return StepOutput()
        input_ids, positions, meta, sample_idx = self.prepare(out)
        spans = self._prompt_logprob_spans(out, meta.query_start_loc)
        rows = torch.tensor(sample_idx + [r for _, first, n, _ in spans for r in range(first, first + n)],
                            dtype=torch.long)
        if self.tp is not None:
            logits = self._tensor_parallel_logits(out, input_ids, positions, meta, rows)
        elif self.pp is not None:
            logits = self.pp.step_logits(self, out)
        else:
            hidden = self._hidden(out, input_ids, positions, meta, rows)
            if rows.numel() == 0:
                return StepOutput()
            logits = self.model.compute_logits(hidden)
        if rows.numel() == 0:
            return StepOutput()
        step = StepOutput(prompt_logprobs=self._prompt_logprobs(spans, logits[len(sample_idx):]))
        sampling = [c for c in out.chunks if c.sample]
        if not sampling:
            return step
        constrained = [grammar is not None and c.request.request_id in grammar.rows for c in sampling]
        first_rows, row = [], 0
        for c in sampling:
            first_rows.append(row)
            row += 1 + len(c.draft_token_ids)
        sample_logits = logits[:len(sample_idx)]
        if any(constrained):      # waits for the mask only when this batch has a constrained row
            assert not any(c.draft_token_ids for c, on in zip(sampling, constrained) if on), \
                "constrained requests do not speculate"
            bitmask = grammar.wait()
            apply_token_bitmask(sample_logits, [first_rows[j] for j, on in enumerate(constrained) if on],
                                bitmask[[grammar.rows[c.request.request_id] for c, on in zip(sampling, constrained)
                                         if on]])
        plain = [j for j, c in enumerate(sampling) if not c.draft_token_ids]
        spec = [j for j, c in enumerate(sampling) if c.draft_token_ids]
        plain_rows = [self._sampling_row(sampling[j].request, constrained[j]) for j in plain]
        spec_rows = [r for j in spec for r in self._position_rows(sampling[j])]
        generators = {id(r.generator): r.generator for r in plain_rows + spec_rows if r.generator is not None}
        saved = [(g, g.get_state()) for g in generators.values()]
        try:
            if plain:
                plain_logits = sample_logits if not spec else sample_logits[torch.tensor([first_rows[j] for j in plain])]
                out_plain = self.sampler(plain_logits, plain_rows)
                for j, tok, lp in zip(plain, out_plain.token_ids, out_plain.logprobs):
                    step.sampled[sampling[j].request.request_id] = [SampledToken(tok, lp)]
            if spec:
                if self.verifier is None:
                    raise RuntimeError("draft tokens were scheduled but this runner has no verifier")
                rows_idx = [first_rows[j] + i for j in spec for i in range(1 + len(sampling[j].draft_token_ids))]
                verified = self.verifier(take_rows(sample_logits, rows_idx), spec_rows,
                                         [sampling[j].draft_token_ids for j in spec])
                for j, v in zip(spec, verified):
                    step.sampled[sampling[j].request.request_id] = [SampledToken(t, lp)
                                                                    for t, lp in zip(v.token_ids, v.logprobs)]
        except Exception:  # a failed step draws nothing: the engine may run it again
            for g, state in saved:
                g.set_state(state)
            raise
        return step

    def _hidden(self, out: SchedulerOutput, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, rows: torch.Tensor) -> torch.Tensor:
        """The model's final hidden states at the flat rows `rows`: the C layer stack or the
        PyTorch forward (the one place that chooses)."""
        if self.layer_stack is not None and self.layer_stack.runs(self.kv_caches):
            return self.layer_stack(input_ids, positions, meta, self.kv_caches, rows,
                                    [c.request.num_prompt_tokens for c in out.chunks])
        if self.graphs is not None and input_ids.numel() == meta.num_seqs and \
                self.graphs.runs(meta.num_seqs, meta.block_tables.shape[1]):
            return self.graphs(input_ids, positions, meta)[rows.to(self.device)]
        if self.gpu_attention:
            input_ids, positions = input_ids.to(self.device), positions.to(self.device)
            for m in {id(m): m for m in meta.layers or [meta]}.values():
                m.slot_mapping = m.slot_mapping.to(self.device)
                m.gpu = gpu_plan(m, self.device, self.arch.num_kv_heads, self.sm_count)
            rows = rows.to(self.device)
        return self.model(input_ids, positions, meta, self.kv_caches)[rows]

    def _tensor_parallel_logits(self, out: SchedulerOutput, input_ids, positions, meta, rows) -> torch.Tensor:
        """Every rank runs the step on its shard; the vocabulary slices of the logits are gathered."""
        from kvserve.runner.tensor_parallel import shard_logits
        self.tp.broadcast(("step", out.copy_blocks, (input_ids, positions, meta, rows)))
        try:
            hidden = self.model(input_ids, positions, meta, self.kv_caches)[rows]
        except RuntimeError as e:           # an all-reduce failed or timed out: a rank is gone
            raise self.tp.lost("the step's all-reduces", e) from e
        return self.tp.gather_logits(shard_logits(self.model, hidden), self.vocab_size)

    @torch.inference_mode()
    def greedy_tokens(self, out: SchedulerOutput) -> list[int]:
        """The argmax token after the last token of every chunk (a draft model's step: no
        sampler, no drafts to verify, every chunk samples)."""
        if out.copy_blocks:
            self._copy_blocks(out.copy_blocks)
        if not out.chunks:
            return []
        input_ids, positions, meta, _ = self.prepare(out)
        rows = torch.tensor(meta.query_start_loc[1:], dtype=torch.long) - 1
        logits = self.model.compute_logits(self._hidden(out, input_ids, positions, meta, rows))
        return argmax_rows(logits).tolist()

    def _sampling_row(self, req, constrained: bool = False) -> SamplingRow:
        return SamplingRow(params=req.sampling_params, prompt_token_ids=req.prompt_token_ids,
                           output_token_ids=req.output_token_ids, generator=self._generator(req),
                           eos_token_ids=req.eos_token_ids, constrained=constrained,
                           beam_candidates=req.beam_candidates)

    def _position_rows(self, chunk) -> list[SamplingRow]:
        """One SamplingRow per fed position of a chunk with drafts: position j sees the drafts
        before it as generated tokens (min_tokens, penalties), as one-token steps would."""
        first = self._sampling_row(chunk.request)
        drafts = chunk.draft_token_ids
        return [first] + [SamplingRow(first.params, first.prompt_token_ids, first.output_token_ids + drafts[:j],
                                      first.generator, first.eos_token_ids)
                          for j in range(1, len(drafts) + 1)]

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
