"""The scheduler: which sequences run this step, and how many of their tokens.

vLLM v1 style: there is one token budget per step (`max_num_batched_tokens`) and no prefill
or decode phase. Every sequence has `num_computed_tokens`; a step gives running sequences the
tokens they still need (1 for decode, or the rest of a prompt, capped by the budget), then
fills what is left with prompt chunks of waiting and preempted sequences (lower `priority`
first, then first come first served), at most `max_num_seqs` running at once.

Holds: every unfinished sequence by id, the running list (in admission order), the waiting
queue (sorted: priority, then preempted-at-front, then arrival), and the KVCacheManager.

One step is `schedule()` -> the runner executes the SchedulerOutput -> `update_from_output()`.
A sequence whose own data makes its scheduling raise (prefix hashing, allocation) is finished
alone and reported by `pop_failed()`; the other sequences of the step go on.
`num_computed_tokens` advances at schedule time; the prefix cache learns a block's hash only
in `update_from_output`, once its KV has really been written.

Speculative decoding: a running sequence at a decode step that carries draft tokens
(`Sequence.spec_token_ids`, set by the engine) is given its last sampled token plus the drafts,
all counted in the token budget and given KV slots (drafts are cut to the budget and to the
tokens the sequence may still generate, and dropped before anyone is preempted for them). The
runner returns the accepted drafts plus one token; `update_from_output` takes
`num_computed_tokens` back by the rejected drafts (their KV slots are simply written again
later) before it registers full blocks in the prefix cache, so no block holding a rejected
token is ever found by hash.

KV groups (layers with different attention windows, e.g. Gemma 3's full and window-512 layers):
the KVCacheManager keeps one pool and one table per group; a step is admitted only when every
group has room, and a window group's blocks that no query can read any more go back to its pool
as the sequence advances (kvserve/core/kv_cache.py). An n > 1 child whose parent's window already
freed a block the child needs runs on its own (prefix cache) instead of forking.

Async scheduling (EngineConfig.async_scheduling): `schedule(inflight)` plans the next step while
`inflight` still runs. Every sequence that samples in `inflight` is assumed to get exactly one
token: its next chunk feeds a placeholder (PLACEHOLDER, `ScheduledChunk.placeholder`), and one
whose token must end it (max_tokens, max_model_len) is left out. `settle()` then, once
`inflight`'s update is done, drops the chunks of sequences that finished or were aborted
meanwhile, writes the sampled tokens over the placeholders and admits waiting sequences into the
budget left. Until then the planned tokens count as not computed (`cache_blocks`, prompt
scoring), so no block is found by hash before the step that writes it has run.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from kvserve.config import CacheConfig, KVGroup, SchedulerConfig, cdiv
from kvserve.core.kv_cache import KVCacheManager
from kvserve.core.sequence import Sequence, SequenceStatus
from kvserve.sampling_params import ParamError

PLACEHOLDER = -1  # the token id a planned chunk feeds until the step before it has sampled


class QueueFullError(RuntimeError):
    """The waiting queue holds max_waiting sequences: come back later (HTTP 429)."""


@dataclass
class ScheduledChunk:
    """One sequence's tokens in a step. Built by position every step (Scheduler._chunks): new
    fields go last."""

    seq: Sequence  # read-only for the runner
    token_ids: list[int]  # tokens fed this step (a prompt chunk, or the last sampled token)
    start_pos: int  # position of token_ids[0] (== num_computed_tokens before this step)
    block_tables: list[list[int]]  # per KV group, the sequence's whole table after this step's
    # allocation (kv_cache.NULL_BLOCK where a window freed a block); the KV manager's own lists:
    # read them during the step, copy them to keep them
    sample: bool  # the chunk ends at the sequence's last known token: sample from it
    draft_token_ids: list[int] = field(
        default_factory=list
    )  # the last tokens of token_ids, to verify
    # the tables' version (KVCacheManager.table_ids): the same version, the same tables; None:
    # unknown (the runner then reads the tables afresh)
    table_version: int | None = None
    # its last token is PLACEHOLDER, the one the step still running samples (async scheduling)
    placeholder: bool = False


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    # copy-on-write, applied first and in order: (group, src, dst) copies block src to dst in
    # every layer of KV group `group`
    copy_blocks: list[tuple[int, int, int]]
    preempted_ids: list[str]
    num_batched_tokens: int


@dataclass
class SchedulerStats:
    """Monotone counters. Prefix-cache figures count tokens, once per admission of a sequence."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0


class Scheduler:
    def __init__(
        self,
        sched: SchedulerConfig,
        cache: CacheConfig,
        num_blocks: int | list[KVGroup],
        max_model_len: int,
    ) -> None:
        """`num_blocks`: the KV groups with their pool sizes (config.CacheConfig.kv_groups), or a
        block count for one full-attention group."""
        self.sched = sched
        self.cache = cache
        self.max_model_len = max_model_len
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache.block_size, cache.enable_prefix_caching
        )
        self.sequences: dict[str, Sequence] = {}
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []
        self.stats = SchedulerStats()
        self._counter = itertools.count()
        self._arrival_seq: dict[str, int] = {}
        self._queue_key: dict[str, tuple] = {}
        self._failed: list[tuple[str, str]] = []  # (sequence id, cause) since the last pop_failed()
        # sequence id -> tokens a planned step (schedule(inflight)) gave it, not run yet
        self._planned: dict[str, int] = {}

    # ---- admission and removal -----------------------------------------------------------
    def add_sequence(self, req: Sequence) -> None:
        """Queue a sequence; ValueError when it can never run, QueueFullError when the queue
        is full."""
        p = req.num_prompt_tokens
        if p == 0:
            raise ValueError("the prompt is empty: it needs at least 1 token")
        if req.seq_id in self.sequences:
            raise ValueError(f"sequence id {req.seq_id!r} is already in use")
        if req.max_tokens is None:
            req.max_tokens = self.max_model_len - p
            if req.max_tokens < 1:
                raise ParamError(
                    "prompt",
                    f"the prompt has {p} tokens, which leaves no room for output "
                    f"in max_model_len={self.max_model_len}",
                )
        if p + req.max_tokens > self.max_model_len:
            raise ParamError(
                "max_tokens",
                f"prompt ({p} tokens) + max_tokens ({req.max_tokens}) = "
                f"{p + req.max_tokens} exceeds max_model_len={self.max_model_len}",
            )
        bs, budget = self.cache.block_size, self.sched.max_num_batched_tokens
        length = p + max(req.max_tokens, 1) - 1
        for group in self.kv_cache_manager.groups:
            needed = cdiv(length, bs)
            if group.window is not None:  # a window table peaks at a chunk of n <= budget tokens
                needed = min(needed, cdiv(group.window + min(budget, length) - 2, bs) + 1)
            if needed > group.num_blocks:
                raise ParamError(
                    "max_tokens",
                    f"prompt ({p} tokens) + max_tokens ({req.max_tokens}) needs "
                    f"{needed} KV blocks of {bs} tokens, but the whole cache has "
                    f"{group.num_blocks}",
                )
        if len(self.waiting) >= self.sched.max_waiting:
            raise QueueFullError(
                f"{len(self.waiting)} sequences are waiting "
                f"(max_waiting={self.sched.max_waiting}): retry later"
            )
        req.status = SequenceStatus.WAITING
        self.sequences[req.seq_id] = req
        self._arrival_seq[req.seq_id] = next(self._counter)
        self._enqueue(req, front=False)

    def add_sequences(self, seqs: list[Sequence]) -> None:
        """Queue all of `seqs` or none of them (the n samples of one sequence)."""
        added = []
        try:
            for seq in seqs:
                self.add_sequence(seq)
                added.append(seq)
        except Exception:
            for seq in added:
                self.abort_sequence(seq.seq_id)
            raise

    def abort_sequence(self, seq_id: str) -> None:
        """Abort in any state and free its blocks now; unknown or finished ids are a no-op."""
        self.finish_sequence(seq_id, SequenceStatus.FINISHED_ABORTED)

    def finish_sequence(self, seq_id: str, status: SequenceStatus) -> None:
        """Finish a sequence from outside (stop strings, abort); unknown or finished ids are
        a no-op."""
        assert status.is_finished, status
        req = self.sequences.get(seq_id)
        if req is not None:
            self._finish(req, status)

    def _finish(self, req: Sequence, status: SequenceStatus) -> None:
        if req.status == SequenceStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        self.kv_cache_manager.free(req)
        del self.sequences[req.seq_id]
        del self._arrival_seq[req.seq_id]
        self._queue_key.pop(req.seq_id, None)

    def _fail(self, req: Sequence, err: Exception) -> None:
        """Finish a sequence whose own data made scheduling it raise; its blocks go back."""
        self._failed.append((req.seq_id, f"{type(err).__name__}: {err}"))
        self._finish(req, SequenceStatus.FINISHED_ABORTED)

    def pop_failed(self) -> list[tuple[str, str]]:
        """(sequence id, cause) of the sequences failed alone since the last call."""
        failed, self._failed = self._failed, []
        return failed

    def _enqueue(self, req: Sequence, front: bool) -> None:
        """Insert into the waiting queue: by priority, preempted sequences at the front of
        theirs."""
        n = next(self._counter)
        key = (req.priority, 0, -n) if front else (req.priority, 1, req.arrival_time, n)
        self._queue_key[req.seq_id] = key
        bisect.insort(self.waiting, req, key=lambda r: self._queue_key[r.seq_id])

    def _preempt(self, req: Sequence) -> None:
        """Preempt by recompute: free its blocks, keep its outputs, requeue it at the front."""
        self.kv_cache_manager.free(req)
        self.running.remove(req)
        req.status = SequenceStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._enqueue(req, front=True)

    def _preempt_held(self, scheduled: dict[str, int], preempted: list[str]) -> bool:
        """Free the blocks of a held beam (one that waits for the others of its sequence, not
        scheduled this step) so that a waiting sequence fits: held beams filling the cache
        would otherwise wait forever for sequences that cannot get blocks. False: none held."""
        held = [r for r in self.running if r.held and r.seq_id not in scheduled]
        if not held:
            return False
        victim = max(held, key=self._victim_key)
        self._preempt(victim)
        preempted.append(victim.seq_id)
        return True

    def _victim_key(self, req: Sequence) -> tuple:
        """max() of this is the sequence to preempt: lowest priority (largest value), then
        newest."""
        return req.priority, req.arrival_time, self._arrival_seq[req.seq_id]

    def _cached_prefix(self, req: Sequence):
        """Prefix-cache hits for a sequence, none when it asked for prompt logprobs (every prompt
        position must then be computed)."""
        if req.sampling_params.prompt_logprobs is not None:
            return [], 0
        return self.kv_cache_manager.get_computed_blocks(req)

    def _fork_parent(self, req: Sequence) -> Sequence | None:
        """The sequence a child shares its blocks with (an n > 1 sibling, or the beam it continues),
        or None to run it on its own: the child's tokens before its last must lead the parent's."""
        parent = self.sequences.get(req.fork_of) if req.fork_of is not None else None
        n = req.num_prompt_tokens - 1
        if (
            parent is None
            or parent.status == SequenceStatus.PREEMPTED
            or parent.all_token_ids[:n] != req.prompt_token_ids[:n]
        ):
            return None
        return parent

    # ---- one step ------------------------------------------------------------------------
    def schedule(self, inflight: SchedulerOutput | None = None) -> SchedulerOutput:
        """This step's chunks: running sequences first (decodes and the rest of their prompts),
        then waiting ones into the budget that is left, unless a running one had to be
        preempted. `inflight`: the step still running (async scheduling): each sequence that
        samples in it counts one more token, a placeholder (module docstring); call `settle()`
        on the result once `inflight` is updated."""
        plan = _StepPlan(self.sched.max_num_batched_tokens)
        if inflight is not None:
            plan.pending = {
                c.seq.seq_id
                for c in inflight.chunks
                if c.sample and c.seq.status == SequenceStatus.RUNNING
            }
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        if inflight is not None:
            self._planned = dict(plan.scheduled)
        return SchedulerOutput(
            self._chunks(plan), plan.copy_blocks, plan.preempted, sum(plan.scheduled.values())
        )

    def _chunks(self, plan: "_StepPlan") -> list[ScheduledChunk]:
        kv = self.kv_cache_manager
        chunks = []
        drafts = plan.drafts
        for sid, n in plan.scheduled.items():
            seq = self.sequences[sid]
            spec = drafts.get(sid) if drafts else None
            end = seq.num_computed_tokens
            start = end - n
            all_ids = seq.all_token_ids
            known = len(all_ids)
            if spec:
                end -= len(spec)
                ids = all_ids[start:end] + spec
            else:
                ids, spec = all_ids[start:end], []
            if end > known:  # the token the step in flight samples (end == known + 1)
                ids.append(PLACEHOLDER)
            tables, version = kv.table_ids(sid)
            # by position, ScheduledChunk's field order: one per sequence per step
            sample = end >= known and seq.max_tokens > 0
            chunks.append(
                ScheduledChunk(seq, ids, start, tables, sample, spec, version, end > known)
            )
        return chunks

    def settle(self, planned: SchedulerOutput) -> SchedulerOutput:
        """A step planned by `schedule(inflight)`, made ready to run once `inflight`'s tokens are
        appended: chunks of sequences no longer running (finished, aborted) dropped (their blocks
        went back when they finished), placeholders replaced by the sampled tokens, and waiting
        sequences admitted into the budget and sequence slots left (unless the plan preempted)."""
        ahead, self._planned = self._planned, {}
        chunks = []
        for c in planned.chunks:
            seq = c.seq
            if seq.status != SequenceStatus.RUNNING or self.sequences.get(seq.seq_id) is not seq:
                continue
            if c.placeholder:
                pos = c.start_pos + len(c.token_ids) - 1
                if pos >= seq.num_tokens:  # no token came for it: the chunk is taken back
                    seq.num_computed_tokens -= len(c.token_ids)
                    continue
                c.token_ids[-1] = seq.all_token_ids[pos]
            chunks.append(c)
        copies = list(planned.copy_blocks)
        used = sum(len(c.token_ids) for c in chunks)
        if self.waiting and not planned.preempted_ids:
            plan = _StepPlan(self.sched.max_num_batched_tokens - used)
            plan.copy_blocks, plan.ahead = copies, ahead
            self._schedule_waiting(plan)
            chunks += self._chunks(plan)
            used += sum(plan.scheduled.values())
        return SchedulerOutput(chunks, copies, planned.preempted_ids, used)

    def _schedule_running(self, plan: "_StepPlan") -> None:
        """Decode tokens (with drafts to verify) and the rest of partially computed prompts;
        where blocks run out, drafts go first, then the lowest-priority newest sequence."""
        kv, running, pending = self.kv_cache_manager, SequenceStatus.RUNNING, plan.pending
        for seq in list(self.running):
            if plan.budget == 0:
                break
            if seq.status is not running or seq.held:  # preempted above, or held
                continue
            known = len(seq.all_token_ids)
            if pending and seq.seq_id in pending:  # one token on its way from the step in flight
                if seq.num_output_tokens + 1 >= seq.max_tokens or known + 1 >= self.max_model_len:
                    continue  # that token ends it
                known += 1
            num_new = min(known - seq.num_computed_tokens, plan.budget)
            if num_new <= 0:
                continue
            spec = [] if pending else self._drafts_to_verify(seq, num_new, plan.budget)
            while True:
                if kv.allocate_slots(seq, num_new + len(spec), plan.copy_blocks):
                    plan.take(seq, num_new + len(spec), spec)
                    if seq.spec_token_ids:
                        seq.spec_token_ids = []
                    seq.num_computed_tokens += num_new + len(spec)
                    break
                if spec:  # no blocks for the drafts: verify none rather than preempt for them
                    spec = []
                    continue
                victim = max(self.running, key=self._victim_key)
                plan.budget += plan.scheduled.pop(victim.seq_id, 0)
                plan.drafts.pop(victim.seq_id, None)
                self._preempt(victim)
                plan.preempted.append(victim.seq_id)
                if victim is seq:
                    break

    def _schedule_waiting(self, plan: "_StepPlan") -> None:
        """Admit waiting and preempted sequences in queue order while the budget and
        max_num_seqs allow. Held beams do not count against max_num_seqs: they wait for the
        very sequences queued here."""
        if not self.waiting:
            return
        active = sum(1 for r in self.running if not r.held)
        for seq in list(self.waiting):
            if plan.budget == 0 or active >= self.sched.max_num_seqs:
                break
            if seq.held:
                continue
            parent = self._fork_parent(seq)
            if parent is not None and not self._parent_ready(parent, seq, plan):
                continue
            try:
                admitted = self._admit(seq, parent, plan)
            except Exception as e:  # this sequence's own data (e.g. its hash inputs): it alone
                self._fail(seq, e)
                continue
            if admitted is None:
                break
            num_shared, num_new = admitted
            self.waiting.remove(seq)
            self._queue_key.pop(seq.seq_id)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            active += 1
            plan.take(seq, num_new)
            seq.num_computed_tokens = num_shared + num_new

    def _parent_ready(self, parent: Sequence, seq: Sequence, plan: "_StepPlan") -> bool:
        """A fork waits until its parent computed, in an earlier step, the tokens it shares
        (their KV is written then)."""
        pid = parent.seq_id
        computed_before = (
            parent.num_computed_tokens - plan.scheduled.get(pid, 0) - plan.ahead.get(pid, 0)
        )
        return parent.status == SequenceStatus.RUNNING and computed_before >= max(
            parent.num_prompt_tokens, seq.num_prompt_tokens - 1
        )

    def _admit(
        self, seq: Sequence, parent: Sequence | None, plan: "_StepPlan"
    ) -> tuple[int, int] | None:
        """Blocks for a waiting sequence's first chunk, shared with its parent (_fork_parent)
        or found in the prefix cache: (tokens shared, tokens new), or None when it does not fit
        this step."""
        kv = self.kv_cache_manager
        fork = kv.get_fork_blocks(parent, seq) if parent is not None else None
        if fork is None:  # no parent, or a window of the parent no longer holds the child's
            parent = None
            fork = self._cached_prefix(seq)
        shared_blocks, num_shared = fork
        num_new = seq.num_tokens - num_shared
        whole_budget = self.sched.max_num_batched_tokens
        if not self.sched.chunked_prefill and plan.budget < num_new <= whole_budget:
            return None  # whole prompts only; one longer than the whole budget is still chunked
        num_new = min(num_new, plan.budget)
        allocated = kv.allocate_slots(seq, num_new, plan.copy_blocks, shared_blocks, num_shared)
        while not allocated and self._preempt_held(plan.scheduled, plan.preempted):
            # Held beams filled the cache and one of them gave its blocks back (it will
            # recompute): find this sequence's prefix hits again, as its parent may be it.
            parent = None
            shared_blocks, num_shared = self._cached_prefix(seq)
            num_new = min(seq.num_tokens - num_shared, plan.budget)
            allocated = kv.allocate_slots(seq, num_new, plan.copy_blocks, shared_blocks, num_shared)
        if not allocated:
            return None
        if parent is None and self.cache.enable_prefix_caching:
            self.stats.prefix_cache_queries += seq.num_tokens
            self.stats.prefix_cache_hits += num_shared
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = num_shared
        return num_shared, num_new

    def _drafts_to_verify(self, req: Sequence, num_new: int, budget: int) -> list[int]:
        """The drafts a running sequence feeds after its last token this step: only at a decode
        step (its one new token is its last sampled one), cut so that the budget holds them and
        the accepted drafts plus one token never pass max_tokens or max_model_len."""
        if not req.spec_token_ids or num_new != 1 or req.num_tokens - req.num_computed_tokens != 1:
            return []
        room = min(
            budget - 1,
            req.max_tokens - req.num_output_tokens - 1,
            self.max_model_len - req.num_tokens - 1,
        )
        return req.spec_token_ids[: max(room, 0)]

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, list[int]]
    ) -> list[Sequence]:
        """Append sampled tokens, apply token-level stops, free finished sequences' blocks.

        A chunk with drafts samples the accepted drafts then one token: the rejected drafts are
        taken off `num_computed_tokens`, and the tokens are appended one by one with the stop
        checks, so a stop cuts exactly where one-token steps would (nothing after it is kept).
        Chunks of sequences aborted since `schedule()` are skipped. Returns the sequences that
        finished in this call.
        """
        finished = []
        for chunk in out.chunks:
            req = chunk.seq
            if self.sequences.get(req.seq_id) is not req:
                continue
            tokens = sampled.get(req.seq_id, ()) if chunk.sample else ()
            if req.status != SequenceStatus.RUNNING:
                # Preempted by a step planned while this one ran (async scheduling): its token
                # still counts, and its recompute feeds it.
                if req.status == SequenceStatus.PREEMPTED and tokens and not chunk.draft_token_ids:
                    status = self._append_tokens(req, tokens)
                    if status is not None:
                        self._finish(req, status)
                        finished.append(req)
                continue
            if chunk.draft_token_ids:
                num_accepted = max(0, len(tokens) - 1)
                assert list(tokens[:num_accepted]) == chunk.draft_token_ids[:num_accepted], (
                    "accepted != drafts"
                )
                req.num_computed_tokens -= len(chunk.draft_token_ids) - num_accepted
            status = self._append_tokens(req, tokens)
            # computed once this step ran: not the tokens a step planned since then gave it
            done = req.num_computed_tokens - self._planned.get(req.seq_id, 0)
            try:  # after the append: accepted drafts are computed tokens, hashed with the rest
                self.kv_cache_manager.cache_blocks(req, min(done, req.num_tokens))
            except Exception as e:  # hashing this sequence's blocks: it fails alone
                self._fail(req, e)
                continue
            if req.max_tokens == 0 and done == req.num_tokens:
                status = SequenceStatus.FINISHED_LENGTH  # scoring the prompt only
            if status is not None:
                self._finish(req, status)
                finished.append(req)
        return finished

    def _append_tokens(self, req: Sequence, tokens) -> SequenceStatus | None:
        """Append `tokens` one by one with the stop checks; the stop status where one cut them
        (nothing after it appended), else None."""
        for token_id in tokens:
            req.append_output_token(token_id)
            status = self._check_stop(req, token_id)
            if status is not None:
                return status
        return None

    def _check_stop(self, req: Sequence, token_id: int) -> SequenceStatus | None:
        params = req.sampling_params
        num_output = len(req.output_token_ids)  # the lists' lengths: called for every token
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in req.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                req.stop_reason = token_id
                return SequenceStatus.FINISHED_STOPPED
        if num_output >= req.max_tokens or len(req.all_token_ids) >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    # ---- what the engine, the runner and /metrics read -----------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.sequences)

    def get_block_table(self, seq_id: str) -> list[list[int]]:
        """Per KV group, the sequence's block ids."""
        return self.kv_cache_manager.block_ids(seq_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Referenced blocks / all blocks; evictable cached blocks count as free."""
        return self.kv_cache_manager.usage

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache_manager.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks some sequence references (0 when idle: anything else is a leak)."""
        return self.kv_cache_manager.num_total_blocks - self.kv_cache_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.kv_cache_manager.num_total_blocks

    def metrics(self) -> dict:
        """Gauges and counters for /metrics and the bench."""
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "kv_cache_usage": self.kv_cache_usage,
            "kv_blocks_used": self.num_used_blocks,
            "kv_blocks_total": self.num_total_blocks,
            "prefix_cache_queries": self.stats.prefix_cache_queries,
            "prefix_cache_hits": self.stats.prefix_cache_hits,
            "num_preemptions": self.stats.num_preemptions,
        }


class _StepPlan:
    """What one schedule() call has decided so far."""

    def __init__(self, budget: int):
        self.budget = budget
        self.scheduled: dict[str, int] = {}  # sequence id -> tokens this step, in batch order
        self.drafts: dict[str, list[int]] = {}  # sequence id -> draft tokens among them
        self.copy_blocks: list[tuple[int, int, int]] = []  # (group, src, dst)
        self.preempted: list[str] = []
        # async scheduling: sequences sampling in the step in flight (one placeholder token
        # each), and the tokens a planned step being settled gave each (not computed before it)
        self.pending: set[str] = set()
        self.ahead: dict[str, int] = {}

    def take(self, seq: Sequence, num_tokens: int, drafts: list[int] | None = None) -> None:
        self.scheduled[seq.seq_id] = num_tokens
        if drafts:
            self.drafts[seq.seq_id] = drafts
        self.budget -= num_tokens
