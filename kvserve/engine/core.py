"""EngineCore: the step loop. schedule → run the model → update → detokenize → outputs.

Not thread-safe: one thread owns it (the offline LLM's caller, or AsyncEngine's engine thread).
A request with n > 1 becomes n sibling sequences ("<id>#<i>") in the scheduler; the first
computes the prompt and the others fork its KV blocks (shared by refcount, copy-on-write).

Fault isolation: `add_request` validates and normalizes everything a request carries, so that
nothing in it can make a step raise. If a step raises anyway, only the requests responsible
fail: the scheduler fails a request whose own data breaks its scheduling, and a model step that
raises is run again on halves of its batch until the chunks that raise are found (a step's KV
writes are idempotent, and the runner restores seeded generators on failure). Those requests
finish with `error` set; everyone else's step goes on.

Speculative decoding (config.speculative): after each step the Drafter (kvserve/spec/drafter.py)
proposes draft tokens for every sequence that sampled and still runs, and puts them on its
Request (`spec_token_ids`); the scheduler feeds them next step, the runner verifies them with
the RejectionSampler (kvserve/spec/rejection.py) and returns the accepted drafts plus one token,
and the scheduler appends those token by token with its stop checks. The engine emits exactly
the tokens the scheduler kept, each through the detokenizer (stop strings) in turn. Sequences
with a structured-output constraint do not speculate (their grammar masks one position a step).
"""
from __future__ import annotations

import logging
import operator
import os
import time
import traceback
from dataclasses import dataclass, field, replace

import torch


from kvserve.config import DTYPE_BYTES, KV_SCALE_BYTES, EngineConfig, KVShape, resolve_distributed
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler, SchedulerOutput
from kvserve.engine.beam_search import BeamRun
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.errors import CONSTRAINT_FAILED
from kvserve.engine.grammar import GrammarManager
from kvserve.model.loader import load_model
from kvserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvserve.model.llama import LlamaForCausalLM
from kvserve.runner import pipeline_parallel, tensor_parallel
from kvserve.runner.device import activation_bytes, cuda_available, cuda_kv_budget
from kvserve.runner.ranks import RankLost
from kvserve.runner.model_runner import ModelRunner, SampledToken, StepOutput
from kvserve.runner.sampler import TokenLogprobs
from kvserve.sampling_params import ParamError, SamplingParams, is_text
from kvserve.spec.drafter import Drafter, load_draft
from kvserve.spec.rejection import RejectionSampler

log = logging.getLogger("kvserve")


@dataclass
class _Sample:
    """One of a request's n sequences, as the engine tracks it."""
    seq_id: str
    index: int
    request: Request
    detok: IncrementalDetokenizer
    out: CompletionOutput
    changed: bool = False


@dataclass
class _Group:
    """A user request: its prompt, its n samples, its timings."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None
    first_token_seen: bool = field(default=False)
    prompt_logprobs: list[Logprob | None] | None = None   # by prompt position; [0] is always None
    prompt_logprobs_missing: int = 0                      # positions still to come
    beam: BeamRun | None = None                           # use_beam_search: its beams (samples fill at the end)

    def record_prompt_logprobs(self, start: int, entries: list[Logprob]) -> None:
        """Keep the first value of each position (a preempted request computes them again)."""
        for pos, lp in enumerate(entries, start):
            if self.prompt_logprobs[pos] is None:
                self.prompt_logprobs[pos] = lp
                self.prompt_logprobs_missing -= 1

    @property
    def finished(self) -> bool:
        return all(s.out.finished for s in self.samples)


def run_rank(config: EngineConfig) -> int:
    """A process whose rank is not 0 (another node's first rank, or one torchrun started): execute
    rank 0's steps until it stops; the exit code (runner/worker.py)."""
    from kvserve.runner.worker import serve_rank
    return serve_rank(config)


class EngineCore:
    def __init__(self, config: EngineConfig):
        config = self.config = config.on_device(cuda_available(config.device))
        torch.set_num_threads(config.num_threads)
        t0 = time.perf_counter()
        # Tensor parallelism: the other ranks start first and load their shards while this
        # process loads its own (runner/tensor_parallel.py).
        if config.tensor_parallel_size > 1 and config.model.quantization is None:
            config = self.config = replace(config, model=replace(config.model, quantization="none"))
        world = config.tensor_parallel_size * config.pipeline_parallel_size
        if config.distributed.world != world:       # an EngineConfig built by hand: every rank on this machine
            config = self.config = replace(config, distributed=resolve_distributed(world, env={}))
        if config.distributed.rank != 0:
            raise ValueError(f"this process is rank {config.distributed.rank} of {world}: only rank 0 runs the "
                             f"engine; start the other ranks with a kvserve command (serve, generate), which "
                             f"executes rank 0's steps there (docs/scale-out.md)")
        self.ranks = None
        if config.tensor_parallel_size > 1:
            self.ranks = tensor_parallel.start(config)
        elif config.pipeline_parallel_size > 1:
            self.ranks = pipeline_parallel.start(config)
        loaded = load_model(config.model, config.device)
        self.load_seconds = time.perf_counter() - t0
        self.model_path = loaded.path
        self.quantization = loaded.quantization
        self.arch = arch = loaded.arch
        self.tokenizer = loaded.tokenizer
        self.model_name = getattr(arch, "model_name", None) or _stem(loaded.path)
        self.max_model_len = min(config.model.max_model_len or arch.max_position_embeddings,
                                 arch.max_position_embeddings)
        kv_dtype = config.cache.resolved_kv_dtype(config.model.dtype)
        self.kv_shape = KVShape(arch.num_layers, arch.num_kv_heads, arch.head_dim, DTYPE_BYTES[kv_dtype],
                                KV_SCALE_BYTES.get(kv_dtype, 0))
        # A draft model's KV cache (speculative decoding) takes its share of the budget, in
        # proportion to its bytes per token: it holds as many blocks as the target's.
        draft = load_draft(config.speculative, loaded, config) if config.speculative is not None else None
        cache = config.cache
        if config.device != "cpu" and cache.kv_cache_memory is None and cache.num_blocks_override is None:
            reserve = activation_bytes(arch, config.scheduler, DTYPE_BYTES[config.model.dtype])
            cache = replace(cache, kv_cache_memory=cuda_kv_budget(config.device, config.gpu_memory_utilization,
                                                                  reserve))
        if draft is not None:
            draft_bytes = KVShape(draft.arch.num_layers, draft.arch.num_kv_heads, draft.arch.head_dim,
                                  DTYPE_BYTES[kv_dtype], KV_SCALE_BYTES.get(kv_dtype, 0)).bytes_per_token
            cache = cache.share(self.kv_shape.bytes_per_token / (self.kv_shape.bytes_per_token + draft_bytes))
        # One KV group per attention window (full first), each sized from the budget (config.py).
        self.kv_groups = cache.kv_groups(self.kv_shape, [arch.window_of(i) for i in range(arch.num_layers)],
                                         config.scheduler)
        self.num_blocks = sum(g.num_blocks for g in self.kv_groups)
        self.scheduler = Scheduler(config.scheduler, config.cache, self.kv_groups, self.max_model_len)
        self.drafter = (Drafter.create(config.speculative, draft, config, max(g.num_blocks for g in self.kv_groups))
                        if config.speculative is not None else None)
        if self.ranks is not None:          # the ranks of tensor or pipeline parallelism
            pipeline = config.pipeline_parallel_size > 1
            try:
                if not isinstance(loaded.model, LlamaForCausalLM):
                    raise ValueError(f"tensor and pipeline parallelism run the Llama family only, not {arch.name}")
                if pipeline:
                    if len(self.kv_groups) > 1:
                        raise ValueError("pipeline parallelism runs models with one attention window only")
                    shard = pipeline_parallel.keep_stage(loaded, 0, config.pipeline_parallel_size)
                    self.ranks.broadcast(self.kv_groups[0].num_blocks)     # each stage's pools: as many blocks
                else:
                    shard = tensor_parallel.shard_model(loaded, 0, config.tensor_parallel_size)
                    self.ranks.broadcast(self.kv_groups)           # the other ranks size their pools alike
            except Exception:
                self.ranks.kill()
                raise
            self.runner = (ModelRunner(shard, config, self.kv_groups[0].num_blocks, pp=self.ranks) if pipeline
                           else ModelRunner(shard, config, self.kv_groups, tp=self.ranks))
        else:
            self.runner = ModelRunner(loaded, config, self.kv_groups,
                                      verifier=RejectionSampler() if self.drafter is not None else None)
        self.eos_token_ids = set(getattr(self.tokenizer, "eos_token_ids", None) or arch.eos_token_ids)
        self.grammar = GrammarManager(self.tokenizer, arch.vocab_size,
                                      overlap=config.num_threads < len(os.sched_getaffinity(0)))
        self._groups: dict[str, _Group] = {}
        self._seq_to_group: dict[str, tuple[_Group, _Sample]] = {}
        self._beam_seqs: dict[str, _Group] = {}   # beam sequence id -> its request (kvserve/engine/beam_search.py)
        self._pending: list[RequestOutput] = []   # outputs produced outside step() (aborts)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.last_step_tokens = 0                 # tokens the last step scheduled (for /metrics)

    def close(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do without them)."""
        if self.ranks is not None:
            self.ranks.shutdown()
            self.ranks = None

    # ---- capacity facts printed at start ----
    @property
    def kv_token_capacity(self) -> int:
        """Tokens of context the cache holds: the smallest group's blocks x block size (a window
        group's blocks are freed behind its window, so it serves longer sequences than that)."""
        bs = self.config.cache.block_size
        full = [g.num_blocks for g in self.kv_groups if g.window is None]
        return (min(full) if full else min(g.num_blocks for g in self.kv_groups)) * bs

    def _kv_cache_line(self) -> str:
        bs, bpt = self.config.cache.block_size, self.kv_shape.bytes_per_token
        layer_block = bpt // self.arch.num_layers * bs
        total = sum(g.num_blocks * len(g.layers) * layer_block for g in self.kv_groups)
        if len(self.kv_groups) == 1:
            blocks = f"{self.num_blocks} blocks x {bs} tokens"
        else:
            blocks = " + ".join(f"{g.num_blocks} blocks ({len(g.layers)} layers, "
                                f"{'full' if g.window is None else f'window {g.window}'})" for g in self.kv_groups)
            blocks += f" x {bs} tokens"
        cap = self.kv_token_capacity
        return (f"KV cache: {bpt} bytes/token, {blocks} = {cap} tokens ({total / 2**20:.0f} MiB); "
                f"max concurrency at {self.max_model_len} tokens: {cap / self.max_model_len:.2f}x")

    def describe(self) -> str:
        return (f"model {self.model_path}\n"
                f"  {self.arch.num_layers} layers, {self.arch.num_heads} query / {self.arch.num_kv_heads} KV heads, "
                f"head_dim {self.arch.head_dim}, context {self.max_model_len}, dtype {self.config.model.dtype}, "
                f"weights {self.quantization}, "
                f"loaded in {self.load_seconds:.2f}s\n"
                f"  {self._kv_cache_line()}; "
                f"prefix caching {'on' if self.config.cache.enable_prefix_caching else 'off'}\n"
                f"  steps: {self.step_path}"
                + (f"\n  speculative decoding: {self.drafter.describe()}" if self.drafter else ""))

    @property
    def step_path(self) -> str:
        """How the runner runs a step, e.g. "C layer stack, avx2 kernels" (benchmarks record it)."""
        stack = self.runner.layer_stack
        if self.ranks is not None:
            kind = "pipeline stages" if self.config.pipeline_parallel_size > 1 else "tensor-parallel ranks"
            return f"PyTorch forward, {self.ranks.world} {kind} (gloo)"
        if self.runner.gpu_attention:
            graphs = self.runner.graphs
            return (f"PyTorch forward on {self.config.device}, Triton attention, "
                    + (f"CUDA graphs for decode batches up to {graphs.max_batch}" if graphs else "no CUDA graphs"))
        if stack is None:
            why = self.runner.why_not_layer_stack
            return f"PyTorch forward ({why})" if why else "PyTorch forward"
        return f"C layer stack, {stack.isa} kernels"

    # ---- requests in ----
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None,
                    arrival_time: float | None = None) -> None:
        if not isinstance(request_id, str) or request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use or not a string")
        prompt_token_ids = self._checked_prompt(prompt_token_ids)
        self._check_params(params, priority, cache_salt)
        room = self.max_model_len - len(prompt_token_ids)
        if room < 1:
            raise ParamError("prompt", f"prompt has {len(prompt_token_ids)} tokens; this model's context is "
                                       f"{self.max_model_len} tokens, which leaves no room to generate")
        self.grammar.check(params)     # ParamError with the matcher's message when it does not compile
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if params.min_tokens > max_tokens:
            raise ParamError("min_tokens", f"min_tokens ({params.min_tokens}) is more than the "
                                           f"{max_tokens} tokens this request can generate")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if params.use_beam_search:
            self._add_beam_request(request_id, prompt_token_ids, params, priority, cache_salt, arrival, max_tokens)
            return
        seqs = []
        for i in range(params.n):
            seq_params = params.child(i) if params.n > 1 else params
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            seqs.append(Request(request_id=seq_id, prompt_token_ids=list(prompt_token_ids),
                                sampling_params=seq_params, eos_token_ids=self.eos_token_ids,
                                max_tokens=max_tokens, arrival_time=arrival, priority=priority,
                                cache_salt=cache_salt,
                                fork_of=None if i == 0 else seqs[0].request_id))
        added = []
        try:
            for r in seqs:
                self.scheduler.add_request(r)
                added.append(r)
        except Exception:
            for r in added:
                self.scheduler.abort_request(r.request_id)
            raise
        group = _Group(request_id, list(prompt_token_ids), params, [], RequestMetrics(arrival_time=arrival))
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(prompt_token_ids)
            group.prompt_logprobs_missing = len(prompt_token_ids) - 1
        for i, r in enumerate(seqs):
            sample = _Sample(r.request_id, i, r, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, r.sampling_params),
                             CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None))
            group.samples.append(sample)
            self._seq_to_group[r.request_id] = (group, sample)
            if params.structured_outputs is not None:
                self.grammar.add(r.request_id, params.structured_outputs)
        self._groups[request_id] = group
        self.prompt_tokens_total += len(prompt_token_ids)

    def _add_beam_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          priority: int, cache_salt: str | None, arrival: float, max_tokens: int) -> None:
        def new_request(seq_id, tokens, seq_params, seq_max_tokens, fork_of):
            return Request(request_id=seq_id, prompt_token_ids=tokens, sampling_params=seq_params,
                           max_tokens=seq_max_tokens, arrival_time=arrival, priority=priority,
                           cache_salt=cache_salt, fork_of=fork_of)
        run = BeamRun(request_id, prompt_token_ids, params, self.eos_token_ids, max_tokens, new_request)
        (first,) = run.seqs
        self.scheduler.add_request(first)
        group = _Group(request_id, list(prompt_token_ids), params, [], RequestMetrics(arrival_time=arrival), beam=run)
        for i in range(params.n):
            group.samples.append(_Sample(f"{request_id}#{i}", i, first,
                                         IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
                                         CompletionOutput(index=i)))
        self._groups[request_id] = group
        self._beam_seqs[first.request_id] = group
        self.prompt_tokens_total += len(prompt_token_ids)

    def _checked_prompt(self, prompt_token_ids) -> list[int]:
        """The prompt as a list of Python ints inside the vocabulary, or ParamError("prompt")."""
        try:
            ids = [operator.index(t) for t in prompt_token_ids]
        except TypeError:
            raise ParamError("prompt", "prompt token ids must be integers") from None
        if not ids:
            raise ParamError("prompt", "prompt is empty: give at least one token")
        vocab = self.arch.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ParamError("prompt", f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        return ids

    def _check_params(self, params: SamplingParams, priority: int, cache_salt: str | None) -> None:
        """What a request carries besides its prompt, checked again here: the offline API hands
        SamplingParams objects that may have been changed after they were built."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.check()
        if params.n > self.config.scheduler.max_waiting:
            raise ParamError("n", f"n={params.n} sequences can never fit the waiting queue "
                                  f"(max_waiting={self.config.scheduler.max_waiting}, --max-waiting)")
        if isinstance(priority, bool) or not isinstance(priority, int) or not -2**63 <= priority < 2**63:
            raise ParamError("priority", "priority must be an integer in [-2**63, 2**63)")
        if cache_salt is not None:
            if not isinstance(cache_salt, str) or not cache_salt:
                raise ParamError("cache_salt", "cache_salt must be a non-empty string")
            if not is_text(cache_salt):
                raise ParamError("cache_salt", "cache_salt must be valid Unicode text (no lone surrogates)")

    def abort_request(self, request_id: str) -> None:
        group = self._groups.get(request_id)
        if group is None:
            return
        if group.beam is not None:    # its sequences are the beams; its samples are only outputs
            for seq in group.beam.seqs:
                self.scheduler.abort_request(seq.request_id)
                self._beam_seqs.pop(seq.request_id, None)
            group.beam.seqs = []
        for s in group.samples:
            if not s.out.finished:
                if group.beam is None:
                    self.scheduler.abort_request(s.seq_id)
                s.out.finish_reason = "abort"
                s.changed = True
        self._pending.append(self._emit(group))

    def reset(self) -> None:
        """Drop every request at once, after a crash of the loop driving this core: a fresh
        scheduler (every KV block free, the prefix cache empty), no per-request runner state.
        The model and the KV tensors stay; nothing is reloaded."""
        self.scheduler = Scheduler(self.config.scheduler, self.config.cache, self.kv_groups, self.max_model_len)
        self.runner.forget_requests()
        if self.drafter is not None:
            self.drafter.forget_requests()
        self.grammar.clear()
        self._groups.clear()
        self._seq_to_group.clear()
        self._beam_seqs.clear()
        self._pending.clear()

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or bool(self._pending)

    # ---- one step ----
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        self.last_step_tokens = 0
        if not self.scheduler.has_unfinished_requests():
            return outputs
        sched = self.scheduler.schedule()
        self.last_step_tokens = sched.num_batched_tokens
        self._fail_scheduler_rejects()
        now = time.monotonic()
        for c in sched.chunks:
            group = self._group_of(c.request.request_id)
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
        grammar = self.grammar.start_bitmask([c.request.request_id for c in sched.chunks if c.sample])
        t_step = time.perf_counter()
        step = self._execute(sched, grammar)
        self._observe_step_cost(sched, time.perf_counter() - t_step)
        sampled = step.sampled
        for seq_id, plp in step.prompt_logprobs.items():
            entry = self._seq_to_group.get(seq_id)
            if entry is not None:
                entry[0].record_prompt_logprobs(plp.start, [self._to_logprob(t) for t in plp.entries])
        outputs_before = {c.request.request_id: c.request.num_output_tokens for c in sched.chunks}
        finished = self.scheduler.update_from_output(sched, {k: [t.token_id for t in v] for k, v in sampled.items()
                                                            if k in self._seq_to_group or k in self._beam_seqs})
        self._fail_scheduler_rejects()
        self._record_verifications(sched, sampled)
        now = time.monotonic()
        touched: dict[str, _Group] = {}
        self._advance_beams(sampled, now, touched)
        for seq_id, toks in sampled.items():
            entry = self._seq_to_group.get(seq_id)
            if entry is None:
                continue
            group, sample = entry
            req = sample.request
            kept = req.num_output_tokens - outputs_before.get(seq_id, req.num_output_tokens)  # a stop cuts the rest
            for tok in toks[:kept]:
                self._append_token(group, sample, tok, now)
                if self.grammar.constrained(seq_id):
                    self._advance_grammar(group, sample, tok.token_id)
            touched[group.request_id] = group
        for req in finished:
            entry = self._seq_to_group.get(req.request_id)
            if entry is None:
                continue
            group, sample = entry
            if not sample.out.finished:
                self._finish_sample(sample, req)
            touched[group.request_id] = group
        for group in touched.values():
            if group.request_id in self._groups:
                outputs.append(self._emit(group))
        outputs.extend(self._pending)
        self._pending = []
        self._propose_drafts(sched)
        return outputs

    # ---- beam search ----
    def _group_of(self, seq_id: str) -> _Group | None:
        """The user request a scheduler sequence (a sample or a beam) belongs to."""
        entry = self._seq_to_group.get(seq_id)
        return entry[0] if entry is not None else self._beam_seqs.get(seq_id)

    def _advance_beams(self, sampled: dict[str, list[SampledToken]], now: float, touched: dict[str, _Group]) -> None:
        """Hand each beam's candidates to its request; a request whose beams all reported takes
        its next beams (forks, continuations, aborts), or finishes when its search is done."""
        ready: dict[str, _Group] = {}
        for seq_id, toks in sampled.items():
            group = self._beam_seqs.get(seq_id)
            if group is None or group.request_id not in self._groups:
                continue
            req = self.scheduler.requests.get(seq_id)
            if req is None:          # the scheduler finished it (its last round): the search is done too
                req = next(s for s in group.beam.seqs if s.request_id == seq_id)
            if group.beam.report(req, toks[0].logprobs.top):
                ready[group.request_id] = group
        for group in ready.values():
            run = group.beam
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
                group.first_token_seen = True
            group.metrics.last_token_time = now
            added, dropped = run.advance()
            for seq in dropped:
                self.scheduler.abort_request(seq.request_id)
                self._beam_seqs.pop(seq.request_id, None)
                self._forget_sequence(seq.request_id)
            for seq in added:
                self.scheduler.add_request(seq)
                self._beam_seqs[seq.request_id] = group
            if run.search.done:      # the only output of a beam request: its n best hypotheses
                self._finish_beams(group)
                touched[group.request_id] = group

    def _finish_beams(self, group: _Group) -> None:
        """The best n hypotheses become the request's completions."""
        for sample, hyp in zip(group.samples, group.beam.results(group.params.n)):
            out = sample.out
            out.token_ids = list(hyp.tokens)
            out.delta_token_ids = list(hyp.tokens)
            delta, _ = sample.detok.add_tokens(hyp.tokens)
            out.text = out.delta_text = delta + sample.detok.flush()
            out.cumulative_logprob = hyp.logprob
            out.finish_reason = hyp.finish_reason
            if hyp.finish_reason == "stop" and hyp.tokens and hyp.tokens[-1] in group.params.stop_token_ids:
                out.stop_reason = hyp.tokens[-1]
            sample.changed = True
            self.generation_tokens_total += len(hyp.tokens)
            group.metrics.num_generation_tokens = max(group.metrics.num_generation_tokens, len(hyp.tokens))

    # ---- speculative decoding ----
    def _record_verifications(self, sched: SchedulerOutput, sampled: dict[str, list[SampledToken]]) -> None:
        """Count each verification's accepted drafts (the runner's answer, before any stop cut)."""
        if self.drafter is None:
            return
        for c in sched.chunks:
            toks = sampled.get(c.request.request_id)
            if c.draft_token_ids and toks:
                self.drafter.record(c.request.request_id, len(c.draft_token_ids), len(toks) - 1)

    def _observe_step_cost(self, sched: SchedulerOutput, seconds: float) -> None:
        """Steps of decodes only (each chunk its last token plus its drafts) teach the drafter
        what a token row costs here; a prompt chunk's rows take another kernel."""
        if self.drafter is not None and sched.chunks and all(
                len(c.token_ids) == 1 + len(c.draft_token_ids) and c.start_pos >= c.request.num_prompt_tokens
                for c in sched.chunks):
            self.drafter.observe_step(sched.num_batched_tokens, seconds,
                                      verified=any(c.draft_token_ids for c in sched.chunks))

    def _propose_drafts(self, sched: SchedulerOutput) -> None:
        """Drafts for every sequence that sampled this step and still runs (none under a grammar)."""
        if self.drafter is None:
            return
        t0 = time.perf_counter()
        batch_rows = sum(1 for c in sched.chunks if c.sample)
        reqs = [c.request for c in sched.chunks
                if c.sample and c.request.status == RequestStatus.RUNNING and c.request.request_id in self._seq_to_group
                and not self.grammar.constrained(c.request.request_id)]
        if reqs:
            try:
                proposed = self.drafter.propose_batch(reqs, batch_rows)
            except Exception:        # a draft is only a guess: these requests decode without one
                log.exception("drafting failed for %d request(s); they decode without drafts this step", len(reqs))
                proposed = [[] for _ in reqs]
            for req, drafts in zip(reqs, proposed):
                req.spec_token_ids = drafts
        self.drafter.stats.draft_seconds += time.perf_counter() - t0

    def _forget_sequence(self, seq_id: str) -> None:
        """Per-sequence state outside the scheduler: the runner's generator, the drafter's index."""
        self.runner.free_request(seq_id)
        if self.drafter is not None:
            self.drafter.free(seq_id)

    # ---- fault isolation ----
    def _advance_grammar(self, group: _Group, sample: _Sample, token_id: int) -> None:
        """Advance the sample's matcher; a complete grammar stops the sample (even with
        ignore_eos), a token the grammar refuses fails the request."""
        terminated, error = self.grammar.accept(sample.seq_id, token_id)
        if error is not None:                 # the request's own constraint: a warning, not ours
            log.warning("request %s: %s", group.request_id, error)
            self._fail_sequence(sample.seq_id, CONSTRAINT_FAILED + error)
        elif terminated and not sample.out.finished:
            self.scheduler.finish_request(sample.seq_id, RequestStatus.FINISHED_STOPPED)
            self._finish_sample(sample, sample.request)
            sample.out.finish_reason = "stop"

    def _execute(self, sched: SchedulerOutput, grammar=None) -> StepOutput:
        """The runner's step; if it raises, the chunks responsible fail alone (see the module doc)."""
        try:
            return self.runner.execute(sched, grammar)
        except RankLost:
            raise                   # no step can run: not a request's fault
        except Exception as e:
            log.error("model step of %d chunks failed; isolating the request(s) responsible:\n%s",
                      len(sched.chunks), traceback.format_exc())
            return self._isolate(sched.chunks, sched.copy_blocks, e, grammar)

    def _isolate(self, chunks, copy_blocks, err: Exception, grammar=None) -> StepOutput:
        """Bisect: run each half of `chunks` on its own; a single chunk that raises fails its request."""
        if len(chunks) == 1:
            self._fail_sequence(chunks[0].request.request_id, f"{type(err).__name__}: {err}")
            return StepOutput()
        sampled = StepOutput()
        mid = len(chunks) // 2
        for half in (chunks[:mid], chunks[mid:]):
            part = SchedulerOutput(half, copy_blocks, [], sum(len(c.token_ids) for c in half))
            try:
                sampled.update(self.runner.execute(part, grammar))   # copy-on-write copies are idempotent
            except Exception as e:
                sampled.update(self._isolate(half, copy_blocks, e, grammar))
        return sampled

    def _fail_scheduler_rejects(self) -> None:
        for seq_id, cause in self.scheduler.pop_failed():
            log.error("request %s failed while being scheduled: %s", seq_id, cause)
            self._fail_sequence(seq_id, cause)

    def _fail_sequence(self, seq_id: str, cause: str) -> None:
        """Fail the user request that `seq_id` belongs to (all its samples), with `cause`."""
        group = self._group_of(seq_id)
        if group is None:
            return
        group.error = cause
        self.abort_request(group.request_id)

    def _append_token(self, group: _Group, sample: _Sample, tok: SampledToken, now: float) -> None:
        out = sample.out
        if out.finished:
            return
        out.token_ids.append(tok.token_id)
        out.delta_token_ids.append(tok.token_id)
        self.generation_tokens_total += 1
        if not group.first_token_seen:
            group.first_token_seen = True
            group.metrics.first_token_time = now
            group.num_cached_tokens = sample.request.num_cached_tokens
        group.metrics.last_token_time = now
        group.metrics.num_generation_tokens = max(group.metrics.num_generation_tokens, len(out.token_ids))
        if tok.logprobs is not None and out.logprobs is not None:
            lp = self._to_logprob(tok.logprobs)
            out.logprobs.append(lp)
            out.delta_logprobs = (out.delta_logprobs or []) + [lp]
            out.cumulative_logprob = (out.cumulative_logprob or 0.0) + lp.logprob
        delta, stopped = sample.detok.add_tokens([tok.token_id])
        out.text += delta
        out.delta_text += delta
        sample.changed = True
        if stopped:
            self.scheduler.finish_request(sample.seq_id, RequestStatus.FINISHED_STOPPED)
            self._forget_sequence(sample.seq_id)
            out.finish_reason = "stop"
            out.stop_reason = sample.detok.stop_reason if hasattr(sample.detok, "stop_reason") else None

    def _finish_sample(self, sample: _Sample, req: Request) -> None:
        tail = sample.detok.flush()
        sample.out.text += tail
        sample.out.delta_text += tail
        sample.out.finish_reason = req.finish_reason
        if req.finish_reason == "stop" and req.output_token_ids and \
                req.output_token_ids[-1] in req.sampling_params.stop_token_ids:
            sample.out.stop_reason = req.output_token_ids[-1]
        sample.changed = True
        self._forget_sequence(sample.seq_id)

    def _to_logprob(self, lp: TokenLogprobs) -> Logprob:
        dec = self.tokenizer.decode
        return Logprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                       token=dec([lp.token_id], skip_special_tokens=False),
                       top=[(t, dec([t], skip_special_tokens=False), v) for t, v in lp.top])

    def _emit(self, group: _Group) -> RequestOutput:
        """Snapshot the samples that changed this step; retire the group once all are done."""
        changed = []
        for s in group.samples:
            if not s.changed:
                continue
            o = s.out
            changed.append(CompletionOutput(
                index=o.index, text=o.text, token_ids=list(o.token_ids), delta_text=o.delta_text,
                delta_token_ids=o.delta_token_ids, logprobs=None if o.logprobs is None else list(o.logprobs),
                delta_logprobs=o.delta_logprobs, cumulative_logprob=o.cumulative_logprob,
                finish_reason=o.finish_reason, stop_reason=o.stop_reason))
            o.delta_text, o.delta_token_ids, o.delta_logprobs = "", [], None
            s.changed = False
        finished = group.finished
        if finished:
            group.metrics.finished_time = time.monotonic()
            del self._groups[group.request_id]
            for s in group.samples if group.beam is None else ():    # beam samples are no sequences
                self._seq_to_group.pop(s.seq_id, None)
                self._forget_sequence(s.seq_id)
                self.grammar.remove(s.seq_id)
        complete = group.prompt_logprobs is not None and group.prompt_logprobs_missing == 0
        return RequestOutput(request_id=group.request_id, prompt_token_ids=group.prompt_token_ids,
                             outputs=changed, finished=finished, num_cached_tokens=group.num_cached_tokens,
                             metrics=group.metrics, error=group.error,
                             prompt_logprobs=group.prompt_logprobs if complete else None)

    # ---- numbers for /metrics and the bench ----
    def stats(self) -> dict:
        s = self.scheduler
        return {"num_running": s.num_running, "num_waiting": s.num_waiting,
                "kv_cache_usage": s.kv_cache_usage,
                "kv_blocks_used": s.num_used_blocks, "kv_blocks_total": self.num_blocks,
                "prefix_cache_queries": s.stats.prefix_cache_queries,
                "prefix_cache_hits": s.stats.prefix_cache_hits,
                "num_preemptions": s.stats.num_preemptions,
                "prompt_tokens_total": self.prompt_tokens_total,
                "structured_mask_seconds": self.grammar.mask_seconds,
                "structured_masks": self.grammar.masks_filled,
                "generation_tokens_total": self.generation_tokens_total,
                **self._spec_stats()}

    def _spec_stats(self) -> dict:
        if self.drafter is None:
            return {}
        s = self.drafter.stats
        return {"spec_decode_num_drafts": s.num_drafts, "spec_decode_num_draft_tokens": s.num_draft_tokens,
                "spec_decode_num_accepted_tokens": s.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(s.accepted_per_position),
                "spec_decode_draft_seconds": s.draft_seconds, "spec_decode_verify_seconds": s.verify_seconds}


def _stem(path: str) -> str:
    """Served model name from a path: 'SmolLM2-135M-Instruct.Q4_1.gguf' -> 'SmolLM2-135M-Instruct'."""
    import os
    import re
    name = os.path.basename(path.rstrip("/"))
    name = re.sub(r"\.gguf$", "", name, flags=re.IGNORECASE)
    return re.sub(r"[.-](q\d\w*|iq\d\w*|f16|f32|bf16)$", "", name, flags=re.IGNORECASE)
