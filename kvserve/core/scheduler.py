"""The scheduler: which requests run this step, and how many of their tokens.

vLLM v1 style: there is one token budget per step (`max_num_batched_tokens`) and no prefill
or decode phase. Every request has `num_computed_tokens`; a step gives running requests the
tokens they still need (1 for decode, or the rest of a prompt, capped by the budget), then
fills what is left with prompt chunks of waiting and preempted requests (lower `priority`
first, then first come first served), at most `max_num_seqs` running at once.

Holds: every unfinished request by id, the running list (in admission order), the waiting
queue (sorted: priority, then preempted-at-front, then arrival), and the KVCacheManager.

One step is `schedule()` -> the runner executes the SchedulerOutput -> `update_from_output()`.
A request whose own data makes its scheduling raise (prefix hashing, allocation) is finished
alone and reported by `pop_failed()`; the other requests of the step go on.
`num_computed_tokens` advances at schedule time; the prefix cache learns a block's hash only
in `update_from_output`, once its KV has really been written.

Speculative decoding: a running request at a decode step that carries draft tokens
(`Request.spec_token_ids`, set by the engine) is given its last sampled token plus the drafts,
all counted in the token budget and given KV slots (drafts are cut to the budget and to the
tokens the request may still generate, and dropped before anyone is preempted for them). The
runner returns the accepted drafts plus one token; `update_from_output` takes
`num_computed_tokens` back by the rejected drafts (their KV slots are simply written again
later) before it registers full blocks in the prefix cache, so no block holding a rejected
token is ever found by hash.

KV groups (layers with different attention windows, e.g. Gemma 3's full and window-512 layers):
the KVCacheManager keeps one pool and one table per group; a step is admitted only when every
group has room, and a window group's blocks that no query can read any more go back to its pool
as the request advances (kvserve/core/kv_cache.py). An n > 1 child whose parent's window already
freed a block the child needs runs on its own (prefix cache) instead of forking.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from kvserve.config import CacheConfig, KVGroup, SchedulerConfig, cdiv
from kvserve.core.kv_cache import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.sampling_params import ParamError


class QueueFullError(RuntimeError):
    """The waiting queue holds max_waiting requests: come back later (HTTP 429)."""


@dataclass
class ScheduledChunk:
    request: Request          # read-only for the runner
    token_ids: list[int]      # tokens fed this step (a prompt chunk, or the last sampled token)
    start_pos: int            # position of token_ids[0] (== num_computed_tokens before this step)
    block_tables: list[list[int]]   # per KV group, the request's whole table after this step's
                                    # allocation (kv_cache.NULL_BLOCK where a window freed a block)
    sample: bool              # the chunk ends at the request's last known token: sample from it
    draft_token_ids: list[int] = field(default_factory=list)   # the last tokens of token_ids, to verify


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    copy_blocks: list[tuple[int, int, int]]   # copy-on-write: (group, src, dst), copy block src -> dst
                                              # in every layer of the KV group first, in order
    preempted_ids: list[str]
    num_batched_tokens: int


@dataclass
class SchedulerStats:
    """Monotone counters. Prefix-cache figures count tokens, once per admission of a request."""
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0


class Scheduler:
    def __init__(self, sched: SchedulerConfig, cache: CacheConfig, num_blocks: int | list[KVGroup],
                 max_model_len: int) -> None:
        """`num_blocks`: the KV groups with their pool sizes (config.CacheConfig.kv_groups), or a
        block count for one full-attention group."""
        self.sched = sched
        self.cache = cache
        self.max_model_len = max_model_len
        self.kv_cache_manager = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        self.stats = SchedulerStats()
        self._counter = itertools.count()
        self._arrival_seq: dict[str, int] = {}
        self._queue_key: dict[str, tuple] = {}
        self._failed: list[tuple[str, str]] = []    # (request id, cause) since the last pop_failed()

    # ---- admission and removal -----------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request; ValueError when it can never run, QueueFullError when the queue is full."""
        p = req.num_prompt_tokens
        if p == 0:
            raise ValueError("the prompt is empty: it needs at least 1 token")
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.max_tokens is None:
            req.max_tokens = self.max_model_len - p
            if req.max_tokens < 1:
                raise ParamError("prompt", f"the prompt has {p} tokens, which leaves no room for output "
                                           f"in max_model_len={self.max_model_len}")
        if p + req.max_tokens > self.max_model_len:
            raise ParamError("max_tokens", f"prompt ({p} tokens) + max_tokens ({req.max_tokens}) = "
                                           f"{p + req.max_tokens} exceeds max_model_len={self.max_model_len}")
        bs, budget = self.cache.block_size, self.sched.max_num_batched_tokens
        length = p + max(req.max_tokens, 1) - 1
        for group in self.kv_cache_manager.groups:
            needed = cdiv(length, bs)
            if group.window is not None:   # a window table peaks at a chunk of n <= budget tokens
                needed = min(needed, cdiv(group.window + min(budget, length) - 2, bs) + 1)
            if needed > group.num_blocks:
                raise ParamError("max_tokens", f"prompt ({p} tokens) + max_tokens ({req.max_tokens}) needs "
                                               f"{needed} KV blocks of {bs} tokens, but the whole cache has "
                                               f"{group.num_blocks}")
        if len(self.waiting) >= self.sched.max_waiting:
            raise QueueFullError(f"{len(self.waiting)} requests are waiting "
                                 f"(max_waiting={self.sched.max_waiting}): retry later")
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self._arrival_seq[req.request_id] = next(self._counter)
        self._enqueue(req, front=False)

    def abort_request(self, request_id: str) -> None:
        """Abort in any state and free its blocks now; unknown or finished ids are a no-op."""
        self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Finish a request from outside (stop strings, abort); unknown/finished ids are a no-op."""
        assert status.is_finished, status
        req = self.requests.get(request_id)
        if req is not None:
            self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        self.kv_cache_manager.free(req)
        del self.requests[req.request_id]
        del self._arrival_seq[req.request_id]
        self._queue_key.pop(req.request_id, None)

    def _fail(self, req: Request, err: Exception) -> None:
        """Finish a request whose own data made scheduling it raise; its blocks go back."""
        self._failed.append((req.request_id, f"{type(err).__name__}: {err}"))
        self._finish(req, RequestStatus.FINISHED_ABORTED)

    def pop_failed(self) -> list[tuple[str, str]]:
        """(request id, cause) of the requests failed alone since the last call."""
        failed, self._failed = self._failed, []
        return failed

    def _enqueue(self, req: Request, front: bool) -> None:
        """Insert into the waiting queue: by priority, preempted requests at the front of theirs."""
        n = next(self._counter)
        key = (req.priority, 0, -n) if front else (req.priority, 1, req.arrival_time, n)
        self._queue_key[req.request_id] = key
        bisect.insort(self.waiting, req, key=lambda r: self._queue_key[r.request_id])

    def _preempt(self, req: Request) -> None:
        """Preempt by recompute: free its blocks, keep its outputs, requeue it at the front."""
        self.kv_cache_manager.free(req)
        self.running.remove(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._enqueue(req, front=True)

    def _preempt_held(self, scheduled: dict[str, int], preempted: list[str]) -> bool:
        """Free the blocks of a held beam (one that waits for the others of its request, not
        scheduled this step) so that a waiting sequence fits: held beams filling the cache
        would otherwise wait forever for sequences that cannot get blocks. False: none held."""
        held = [r for r in self.running if r.held and r.request_id not in scheduled]
        if not held:
            return False
        victim = max(held, key=self._victim_key)
        self._preempt(victim)
        preempted.append(victim.request_id)
        return True

    def _victim_key(self, req: Request) -> tuple:
        """max() of this is the request to preempt: lowest priority (largest value), then newest."""
        return req.priority, req.arrival_time, self._arrival_seq[req.request_id]

    def _cached_prefix(self, req: Request):
        """Prefix-cache hits for a request, none when it asked for prompt logprobs (every prompt
        position must then be computed)."""
        if req.sampling_params.prompt_logprobs is not None:
            return [], 0
        return self.kv_cache_manager.get_computed_blocks(req)

    def _fork_parent(self, req: Request) -> Request | None:
        """The sequence a child shares its blocks with (an n > 1 sibling, or the beam it continues),
        or None to run it on its own: the child's tokens before its last must lead the parent's."""
        parent = self.requests.get(req.fork_of) if req.fork_of is not None else None
        n = req.num_prompt_tokens - 1
        if (parent is None or parent.status == RequestStatus.PREEMPTED
                or parent.all_token_ids[:n] != req.prompt_token_ids[:n]):
            return None
        return parent

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        kv = self.kv_cache_manager
        budget = self.sched.max_num_batched_tokens
        scheduled: dict[str, int] = {}      # request id -> tokens this step, in batch order
        drafts: dict[str, list[int]] = {}   # request id -> draft tokens among them
        copy_blocks: list[tuple[int, int]] = []
        preempted: list[str] = []

        # 1. Running requests: decode tokens and the rest of partially computed prompts.
        for req in list(self.running):
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING or req.held:  # preempted earlier in this loop, or held
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            spec = self._drafts_to_verify(req, num_new, budget)
            while True:
                if kv.allocate_slots(req, num_new + len(spec), copy_blocks):
                    scheduled[req.request_id] = num_new + len(spec)
                    if spec:
                        drafts[req.request_id] = spec
                    req.spec_token_ids = []
                    req.num_computed_tokens += num_new + len(spec)
                    budget -= num_new + len(spec)
                    break
                if spec:            # no blocks for the drafts: verify none rather than preempt for them
                    spec = []
                    continue
                victim = max(self.running, key=self._victim_key)
                budget += scheduled.pop(victim.request_id, 0)
                drafts.pop(victim.request_id, None)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break

        # 2. Waiting and preempted requests, unless this step already had to preempt. Held beams
        # do not count against max_num_seqs: they wait for the very sequences queued here.
        active = sum(1 for r in self.running if not r.held)
        for req in [] if preempted else list(self.waiting):
            if budget == 0 or active >= self.sched.max_num_seqs:
                break
            if req.held:
                continue
            parent = self._fork_parent(req)
            if parent is not None:
                # Fork only from tokens computed in an earlier step: their KV is written.
                computed_before = parent.num_computed_tokens - scheduled.get(parent.request_id, 0)
                if (parent.status != RequestStatus.RUNNING
                        or computed_before < max(parent.num_prompt_tokens, req.num_prompt_tokens - 1)):
                    continue
            try:
                fork = kv.get_fork_blocks(parent, req) if parent is not None else None
                if fork is None:    # no parent, or a window of the parent no longer holds the child's
                    parent = None
                    fork = self._cached_prefix(req)
                shared_blocks, num_shared = fork
                num_new = req.num_tokens - num_shared
                if (not self.sched.chunked_prefill and num_new > budget
                        and num_new <= self.sched.max_num_batched_tokens):
                    break  # whole prompts only; one longer than the whole budget is still chunked
                num_new = min(num_new, budget)
                allocated = kv.allocate_slots(req, num_new, copy_blocks, shared_blocks, num_shared)
                while not allocated and self._preempt_held(scheduled, preempted):
                    # Held beams filled the cache and one of them gave its blocks back (it will
                    # recompute): find this request's prefix hits again, as its parent may be it.
                    parent = None
                    shared_blocks, num_shared = self._cached_prefix(req)
                    num_new = min(req.num_tokens - num_shared, budget)
                    allocated = kv.allocate_slots(req, num_new, copy_blocks, shared_blocks, num_shared)
            except Exception as e:  # this request's own data (e.g. its hash inputs): it fails alone
                self._fail(req, e)
                continue
            if not allocated:
                break
            if parent is None and self.cache.enable_prefix_caching:
                self.stats.prefix_cache_queries += req.num_tokens
                self.stats.prefix_cache_hits += num_shared
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_shared
            self.waiting.remove(req)
            self._queue_key.pop(req.request_id)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            active += 1
            scheduled[req.request_id] = num_new
            req.num_computed_tokens = num_shared + num_new
            budget -= num_new

        chunks = []
        for rid, n in scheduled.items():
            req = self.requests[rid]
            spec = drafts.get(rid, [])
            start, end = req.num_computed_tokens - n, req.num_computed_tokens - len(spec)
            chunks.append(ScheduledChunk(req, req.all_token_ids[start:end] + spec, start, kv.block_ids(rid),
                                         sample=end == req.num_tokens and req.max_tokens > 0,
                                         draft_token_ids=spec))
        return SchedulerOutput(chunks, copy_blocks, preempted, sum(scheduled.values()))

    def _drafts_to_verify(self, req: Request, num_new: int, budget: int) -> list[int]:
        """The drafts a running request feeds after its last token this step: only at a decode
        step (its one new token is its last sampled one), cut so that the budget holds them and
        the accepted drafts plus one token never pass max_tokens or max_model_len."""
        if not req.spec_token_ids or num_new != 1 or req.num_tokens - req.num_computed_tokens != 1:
            return []
        room = min(budget - 1, req.max_tokens - req.num_output_tokens - 1,
                   self.max_model_len - req.num_tokens - 1)
        return req.spec_token_ids[:max(room, 0)]

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Append sampled tokens, apply token-level stops, free finished requests' blocks.

        A chunk with drafts samples the accepted drafts then one token: the rejected drafts are
        taken off `num_computed_tokens`, and the tokens are appended one by one with the stop
        checks, so a stop cuts exactly where one-token steps would (nothing after it is kept).
        Chunks of requests aborted since `schedule()` are skipped. Returns the requests that
        finished in this call.
        """
        finished = []
        for chunk in out.chunks:
            req = chunk.request
            if req.status != RequestStatus.RUNNING or self.requests.get(req.request_id) is not req:
                continue
            tokens = sampled.get(req.request_id, ()) if chunk.sample else ()
            if chunk.draft_token_ids:
                num_accepted = max(0, len(tokens) - 1)
                assert list(tokens[:num_accepted]) == chunk.draft_token_ids[:num_accepted], "accepted != drafts"
                req.num_computed_tokens -= len(chunk.draft_token_ids) - num_accepted
            status = None
            for token_id in tokens:
                req.append_output_token(token_id)
                status = self._check_stop(req, token_id)
                if status is not None:
                    break
            try:  # after the append: accepted drafts are computed tokens, hashed with the rest
                self.kv_cache_manager.cache_blocks(req, min(req.num_computed_tokens, req.num_tokens))
            except Exception as e:  # hashing this request's blocks: it fails alone
                self._fail(req, e)
                continue
            if req.max_tokens == 0 and req.num_computed_tokens == req.num_tokens:
                status = RequestStatus.FINISHED_LENGTH    # scoring the prompt only
            if status is not None:
                self._finish(req, status)
                finished.append(req)
        return finished

    def _check_stop(self, req: Request, token_id: int) -> RequestStatus | None:
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                req.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- what the engine, the runner and /metrics read -----------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_block_table(self, request_id: str) -> list[list[int]]:
        """Per KV group, the request's block ids."""
        return self.kv_cache_manager.block_ids(request_id)

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
        """Blocks some request references (0 when idle: anything else is a leak)."""
        return self.kv_cache_manager.num_total_blocks - self.kv_cache_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.kv_cache_manager.num_total_blocks
