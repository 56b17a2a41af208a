"""Drafts from a model: a small model with the target's vocabulary, or the target's own first
layers (self-speculative, kvserve/model/early_exit.py).

The draft runs through a ModelRunner of its own (the C layer stack and attention kernels serve it
as they serve the target) on its own paged KV cache: a BlockPool of the target's block size,
without prefix caching. Per request it keeps the tokens whose KV its cache holds. One call, for
every request of the step together:

1. keep the longest prefix of those tokens that the request's context still starts with (drafts
   the target accepted stay, rejected ones go), but never the last token of the context;
2. feed the rest of the context (the prompt on the first call, then the tokens accepted since),
   in batches of at most the scheduler's token budget; the argmax after the last one is draft 1;
3. feed each draft to get the next, one batch per round, until every request has its k drafts.

Steps 2 and 3 are timed (`catch_up_cost` by tokens fed, `round_cost` by requests per round): the
Drafter prices a draft token with its round, and makes a request's catch-up only where drafting
then saves more than the feed costs (a whole prompt's feed, for a draft nearly as deep as the
target, never pays; kvserve/spec/drafter.py).

Drafts are greedy, hence deterministic: the verifier treats them as one-hot (exact at any
temperature, kvserve/spec/rejection.py). A request whose blocks do not fit in the draft's pool
gets no drafts this step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvserve.config import EngineConfig
from kvserve.core.block_pool import Block, BlockPool
from kvserve.core.scheduler import ScheduledChunk, SchedulerOutput
from kvserve.core.sequence import Sequence
from kvserve.runner.model_runner import ModelRunner
from kvserve.spec.step_cost import StepCostModel


@dataclass
class _DraftSequence:
    tokens: list[int] = field(default_factory=list)  # the tokens whose KV the draft cache holds
    blocks: list[Block] = field(default_factory=list)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelProposer:
    def __init__(self, loaded, config: EngineConfig, num_blocks: int) -> None:
        """`loaded`: the draft (kvserve.model.loader.LoadedModel); `num_blocks`: its KV pool."""
        self.arch = loaded.arch
        context = config.model.context_len(loaded.arch.max_position_embeddings)
        self.runner = ModelRunner(loaded, config, num_blocks, max_model_len=context)
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self.block_size = config.cache.block_size
        self.max_batch_tokens = config.scheduler.max_num_batched_tokens
        self.round_cost = StepCostModel()  # the one-token rounds (steps 3): seconds by batch size
        self.catch_up_cost = StepCostModel()  # the context feeds (step 2): seconds by tokens fed
        self._seqs: dict[str, _DraftSequence] = {}

    @property
    def kv_cache_bytes(self) -> int:
        return self.runner.kv_cache_bytes

    def _kept(self, seq: _DraftSequence, context: list[int]) -> int:
        """How many of the context's tokens the draft cache holds and may keep (step 1)."""
        return min(_common_prefix(seq.tokens, context), len(context) - 1)

    def catch_up_tokens(self, req: Sequence) -> int:
        """The context tokens a draft for `req` would feed now: its whole context on the first
        call, then the tokens accepted since its last draft (1 or 2 while it drafts every step)."""
        seq = self._seqs.get(req.seq_id)
        context = req.all_token_ids
        return len(context) - (self._kept(seq, context) if seq is not None else 0)

    def catch_up_seconds(self, tokens: int) -> float | None:
        """The expected seconds of feeding `tokens` context tokens (None before any feed): the
        fit of the feeds so far, or their mean seconds per token while their sizes are too alike."""
        m = self.catch_up_cost
        if m.fit() is not None:
            return m.seconds(tokens)
        per_token = m.mean_seconds_per_row()
        return None if per_token is None else per_token * tokens

    def _reserve(self, seq: _DraftSequence, positions: int) -> bool:
        """Blocks for `positions` tokens of KV (freeing those past them); False when they do not
        fit."""
        need = -(-positions // self.block_size)
        if need < len(seq.blocks):
            self.pool.free_blocks(seq.blocks[need:])
            del seq.blocks[need:]
        elif need > len(seq.blocks):
            if need - len(seq.blocks) > self.pool.num_free_blocks:
                return False
            seq.blocks.extend(self.pool.get_new_blocks(need - len(seq.blocks)))
        return True

    def _chunk(
        self, req: Sequence, seq: _DraftSequence, token_ids: list[int], start: int
    ) -> ScheduledChunk:
        return ScheduledChunk(
            seq=req,
            token_ids=token_ids,
            start_pos=start,
            block_tables=[[b.block_id for b in seq.blocks]],
            sample=True,
        )

    def _run(self, chunks: list[ScheduledChunk]) -> list[int]:
        return self.runner.greedy_tokens(
            SchedulerOutput(chunks, [], [], sum(len(c.token_ids) for c in chunks))
        )

    def propose_batch(self, items: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to k greedy draft tokens for each (request, k), all requests batched per round."""
        drafts: list[list[int]] = [[] for _ in items]
        todo = []  # (index, request, sequence, context, k, next position to feed)
        for i, (req, k) in enumerate(items):
            if k <= 0:
                continue
            context = req.all_token_ids
            seq = self._seqs.setdefault(req.seq_id, _DraftSequence())
            keep = self._kept(seq, context)
            del seq.tokens[keep:]
            if not self._reserve(seq, len(context) + k - 1):  # the context and drafts 1..k-1
                continue
            todo.append((i, req, seq, context, k, keep))
        # 2. the context not yet in the cache, a token budget per batch: the argmax after it is
        # draft 1
        pending = list(todo)
        while pending:
            budget, batch, rest = self.max_batch_tokens, [], []
            for entry in pending:
                i, req, seq, context, k, pos = entry
                n = min(len(context) - pos, budget)
                if n <= 0:
                    rest.append(entry)
                    continue
                batch.append((entry, n))
                budget -= n
            t0 = time.perf_counter()
            tokens = self._run(
                [self._chunk(e[1], e[2], e[3][e[5] : e[5] + n], e[5]) for e, n in batch]
            )
            self.catch_up_cost.observe(sum(n for _, n in batch), time.perf_counter() - t0)
            for ((i, req, seq, context, k, pos), n), tok in zip(batch, tokens):
                if pos + n == len(context):
                    drafts[i].append(tok)
                else:
                    rest.append((i, req, seq, context, k, pos + n))
            pending = rest
        # 3. each draft fed back for the next, one round per draft position
        for j in range(1, max((e[4] for e in todo), default=0)):
            live = [e for e in todo if e[4] > j]
            t0 = time.perf_counter()
            tokens = self._run(
                [
                    self._chunk(req, seq, [drafts[i][-1]], len(context) + j - 1)
                    for i, req, seq, context, k, _ in live
                ]
            )
            self.round_cost.observe(len(live), time.perf_counter() - t0)
            for (i, *_), tok in zip(live, tokens):
                drafts[i].append(tok)
        for i, req, seq, context, k, _ in todo:
            seq.tokens = context + drafts[i][:-1]
        return drafts

    def free(self, seq_id: str) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.pool.free_blocks(seq.blocks)

    def forget(self) -> None:
        for seq_id in list(self._seqs):
            self.free(seq_id)
        self.runner.forget_sequences()

    def __len__(self) -> int:
        return len(self._seqs)
