"""EngineCore: the step loop. Each step: schedule, execute, update, hand the outputs on.

Not thread-safe: one thread owns it (the offline LLM's caller, or AsyncEngine's engine thread).
What it was built from (model, KV cache, ranks, runner, drafter) comes from builder.py; what the
user sees (text, stop strings, logprobs) from output_processor.py; one request's fan-out into
samples or beams from parallel_sampling.py.

Fault isolation: `add_request` validates everything a request carries, so that nothing in it
can make a step raise. If a step raises anyway, only the requests responsible fail: the
scheduler fails a sequence whose own data breaks its scheduling, and a model step that raises
is run again on halves of its batch until the chunks that raise are found (a step's KV writes
are idempotent, and the runner restores seeded generators on failure).

Speculative decoding: after each step the drafter puts draft tokens on the sequences that
sampled; the scheduler feeds them next step and the runner verifies them (kvserve/spec/).

Async scheduling (--async-scheduling): while a step runs here (its forward leaves the GIL: the
C kernels, torch, a device), a worker thread schedules the next step, each sequence sampling now
counted as one token more (a placeholder), and flattens it. Once the step is updated,
`Scheduler.settle` drops the planned chunks of the sequences that finished (their blocks are
freed once, when they finish) and writes the sampled tokens over the placeholders, and the
planned step runs. Speculative decoding, LoRA and tensor/pipeline parallelism keep synchronous
steps, and so does planning while a beam search runs (its beams are held or forked by each
step's tokens).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
import traceback

from kvserve.config import EngineConfig
from kvserve.core.scheduler import Scheduler, SchedulerOutput
from kvserve.core.sequence import SequenceStatus
from kvserve.engine.builder import build_engine
from kvserve.engine.errors import CONSTRAINT_FAILED
from kvserve.engine.grammar import GrammarManager
from kvserve.engine.input_processor import check_max_tokens, check_prompt, check_request
from kvserve.engine.output_processor import OutputProcessor, RequestState, SampleState
from kvserve.engine.parallel_sampling import BeamGroups, beam_run, sample_sequences
from kvserve.lora.manager import LoRAManager
from kvserve.outputs import RequestOutput
from kvserve.runner.model_runner import SampledToken, StepBatch, StepOutput
from kvserve.runner.ranks import RankLost
from kvserve.sampling_params import ParamError, SamplingParams

log = logging.getLogger("kvserve")


def run_rank(config: EngineConfig) -> int:
    """A process whose rank is not 0: execute rank 0's steps until it stops; the exit code."""
    from kvserve.runner.worker import serve_rank

    return serve_rank(config)


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.parts = parts = build_engine(config)
        self.config = parts.config
        self.arch, self.tokenizer = parts.arch, parts.tokenizer
        self.model_path, self.model_name = parts.model_path, parts.model_name
        self.quantization, self.load_seconds = parts.quantization, parts.load_seconds
        self.max_model_len, self.kv_shape = parts.max_model_len, parts.kv_shape
        self.kv_groups, self.num_blocks = parts.kv_groups, parts.num_blocks
        self.runner, self.drafter, self.ranks = parts.runner, parts.drafter, parts.ranks
        self.eos_token_ids = parts.eos_token_ids
        self.scheduler = self._new_scheduler()
        overlap = self.config.num_threads < len(os.sched_getaffinity(0))
        self.grammar = GrammarManager(self.tokenizer, self.arch.vocab_size, overlap=overlap)
        self.processor = OutputProcessor(self.tokenizer)
        self.beams = BeamGroups()
        self.lora: LoRAManager | None = None  # the loaded LoRA adapters (--enable-lora)
        if self.config.enable_lora:
            self.lora = LoRAManager(
                self.runner.model, self.config.max_loras, self.config.max_lora_rank
            )
            for name, path in (self.config.lora_modules or {}).items():
                self.load_lora(name, path)
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts)
        self.last_step_tokens = 0  # tokens the last step scheduled (for /metrics)
        # async scheduling: the thread that plans the next step while one runs, and that plan
        # (its SchedulerOutput, flattened or None)
        self._forward_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._planned: tuple[SchedulerOutput, StepBatch | None] | None = None
        self.async_scheduling = self._start_async_scheduling()

    def _start_async_scheduling(self) -> bool:
        """Whether steps overlap the next step's scheduling (EngineConfig.async_scheduling, where
        nothing keeps synchronous steps); logged either way when asked for."""
        if not self.config.async_scheduling:
            return False
        keep_sync = [
            what
            for on, what in (
                (self.drafter is not None, "speculative decoding"),
                (self.ranks is not None, "tensor/pipeline parallelism"),
                (self.config.enable_lora, "LoRA adapters"),
            )
            if on
        ]
        if keep_sync:
            log.info("async scheduling off: %s keep synchronous steps", ", ".join(keep_sync))
            return False
        self._forward_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvserve-plan"
        )
        log.info(
            "async scheduling on: the next step is scheduled and prepared while a step runs "
            "(not while a beam search runs: those steps are synchronous)"
        )
        return True

    def _new_scheduler(self) -> Scheduler:
        return Scheduler(
            self.config.scheduler, self.config.cache, self.kv_groups, self.max_model_len
        )

    def close(self) -> None:
        """Stop the tensor- or pipeline-parallel ranks and the planning thread, where there are."""
        if self._forward_pool is not None:
            self._forward_pool.shutdown()
            self._forward_pool = None
        if self.ranks is not None:
            self.ranks.shutdown()
            self.ranks = None

    @property
    def kv_token_capacity(self) -> int:
        return self.parts.kv_token_capacity

    @property
    def step_path(self) -> str:
        """How the runner runs a step, e.g. "C layer stack, avx2 kernels" (benchmarks record it)."""
        return self.runner.step_path

    def describe(self) -> str:
        return self.parts.describe()

    @property
    def prompt_tokens_total(self) -> int:
        return self.processor.prompt_tokens_total

    @property
    def generation_tokens_total(self) -> int:
        return self.processor.generation_tokens_total

    # ---- requests in ----
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_request=None,
    ) -> None:
        """Validate a request (ParamError naming the field) and queue its sequences.
        `lora_request`: the LoRA adapter it runs with (a kvserve.lora.LoRARequest, or a loaded
        adapter's name); None: the base model."""
        if not isinstance(request_id, str) or request_id in self.processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use or not a string")
        prompt = check_prompt(prompt_token_ids, self.arch.vocab_size)
        check_request(params, priority, cache_salt, self.config.scheduler.max_waiting)
        max_tokens = check_max_tokens(params, len(prompt), self.max_model_len)
        self.grammar.check(params)  # ParamError with the matcher's message
        lora_name = self._lora_adapter(lora_request)
        common = dict(
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            lora_key=None if lora_name is None else self.lora.key_of(lora_name),
        )
        if params.use_beam_search:
            run = beam_run(request_id, prompt, params, self.eos_token_ids, max_tokens, **common)
            self.scheduler.add_sequence(run.seqs[0])
            state = self.processor.add(
                request_id, prompt, params, common["arrival_time"], run.seqs, beam=run
            )
            state.lora_name = lora_name
            self.beams.add(state)
            return
        seqs = sample_sequences(
            request_id, prompt, params, self.eos_token_ids, max_tokens=max_tokens, **common
        )
        self.scheduler.add_sequences(seqs)
        state = self.processor.add(request_id, prompt, params, common["arrival_time"], seqs)
        state.lora_name = lora_name
        if params.structured_outputs is not None:
            for seq in seqs:
                self.grammar.add(seq.seq_id, params.structured_outputs)

    # ---- LoRA adapters ----
    def _lora_adapter(self, lora_request) -> str | None:
        """The name of the loaded adapter a request runs with (loading a LoRARequest's path on
        first use), None for the base model; ParamError("model") for one that is not there."""
        if lora_request is None:
            return None
        name = lora_request if isinstance(lora_request, str) else lora_request.lora_name
        if self.lora is None:
            raise ParamError(
                "model",
                f"LoRA adapter {name!r} asked for, but the engine serves no adapters: start it "
                "with --enable-lora (enable_lora=True)",
            )
        if self.lora.get(name) is None:
            path = getattr(lora_request, "lora_path", "")
            if not path:
                raise ParamError(
                    "model",
                    f"LoRA adapter {name!r} is not loaded (loaded: {self.lora.names() or 'none'})",
                )
            self.load_lora(name, path)
        return name

    def lora_adapters(self) -> dict[str, str]:
        """The loaded LoRA adapters: {name: path}."""
        if self.lora is None:
            return {}
        return {a.name: a.path for a in self.lora.adapters if a is not None}

    def load_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter at `path` as `name`; ValueError naming what is wrong with it
        (or that --max-loras adapters are loaded); the engine serves on either way."""
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters: start it with --enable-lora")
        adapter = self.lora.load(name, path)
        if self.ranks is not None:  # the other pipeline stages load their layers' part
            self.ranks.broadcast(("lora", "load", name, path))
        log.info(
            "LoRA adapter %r loaded from %s: rank %d, scale %g, %s",
            name,
            path,
            adapter.rank,
            adapter.scaling,
            ", ".join(adapter.target_modules),
        )

    def unload_lora(self, name: str) -> None:
        """Unload adapter `name`. Refused (ValueError) while a request runs with it: unloading
        waits for no one, the caller retries once those requests are done."""
        if self.lora is None or self.lora.get(name) is None:
            loaded = self.lora.names() if self.lora is not None else []
            raise KeyError(f"LoRA adapter {name!r} is not loaded (loaded: {loaded or 'none'})")
        users = sum(s.lora_name == name for s in self.processor.requests.values())
        if users:
            raise ValueError(
                f"LoRA adapter {name!r} is in use by {users} request(s): unload it once they "
                "have finished"
            )
        self.lora.unload(name)
        if self.ranks is not None:
            self.ranks.broadcast(("lora", "unload", name))
        log.info("LoRA adapter %r unloaded", name)

    def abort_request(self, request_id: str) -> None:
        state = self.processor.requests.get(request_id)
        if state is None:
            return
        if state.beam is not None:
            self.beams.drop(state, self.scheduler)
        else:
            for s in state.samples:
                if not s.out.finished:
                    self.scheduler.abort_sequence(s.seq_id)
        self.processor.abort(state)
        self._pending.append(self._emit(state))

    def reset(self) -> None:
        """Drop every request at once, after a crash of the loop driving this core: a fresh
        scheduler (every KV block free, the prefix cache empty), no per-sequence runner state.
        The model and the KV tensors stay; nothing is reloaded."""
        self.scheduler = self._new_scheduler()
        self._planned = None
        self.runner.forget_sequences()
        if self.drafter is not None:
            self.drafter.forget_sequences()
        self.grammar.clear()
        self.processor.clear()
        self.beams.clear()
        self._pending.clear()

    def has_unfinished_requests(self) -> bool:
        return bool(self.processor.requests) or bool(self._pending)

    # ---- one step ----
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update; the outputs of every request that changed."""
        outputs, self._pending = self._pending, []
        self.last_step_tokens = 0
        planned, self._planned = self._planned, None
        if not self.scheduler.has_unfinished_requests():
            if planned is not None:  # every sequence of it has finished
                self.scheduler.settle(planned[0])
            return outputs
        sched, batch = self._next_step(planned)
        self.last_step_tokens = sched.num_batched_tokens
        self._fail_scheduler_rejects()
        self._mark_scheduled(sched)
        sample_ids = [c.seq.seq_id for c in sched.chunks if c.sample]
        grammar = self.grammar.start_bitmask(sample_ids)
        t_step = time.perf_counter()
        if self._forward_pool is not None and sched.chunks:
            step = self._execute_overlapped(sched, grammar, batch)
        else:
            step = self._execute(sched, grammar, batch)
        if self.drafter is not None:
            self.drafter.observe(sched, time.perf_counter() - t_step, step.sampled)
        for seq_id, plp in step.prompt_logprobs.items():
            self.processor.record_prompt_logprobs(seq_id, plp)
        touched = self._update(sched, step.sampled)
        for state in touched.values():
            if state.request_id in self.processor.requests:
                outputs.append(self._emit(state))
        outputs.extend(self._pending)
        self._pending = []
        self._propose_drafts(sched)
        return outputs

    def _next_step(self, planned) -> tuple[SchedulerOutput, StepBatch | None]:
        """This step: the one planned while the last ran, settled (with its flat batch when no
        chunk was dropped or added), or one scheduled now."""
        if planned is None:
            return self.scheduler.schedule(), None
        plan, batch = planned
        sched = self.scheduler.settle(plan)
        if not sched.chunks:
            return self.scheduler.schedule(), None
        if batch is None or len(sched.chunks) != len(plan.chunks):
            return sched, None
        if any(a is not b for a, b in zip(sched.chunks, plan.chunks)):
            return sched, None
        batch.out = sched
        self.runner.fill_placeholders(batch)
        return sched, batch

    def _execute_overlapped(self, sched: SchedulerOutput, grammar, batch) -> StepOutput:
        """The step here while the worker thread plans the next one (unless a beam search
        runs); a step that raises is isolated, as `_execute` does, once the plan is done."""
        if batch is None:
            try:
                batch = self.runner.batch(sched)
            except Exception:  # flattened again there, where the chunks responsible fail alone
                return self._execute(sched, grammar)
        planning = None
        if not self.beams.by_seq:
            planning = self._forward_pool.submit(self._plan_next, sched)
        try:
            step = self.runner.execute(sched, grammar, batch)
        except RankLost:
            raise
        except Exception as e:
            log.error(
                "model step of %d chunks failed; isolating the request(s) responsible:\n%s",
                len(sched.chunks),
                traceback.format_exc(),
            )
            if planning is not None:
                planning.result()  # it writes the runner's block-table rows, as isolating does
                planning = None
            step = self._isolate(sched.chunks, sched.copy_blocks, e, grammar)
        finally:
            if planning is not None:
                concurrent.futures.wait([planning])
        if planning is not None:
            planning.result()  # a planning error is raised here
        return step

    def _plan_next(self, sched: SchedulerOutput) -> None:
        """On the worker thread while `sched` runs: the next step scheduled with placeholders
        and flattened (`_planned`)."""
        plan = self.scheduler.schedule(sched)
        flat = None
        if plan.chunks:
            try:
                flat = self.runner.batch(plan)
            except Exception:  # flattened again when it runs, where a failure is isolated
                flat = None
        self._planned = (plan, flat)

    def _mark_scheduled(self, sched: SchedulerOutput) -> None:
        now = time.monotonic()
        for c in sched.chunks:
            if c.seq.output_token_ids:  # it generated before: its request was scheduled then
                continue
            state = self._request_of(c.seq.seq_id)
            if state is not None and state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now

    def _update(
        self, sched: SchedulerOutput, sampled: dict[str, list[SampledToken]]
    ) -> dict[str, RequestState]:
        """The scheduler takes the sampled tokens (its stop checks may cut them); the outputs
        take the tokens it kept; finished sequences finish their samples."""
        ours: dict[str, list[int]] = {}
        mine = []  # (sequence id, its tokens, its sample entry, its output tokens before)
        sample_of = self.processor.sample_of
        for seq_id, toks in sampled.items():
            entry = sample_of(seq_id)
            if entry is not None:
                mine.append((seq_id, toks, entry, len(entry[1].seq.output_token_ids)))
            elif seq_id not in self.beams:
                continue
            ours[seq_id] = [t.token_id for t in toks]
        finished = self.scheduler.update_from_output(sched, ours)
        self._fail_scheduler_rejects()
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        if self.beams.by_seq:  # beam searches running
            for s in self.beams.advance(
                sampled, self.scheduler, self.processor, self._forget_sequence, now
            ):
                touched[s.request_id] = s
        append_token, constrained = self.processor.append_token, self.grammar.constrained
        for seq_id, toks, entry, before in mine:
            if sample_of(seq_id) is not entry:  # failed (and emitted) since
                continue
            state, sample = entry
            kept = len(sample.seq.output_token_ids) - before
            for tok in toks[:kept]:
                if append_token(state, sample, tok, now):
                    self.scheduler.finish_sequence(seq_id, SequenceStatus.FINISHED_STOPPED)
                    self._forget_sequence(seq_id)
                if constrained(seq_id):
                    self._advance_grammar(state, sample, tok.token_id)
            touched[state.request_id] = state
        for seq in finished:
            entry = self.processor.sample_of(seq.seq_id)
            if entry is None:
                continue
            state, sample = entry
            if not sample.out.finished:
                self.processor.finish_sample(sample, seq)
                self._forget_sequence(seq.seq_id)
            touched[state.request_id] = state
        return touched

    def _emit(self, state: RequestState) -> RequestOutput:
        """The request's output; a finished one frees its sequences' state everywhere."""
        out = self.processor.emit(state)
        for seq_id in state.seq_ids if out.finished else ():
            self._forget_sequence(seq_id)
            self.grammar.remove(seq_id)
        return out

    def _request_of(self, seq_id: str) -> RequestState | None:
        """The user request a scheduler sequence (a sample or a beam) belongs to."""
        entry = self.processor.sample_of(seq_id)
        return entry[0] if entry is not None else self.beams.get(seq_id)

    def _forget_sequence(self, seq_id: str) -> None:
        """Per-sequence state outside the scheduler: the runner's generator, the drafter's."""
        self.runner.free_sequence(seq_id)
        if self.drafter is not None:
            self.drafter.free(seq_id)

    def _propose_drafts(self, sched: SchedulerOutput) -> None:
        """Drafts for every sequence that sampled this step and still runs (none under a
        grammar): a draft is only a guess, so a drafter that fails leaves none."""
        if self.drafter is None:
            return
        seqs = [
            c.seq
            for c in sched.chunks
            if c.sample
            and c.seq.status == SequenceStatus.RUNNING
            and c.seq.seq_id in self.processor.samples
            and not self.grammar.constrained(c.seq.seq_id)
        ]
        self.drafter.propose_for(seqs, sum(1 for c in sched.chunks if c.sample))

    # ---- fault isolation ----
    def _advance_grammar(self, state: RequestState, sample: SampleState, token_id: int) -> None:
        """Advance the sample's matcher; a complete grammar stops the sample (even with
        ignore_eos), a token the grammar refuses fails the request."""
        terminated, error = self.grammar.accept(sample.seq_id, token_id)
        if error is not None:  # the request's own constraint: a warning, not ours
            log.warning("request %s: %s", state.request_id, error)
            self._fail_sequence(sample.seq_id, CONSTRAINT_FAILED + error)
        elif terminated and not sample.out.finished:
            self.scheduler.finish_sequence(sample.seq_id, SequenceStatus.FINISHED_STOPPED)
            self.processor.finish_sample(sample, sample.seq, reason="stop")
            self._forget_sequence(sample.seq_id)

    def _execute(self, sched: SchedulerOutput, grammar=None, batch=None) -> StepOutput:
        """The runner's step; if it raises, the chunks responsible fail alone."""
        try:
            if batch is None:
                return self.runner.execute(sched, grammar)
            return self.runner.execute(sched, grammar, batch)
        except RankLost:
            raise  # no step can run: not a request's fault
        except Exception as e:
            log.error(
                "model step of %d chunks failed; isolating the request(s) responsible:\n%s",
                len(sched.chunks),
                traceback.format_exc(),
            )
            return self._isolate(sched.chunks, sched.copy_blocks, e, grammar)

    def _isolate(self, chunks, copy_blocks, err: Exception, grammar=None) -> StepOutput:
        """Bisect: run each half of `chunks` alone; a single chunk that raises fails its request."""
        if len(chunks) == 1:
            self._fail_sequence(chunks[0].seq.seq_id, f"{type(err).__name__}: {err}")
            return StepOutput()
        sampled = StepOutput()
        mid = len(chunks) // 2
        for half in (chunks[:mid], chunks[mid:]):
            part = SchedulerOutput(half, copy_blocks, [], sum(len(c.token_ids) for c in half))
            try:  # copy-on-write copies are idempotent
                sampled.update(self.runner.execute(part, grammar))
            except Exception as e:
                sampled.update(self._isolate(half, copy_blocks, e, grammar))
        return sampled

    def _fail_scheduler_rejects(self) -> None:
        for seq_id, cause in self.scheduler.pop_failed():
            log.error("request %s failed while being scheduled: %s", seq_id, cause)
            self._fail_sequence(seq_id, cause)

    def _fail_sequence(self, seq_id: str, cause: str) -> None:
        """Fail the user request that `seq_id` belongs to (all its samples), with `cause`."""
        state = self._request_of(seq_id)
        if state is not None:
            state.error = cause
            self.abort_request(state.request_id)

    # ---- numbers for /metrics and the bench ----
    def stats(self) -> dict:
        return {
            **self.scheduler.metrics(),
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "structured_mask_seconds": self.grammar.mask_seconds,
            "structured_masks": self.grammar.masks_filled,
            **(self.drafter.metrics() if self.drafter is not None else {}),
        }
