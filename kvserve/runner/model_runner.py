"""ModelRunner: the one place that turns scheduler decisions into tensors.

Each step it flattens every scheduled chunk (prompt chunks and decodes alike) into one unpadded
batch (input_ids[T], positions[T], slot_mapping[T] plus per-sequence query spans, context
lengths and block tables), has its step backend compute the logits at the last position of the
chunks that sample, and samples.

How a step runs is the backend's (runner/backends/: the C layer stack, the PyTorch forward, the
GPU's Triton attention and CUDA graphs, tensor or pipeline parallel), chosen once at start by
select_backend; start-up logs it as "steps: <step_path>", with the condition that kept a faster
path off and the setting that brings it back. The runner holds what every backend shares: the
KV pools, the flat batch, sampling and grammar masks, speculative verification, prompt logprobs,
seeded generators.

A chunk with draft tokens (speculative decoding) gets logits at its last token and at every
draft; the verifier handed in by the engine (kvserve/spec/rejection.py, injected: the runner
does not import spec) turns them into the accepted drafts plus one token.

KV groups (config.KVGroup: the layers with one attention window): each layer's pools hold its
group's number of blocks, and each step gets one slot mapping and one set of block tables per
group; the metadata hands every layer its group's (AttentionMetadata.for_layer).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kvserve.config import EngineConfig, KVGroup
from kvserve.core.scheduler import SchedulerOutput
from kvserve.model.loader import TORCH_DTYPES as _TORCH_DTYPES  # dtype name -> torch.dtype
from kvserve.ops.attention import AttentionMetadata
from kvserve.runner.backends import StepBackend, StepBatch, select_backend
from kvserve.runner.kv_pools import kv_pools, layer_groups
from kvserve.runner.sampler import (
    Sampler,
    SamplerOutput,
    SamplingRow,
    apply_token_bitmask,
    argmax_rows,
    take_rows,
)
from kvserve.runner.step_output import (
    PromptLogprobs,
    SampledToken,
    StepOutput,
    prompt_logprob_spans,
    prompt_logprobs,
)

# (logits [R, V], one SamplingRow per fed position, draft token ids per sequence) -> per sequence
# the accepted drafts + one token: kvserve.spec.rejection.RejectionSampler
Verifier = Callable[[torch.Tensor, list[SamplingRow], list[list[int]]], list[SamplerOutput]]

log = logging.getLogger("kvserve")
# What a step returns lives in step_output.py; the engine imports it from here too.
__all__ = ["ModelRunner", "PromptLogprobs", "SampledToken", "StepOutput", "Verifier"]


class ModelRunner:
    def __init__(
        self,
        loaded,
        config: EngineConfig,
        num_blocks: int | list[KVGroup],
        *,
        max_model_len: int,
        verifier: Verifier | None = None,
        tp=None,
        pp=None,
        worker: bool = False,
    ):
        """`num_blocks`: the KV groups with their pool sizes (config.CacheConfig.kv_groups), or a
        block count for one group holding every layer. `max_model_len`: the context length the
        scheduler admits (ModelConfig.context_len). `tp`: rank 0's TensorParallelGroup
        (runner/tensor_parallel.py) when the model is a tensor-parallel shard; `pp`: rank 0's
        PipelineGroup (runner/pipeline_parallel.py) when it holds pipeline stage 0. `worker`: a
        worker rank's runner (its pools), whose own loop runs the model."""
        if config.device == "auto" or config.model.dtype == "auto":
            raise ValueError(
                "the runner takes a resolved configuration: config.on_device(cuda_available) "
                "first (the engine's builder does)"
            )
        self.model, self.arch = loaded.model, loaded.arch
        self.vocab_size = loaded.arch.vocab_size
        self.tp, self.pp = tp, pp
        self.max_model_len = max_model_len
        self.block_size = config.cache.block_size
        self.kv_groups, self.layer_group = layer_groups(num_blocks, self.arch.num_layers)
        self.num_blocks = sum(g.num_blocks for g in self.kv_groups)
        self.seed = config.seed
        self.device = torch.device(config.device)
        self.kv_dtype = _TORCH_DTYPES[config.cache.resolved_kv_dtype(config.model.dtype)]
        self.kv_caches = kv_pools(
            self.arch, self.kv_groups, self.layer_group, self.block_size, self.kv_dtype, self.device
        )
        self.sampler = Sampler()
        self.verifier = verifier
        self.backend: StepBackend
        self.backend, self.backend_reason = select_backend(
            self.model,
            self.arch,
            self.kv_caches,
            self.kv_groups,
            self.device,
            block_size=self.block_size,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_model_len=max_model_len,
            prepare=self.prepare,
            tp=tp,
            pp=pp,
            worker=worker,
            lora=config.enable_lora,
        )
        reason = f"; {self.backend_reason}" if self.backend_reason else ""
        log.info("steps: %s%s", self.step_path, reason)
        self._generators: dict[str, torch.Generator] = {}
        torch.manual_seed(config.seed)

    # ---- how steps run (the backend), as the engine, tests and benchmarks read it ----
    @property
    def step_path(self) -> str:
        """How a step runs, e.g. "C layer stack, avx2 kernels" (benchmarks record it)."""
        return self.backend.describe()

    @property
    def layer_stack(self):
        """The CLayerStack every step runs, or None."""
        return getattr(self.backend, "stack", None)

    @property
    def why_not_layer_stack(self) -> str | None:
        """The condition that keeps the C layer stack off (None: it runs, or the GPU runs)."""
        return self.backend.declined

    @property
    def gpu_attention(self) -> bool:
        return self.backend.name == "cuda"

    @property
    def graphs(self):
        """The captured decode graphs (runner/cuda_graphs.py), or None."""
        return getattr(self.backend, "graphs", None)

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)

    # ---- per-sequence state ----
    def free_sequence(self, seq_id: str) -> None:
        """Forget per-sequence state (its seeded generator) once it has finished."""
        self._generators.pop(seq_id, None)

    def forget_sequences(self) -> None:
        """Drop the per-sequence state of every sequence (the engine reset)."""
        self._generators.clear()

    def _generator(self, seq) -> torch.Generator | None:
        seed = seq.sampling_params.seed
        if seed is None:
            return None
        g = self._generators.get(seq.seq_id)
        if g is None:
            g = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[seq.seq_id] = g
        return g

    def copy_blocks(self, copies: list[tuple[int, int, int]]) -> None:
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

    # ---- the flat batch ----
    def prepare(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten the scheduled chunks into one batch; returns (input_ids, positions, meta,
        sample_idx): sample_idx holds, per chunk that samples, the rows of its last known token
        and its drafts."""
        bs, num_groups = self.block_size, len(self.kv_groups)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in range(num_groups)]
        query_start_loc, seq_lens, sample_idx = [0], [], []
        width = [max(len(c.block_tables[g]) for c in out.chunks) for g in range(num_groups)]
        tables = [torch.zeros((len(out.chunks), w), dtype=torch.long) for w in width]
        for i, c in enumerate(out.chunks):
            n = len(c.token_ids)
            end = c.start_pos + n
            input_ids.extend(c.token_ids)
            pos = range(c.start_pos, end)
            positions.extend(pos)
            for g, table in enumerate(c.block_tables):
                slots[g].extend(table[p // bs] * bs + p % bs for p in pos)
                tables[g][i, : len(table)] = torch.tensor(table, dtype=torch.long)
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(end)
            if c.sample:  # the last known token, then every draft
                last = query_start_loc[-1]
                sample_idx.extend(range(last - 1 - len(c.draft_token_ids), last))
        metas = [
            AttentionMetadata(
                slot_mapping=torch.tensor(slots[g], dtype=torch.long),
                query_start_loc=query_start_loc,
                seq_lens=seq_lens,
                block_tables=tables[g],
                block_size=bs,
            )
            for g in range(num_groups)
        ]
        meta = metas[0]
        if num_groups > 1:
            meta.layers = [metas[g] for g in self.layer_group]
        lora = getattr(self.model, "lora_step", None)  # LoRA adapters: each token's slot
        if lora is not None:
            slots = [lora.slot_of(c.seq.lora_key) for c in out.chunks]
            counts = [len(c.token_ids) for c in out.chunks]
            lora.set(torch.tensor(slots, dtype=torch.long).repeat_interleave(torch.tensor(counts)))
        ids = torch.tensor(input_ids, dtype=torch.long)
        return ids, torch.tensor(positions, dtype=torch.long), meta, sample_idx

    def batch(self, out: SchedulerOutput) -> StepBatch:
        """The step's flat batch with the rows it needs logits at: the sampling chunks' rows,
        then the prompt positions of the chunks whose sequence asked for prompt logprobs."""
        input_ids, positions, meta, sample_idx = self.prepare(out)
        spans = prompt_logprob_spans(out, meta.query_start_loc)
        prompt_rows = [r for _, first, n, _ in spans for r in range(first, first + n)]
        rows = torch.tensor(sample_idx + prompt_rows, dtype=torch.long)
        return StepBatch(out, input_ids, positions, meta, rows, len(sample_idx), spans)

    # ---- steps ----
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, grammar=None) -> StepOutput:
        """Run one step: the sampled token of every chunk with sample=True, and the prompt
        logprobs of the chunks whose sequence asked for them. `grammar`: the step's grammar mask
        (`rows` by sequence id; `wait()` for the bitmask, which the engine may be filling while
        the forward pass runs), applied to the constrained rows before sampling."""
        if out.copy_blocks:
            self.copy_blocks(out.copy_blocks)
        if not out.chunks:
            if out.copy_blocks:  # ranks elsewhere copy their pools' blocks too
                self.backend.sync_copies(out.copy_blocks)
            return StepOutput()
        batch = self.batch(out)
        logits = self.backend.logits(batch)
        if batch.rows.numel() == 0:
            return StepOutput()
        n = batch.num_sample_rows
        step = StepOutput(prompt_logprobs=prompt_logprobs(batch.spans, logits[n:]))
        step.sampled = self._sample([c for c in out.chunks if c.sample], logits[:n], grammar)
        return step

    @torch.inference_mode()
    def greedy_tokens(self, out: SchedulerOutput) -> list[int]:
        """The argmax token after the last token of every chunk (a draft model's step: no
        sampler, no drafts to verify, every chunk samples)."""
        if out.copy_blocks:
            self.copy_blocks(out.copy_blocks)
        if not out.chunks:
            return []
        input_ids, positions, meta, _ = self.prepare(out)
        rows = torch.tensor(meta.query_start_loc[1:], dtype=torch.long) - 1
        batch = StepBatch(out, input_ids, positions, meta, rows, len(rows))
        return argmax_rows(self.backend.logits(batch)).tolist()

    # ---- sampling ----
    def _sample(self, sampling: list, logits: torch.Tensor, grammar) -> dict:
        """The tokens of the sampling chunks from their rows of `logits` (per chunk its last
        known token, then its drafts): drawn, or verified against the drafts. A failed step
        draws nothing: the seeded generators are restored and the engine may run it again."""
        first_rows, row = [], 0
        for c in sampling:
            first_rows.append(row)
            row += 1 + len(c.draft_token_ids)
        constrained = [grammar is not None and c.seq.seq_id in grammar.rows for c in sampling]
        if any(constrained):  # waits for the mask only when this batch has a constrained row
            assert not any(c.draft_token_ids for c, on in zip(sampling, constrained) if on), (
                "constrained sequences do not speculate"
            )
            on = [j for j, c in enumerate(constrained) if c]
            bitmask = grammar.wait()[[grammar.rows[sampling[j].seq.seq_id] for j in on]]
            apply_token_bitmask(logits, [first_rows[j] for j in on], bitmask)
        plain = [j for j, c in enumerate(sampling) if not c.draft_token_ids]
        spec = [j for j, c in enumerate(sampling) if c.draft_token_ids]
        plain_rows = [self._sampling_row(sampling[j].seq, constrained[j]) for j in plain]
        spec_rows = [r for j in spec for r in self._position_rows(sampling[j])]
        every = plain_rows + spec_rows
        generators = {id(r.generator): r.generator for r in every if r.generator is not None}
        saved = [(g, g.get_state()) for g in generators.values()]
        sampled: dict[str, list[SampledToken]] = {}
        try:
            if plain:
                rows = logits if not spec else logits[torch.tensor([first_rows[j] for j in plain])]
                drawn = self.sampler(rows, plain_rows)
                for j, tok, lp in zip(plain, drawn.token_ids, drawn.logprobs):
                    sampled[sampling[j].seq.seq_id] = [SampledToken(tok, lp)]
            if spec:
                if self.verifier is None:
                    raise RuntimeError(
                        "draft tokens were scheduled but this runner has no verifier"
                    )
                fed = [
                    first_rows[j] + i
                    for j in spec
                    for i in range(1 + len(sampling[j].draft_token_ids))
                ]
                drafts = [sampling[j].draft_token_ids for j in spec]
                verified = self.verifier(take_rows(logits, fed), spec_rows, drafts)
                for j, v in zip(spec, verified):
                    tokens = [SampledToken(t, lp) for t, lp in zip(v.token_ids, v.logprobs)]
                    sampled[sampling[j].seq.seq_id] = tokens
        except Exception:
            for g, state in saved:
                g.set_state(state)
            raise
        return sampled

    def _sampling_row(self, seq, constrained: bool = False) -> SamplingRow:
        return SamplingRow(
            params=seq.sampling_params,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            generator=self._generator(seq),
            eos_token_ids=seq.eos_token_ids,
            constrained=constrained,
            beam_candidates=seq.beam_candidates,
        )

    def _position_rows(self, chunk) -> list[SamplingRow]:
        """One SamplingRow per fed position of a chunk with drafts: position j sees the drafts
        before it as generated tokens (min_tokens, penalties), as one-token steps would."""
        first = self._sampling_row(chunk.seq)
        drafts = chunk.draft_token_ids
        return [first] + [
            SamplingRow(
                first.params,
                first.prompt_token_ids,
                first.output_token_ids + drafts[:j],
                first.generator,
                first.eos_token_ids,
            )
            for j in range(1, len(drafts) + 1)
        ]
