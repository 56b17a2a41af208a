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

Async scheduling: while a step runs, the engine's planning thread flattens the next step, planned
with placeholder tokens (`batch`: nothing the running step reads is written; the step is handed
its batch flattened before), and once this step's tokens are in, `fill_placeholders` writes them
into that planned batch.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import numpy as np
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
    argmax_list,
    is_plain_greedy,
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
# What a step returns lives in step_output.py, its batch in backends; the engine imports them
# from here.
__all__ = [
    "ModelRunner",
    "PromptLogprobs",
    "SampledToken",
    "StepBatch",
    "StepOutput",
    "Verifier",
]


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
        )
        reason = f"; {self.backend_reason}" if self.backend_reason else ""
        log.info("steps: %s%s", self.step_path, reason)
        self._init_sequence_state(config.scheduler.max_num_seqs)
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
    def _init_sequence_state(self, max_num_seqs: int) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self._states: dict[str, _SeqState] = {}  # by sequence id: its row, its sampling kind
        self._tables = _BlockTables(len(self.kv_groups))
        self._max_states = 4 * max_num_seqs + 64  # past this, unscheduled ones are dropped

    def free_sequence(self, seq_id: str) -> None:
        """Forget per-sequence state (its seeded generator, its block-table row) once it has
        finished."""
        self._generators.pop(seq_id, None)
        st = self._states.pop(seq_id, None)
        if st is not None:
            self._tables.release(st.row)

    def forget_sequences(self) -> None:
        """Drop the per-sequence state of every sequence (the engine reset)."""
        self._generators.clear()
        self._states.clear()
        self._tables = _BlockTables(len(self.kv_groups))

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
    def _state(self, seq, keep: set[str]) -> _SeqState:
        """The sequence's runner state, made on first sight (and again for another sequence
        under the same id). When there are many, those of sequences not in `keep` (this batch's)
        are dropped first: finished ones whose end the engine never reported."""
        st = self._states.get(seq.seq_id)
        if st is not None and st.seq is seq:
            return st
        if st is None and len(self._states) >= self._max_states:
            for sid in [k for k in self._states if k not in keep]:
                self._tables.release(self._states.pop(sid).row)
        if st is None:
            st = self._states[seq.seq_id] = _SeqState(self._tables.take())
        st.bind(seq)
        return st

    def _flatten(self, out: SchedulerOutput) -> _Flat:
        """The flat batch's ids and positions, each chunk's persistent block-table row (rewritten
        only when its table changed: ScheduledChunk.table_version), the sampled rows, and whether
        every sampling chunk is a plain greedy one. Per-chunk work is list comprehensions and
        numpy over the whole batch; only new sequences and changed tables take a Python loop."""
        bs, tables, states = self.block_size, self._tables, self._states
        chunks = out.chunks
        seqs = [c.seq for c in chunks]
        sts = [states.get(seq.seq_id) for seq in seqs]
        if None in sts or [st.seq for st in sts] != seqs:  # new sequences (or reused ids)
            keep = {seq.seq_id for seq in seqs}
            sts = [self._state(seq, keep) for seq in seqs]
        for c, st in zip(chunks, sts):
            if c.table_version is None or c.table_version != st.version:
                tables.write(st.row, c.block_tables)
                st.version = c.table_version
        n = len(chunks)
        rows_np = np.array([st.row for st in sts], dtype=np.int64)
        starts_np = np.array([c.start_pos for c in chunks], dtype=np.int64)
        input_ids = list(itertools.chain.from_iterable(c.token_ids for c in chunks))
        greedy = _plain_greedy(chunks, sts)
        if len(input_ids) == n:  # one token per chunk (a decode step): no drafts
            counts = None
            sample_idx = [i for i, c in enumerate(chunks) if c.sample]
            positions, token_rows = starts_np, rows_np
            query_start_loc = list(range(n + 1))
            seq_lens = (starts_np + 1).tolist()
        else:
            counts = np.fromiter((len(c.token_ids) for c in chunks), np.int64, n)
            ends = np.cumsum(counts)
            # per sampling chunk: its last known token, then its drafts
            sample_idx = [
                i
                for c, end in zip(chunks, ends.tolist())
                if c.sample
                for i in range(end - 1 - len(c.draft_token_ids), end)
            ]
            positions = np.arange(len(input_ids), dtype=np.int64) + np.repeat(
                starts_np - (ends - counts), counts
            )
            token_rows = np.repeat(rows_np, counts)
            query_start_loc = [0] + ends.tolist()
            seq_lens = (starts_np + counts).tolist()
        block, offset = np.divmod(positions, bs)
        metas = []
        for g in range(len(self.kv_groups)):
            table = tables.tables[g]
            lens = tables.lens[g][rows_np]
            width = int(lens.max())
            if (block >= (lens if counts is None else np.repeat(lens, counts))).any():
                raise ValueError("a scheduled position lies past its sequence's block table")
            metas.append(
                AttentionMetadata(
                    slot_mapping=torch.from_numpy(table[token_rows, block] * bs + offset),
                    query_start_loc=query_start_loc,
                    seq_lens=seq_lens,
                    block_tables=torch.from_numpy(table[rows_np, :width]),
                    block_size=bs,
                )
            )
        meta = metas[0]
        if len(metas) > 1:
            meta.layers = [metas[g] for g in self.layer_group]
        lora = getattr(self.model, "lora_step", None)  # LoRA adapters: each token's slot
        if lora is not None:
            slots = long_tensor([lora.slot_of(c.seq.lora_key) for c in chunks])
            lora.set(slots if counts is None else slots.repeat_interleave(torch.from_numpy(counts)))
        ids = long_tensor(input_ids)
        return _Flat(ids, torch.from_numpy(positions), meta, sample_idx, greedy)

    def prepare(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten the scheduled chunks into one batch; returns (input_ids, positions, meta,
        sample_idx): sample_idx holds, per chunk that samples, the rows of its last known token
        and its drafts."""
        f = self._flatten(out)
        return f.input_ids, f.positions, f.meta, f.sample_idx

    def batch(self, out: SchedulerOutput) -> StepBatch:
        """The step's flat batch with the rows it needs logits at: the sampling chunks' rows,
        then the prompt positions of the chunks whose sequence asked for prompt logprobs."""
        f = self._flatten(out)
        spans = prompt_logprob_spans(out, f.meta.query_start_loc)
        sample_idx = f.sample_idx
        if spans:
            sample_idx = sample_idx + [r for _, a, n, _ in spans for r in range(a, a + n)]
        rows = long_tensor(sample_idx)
        return StepBatch(
            out, f.input_ids, f.positions, f.meta, rows, len(f.sample_idx), spans, f.greedy
        )

    # ---- steps ----
    def fill_placeholders(self, batch: StepBatch) -> None:
        """Write into a planned batch (flattened while the step before it ran) the tokens that
        Scheduler.settle() put over its chunks' placeholders, and decide again whether it
        samples plain greedy (min_tokens counts the tokens that came since)."""
        chunks = batch.out.chunks
        ends = batch.meta.query_start_loc
        idx = [ends[i + 1] - 1 for i, c in enumerate(chunks) if c.placeholder]
        if idx:
            batch.input_ids[idx] = torch.tensor(
                [c.token_ids[-1] for c in chunks if c.placeholder], dtype=torch.long
            )
        if batch.greedy:  # only min_tokens could have said no, and the new tokens count
            return
        batch.greedy = _plain_greedy(chunks, [self._states.get(c.seq.seq_id) for c in chunks])

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, grammar=None, batch: StepBatch | None = None
    ) -> StepOutput:
        """Run one step: the sampled token of every chunk with sample=True, and the prompt
        logprobs of the chunks whose sequence asked for them. `grammar`: the step's grammar mask
        (`rows` by sequence id; `wait()` for the bitmask, which the engine may be filling while
        the forward pass runs), applied to the constrained rows before sampling. `batch`: `out`
        already flattened (`batch(out)`, placeholders filled), else it is flattened here."""
        if out.chunks and (batch is None or batch.out is not out):
            batch = self.batch(out)
        return self.sample(batch, self.forward(out, batch), grammar)

    def forward(self, out: SchedulerOutput, batch: StepBatch | None) -> torch.Tensor | None:
        """The first half of `execute`: the step's copy-on-write copies and its forward, the
        logits at `batch.rows` (None when `out` has no chunk). Runs inside execute's inference
        mode (entering it costs microseconds a step)."""
        if out.copy_blocks:
            self.copy_blocks(out.copy_blocks)
        if not out.chunks:
            if out.copy_blocks:  # ranks elsewhere copy their pools' blocks too
                self.backend.sync_copies(out.copy_blocks)
            return None
        return self.backend.logits(batch)

    def sample(self, batch: StepBatch | None, logits: torch.Tensor | None, grammar) -> StepOutput:
        """The second half of `execute`: the step's tokens (and prompt logprobs) from the
        logits `forward` returned, inside execute's inference mode."""
        if logits is None or batch.rows.numel() == 0:
            return StepOutput()
        n = batch.num_sample_rows
        step = StepOutput()
        if batch.spans:
            step.prompt_logprobs = prompt_logprobs(batch.spans, logits[n:])
        sampling = [c for c in batch.out.chunks if c.sample]
        step.sampled = self._sample(sampling, logits[:n], grammar, batch.greedy)
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
        return argmax_list(self.backend.logits(batch))

    # ---- sampling ----
    def _sample(self, sampling: list, logits: torch.Tensor, grammar, greedy: bool = False) -> dict:
        """The tokens of the sampling chunks from their rows of `logits` (per chunk its last
        known token, then its drafts): drawn, or verified against the drafts. A failed step
        draws nothing: the seeded generators are restored and the engine may run it again.
        `greedy`: every chunk is a plain greedy one (StepBatch.greedy); unless a grammar masks
        one of them, one argmax over the batch is what the sampler would take for each row."""
        if greedy and (grammar is None or not grammar.rows):
            tokens = argmax_list(logits)
            return {c.seq.seq_id: [SampledToken(t, None)] for c, t in zip(sampling, tokens)}
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


class _SeqState:
    """A sequence's runner state across steps: its row of the persistent block tables, the
    version of its table written there, and how it samples (`greedy`: temperature 0 with no
    penalties or logprobs; `min_tokens`: until then eos and stop ids are banned)."""

    __slots__ = ("row", "version", "seq", "greedy", "min_tokens")

    def __init__(self, row: int) -> None:
        self.row = row
        self.version: int | None = None  # None: nothing written yet, or an unversioned table
        self.seq = None
        self.greedy = False
        self.min_tokens = 0

    def bind(self, seq) -> None:
        """Take `seq` (its parameters are fixed for its life); its table is written afresh."""
        self.seq, self.version = seq, None
        self.greedy = is_plain_greedy(seq.sampling_params)
        self.min_tokens = seq.sampling_params.min_tokens


class _BlockTables:
    """Every running sequence's block tables, one row each, per KV group: a step reads the rows
    of its chunks at once, and a row is rewritten only when its sequence's table changed. Rows
    grow as needed; entries past a row's length are 0 (the padding the kernels see)."""

    def __init__(self, num_groups: int, rows: int = 64, width: int = 16) -> None:
        self.tables = [np.zeros((rows, width), dtype=np.int64) for _ in range(num_groups)]
        self.lens = [np.zeros(rows, dtype=np.int64) for _ in range(num_groups)]
        self.free = list(range(rows - 1, -1, -1))

    def take(self) -> int:
        if not self.free:
            rows = self.tables[0].shape[0]
            for g, t in enumerate(self.tables):
                self.tables[g] = np.concatenate([t, np.zeros_like(t)])
                self.lens[g] = np.concatenate([self.lens[g], np.zeros_like(self.lens[g])])
            self.free = list(range(2 * rows - 1, rows - 1, -1))
        return self.free.pop()

    def release(self, row: int) -> None:
        self.free.append(row)

    def write(self, row: int, block_tables: list[list[int]]) -> None:
        for g, ids in enumerate(block_tables):
            n, table, lens = len(ids), self.tables[g], self.lens[g]
            if n > table.shape[1]:
                wider = np.zeros((table.shape[0], max(n, 2 * table.shape[1])), dtype=np.int64)
                wider[:, : table.shape[1]] = table
                table = self.tables[g] = wider
            old = int(lens[row])
            table[row, :n] = ids
            if old > n:
                table[row, n:old] = 0
            lens[row] = n


def long_tensor(values: list[int]) -> torch.Tensor:
    """An int64 CPU tensor of a list, through numpy: a third of torch.tensor's cost per call."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def _plain_greedy(chunks: list, states: list) -> bool:
    """Whether every sampling chunk of a step samples plain greedy (its sequence's state, in
    `states`, says temperature 0 with nothing that needs the logits, min_tokens is reached, no
    beam search) and no chunk carries drafts: the step then takes one argmax per row."""
    for c, st in zip(chunks, states):  # a loop, not any()/all(): every chunk, every step
        if c.draft_token_ids:
            return False
        if c.sample:
            if st is None or not st.greedy:
                return False
            seq = c.seq
            if seq.beam_candidates or len(seq.output_token_ids) < st.min_tokens:
                return False
    return True


class _Flat:
    """A step's chunks flattened (ModelRunner._flatten)."""

    __slots__ = ("input_ids", "positions", "meta", "sample_idx", "greedy")

    def __init__(self, input_ids, positions, meta, sample_idx, greedy) -> None:
        self.input_ids, self.positions, self.meta = input_ids, positions, meta
        self.sample_idx, self.greedy = sample_idx, greedy
