"""What the user sees of a request: its sequences' tokens turned into RequestOutputs.

A user request (RequestState) has n samples (SampleState), each the output of one scheduler
sequence. This module owns detokenizing, stop strings, logprobs (generated and prompt), timings
and the snapshots handed to the caller: only what changed since the last snapshot goes out as
the delta. It never touches the scheduler or the runner: where a stop string ends a sample, it
says so and the engine finishes the sequence.

Deferred text (`defer_text`, set by the server's AsyncEngine): a sample without stop strings
needs its text for nothing the engine decides, so its tokens are not detokenized on the
engine's thread. Its snapshots leave the processor with their token deltas only and are queued
in `deferred`; `fill_deferred_text` runs the sample's detokenizer over them on another thread
(the event loop, in step order), token by token as here, so the text is the same. Samples with
stop strings, and beam search, detokenize here: a stop string must end the sequence at once.

Delta snapshots (`delta_snapshots`, set by the server's AsyncEngine and by LLM.generate while
it runs, which read deltas and whole lists only from the final output): an unfinished sample's
snapshot carries the step's token ids and logprobs as its `token_ids` and `logprobs` instead of
copies of the whole lists, so a snapshot costs the same at the 10,000th token as at the first.
The final snapshot is whole.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from kvserve.core.sequence import Sequence
from kvserve.engine.beam_search import BeamRun
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvserve.runner.model_runner import PromptLogprobs, SampledToken
from kvserve.runner.sampler import TokenLogprobs
from kvserve.sampling_params import SamplingParams

log = logging.getLogger("kvserve")


@dataclass
class SampleState:
    """One of a request's n outputs and the scheduler sequence that produces it."""

    seq_id: str
    index: int
    seq: Sequence
    detok: IncrementalDetokenizer
    out: CompletionOutput
    changed: bool = False
    deferred: bool = False  # its text is filled off the engine thread (fill_deferred_text)


@dataclass
class RequestState:
    """A user request: its prompt, its n samples, its timings, its prompt logprobs."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    samples: list[SampleState] = field(default_factory=list)
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[Logprob | None] | None = None  # by prompt position; [0] stays None
    prompt_logprobs_missing: int = 0  # positions still to come
    beam: BeamRun | None = None  # beam search: its beams (the samples fill at the end)
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)

    @property
    def finished(self) -> bool:
        for s in self.samples:  # a loop, not all(): read for every request at every step
            if not s.out.finished:
                return False
        return True

    @property
    def seq_ids(self) -> list[str]:
        """The scheduler sequences its samples are: none under beam search (the samples are
        outputs only; the beams are `beam.seqs`)."""
        return [s.seq_id for s in self.samples] if self.beam is None else []


class OutputProcessor:
    """Every unfinished request's state, by request id and by sequence id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.samples: dict[str, tuple[RequestState, SampleState]] = {}  # by sequence id
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # Detokenize samples without stop strings elsewhere (see the module's docstring).
        self.defer_text = False
        # Unfinished samples' snapshots carry only the step's lists (see the module's docstring).
        self.delta_snapshots = False
        # (request id, snapshot, detokenizer) of deferred samples' snapshots, in emit order.
        self.deferred: list[tuple[str, CompletionOutput, IncrementalDetokenizer]] = []

    def add(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        arrival: float,
        seqs: list[Sequence],
        beam: BeamRun | None = None,
    ) -> RequestState:
        """Track a request whose sequences (or first beam) the scheduler just took."""
        state = RequestState(request_id, list(prompt), params, RequestMetrics(arrival), beam=beam)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(prompt)
            state.prompt_logprobs_missing = len(prompt) - 1
        for i in range(params.n):
            seq = seqs[0] if beam is not None else seqs[i]
            seq_id = f"{request_id}#{i}" if beam is not None else seq.seq_id
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt, seq.sampling_params if beam is None else params
            )
            logprobs = [] if params.logprobs is not None and beam is None else None
            sample = SampleState(
                seq_id, i, seq, detok, CompletionOutput(index=i, logprobs=logprobs)
            )
            sample.deferred = self.defer_text and beam is None and not detok.stop
            state.samples.append(sample)
            if beam is None:
                self.samples[seq_id] = (state, sample)
        self.requests[request_id] = state
        self.prompt_tokens_total += len(prompt)
        return state

    def sample_of(self, seq_id: str) -> tuple[RequestState, SampleState] | None:
        return self.samples.get(seq_id)

    def record_prompt_logprobs(self, seq_id: str, plp: PromptLogprobs) -> None:
        """Keep the first value of each position (a preempted sequence computes them again)."""
        entry = self.samples.get(seq_id)
        if entry is None:
            return
        state = entry[0]
        for pos, lp in enumerate(plp.entries, plp.start):
            if state.prompt_logprobs[pos] is None:
                state.prompt_logprobs[pos] = self.to_logprob(lp)
                state.prompt_logprobs_missing -= 1

    def first_token(self, state: RequestState, now: float, cached: int | None = None) -> None:
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
            if cached is not None:
                state.num_cached_tokens = cached
        state.metrics.last_token_time = now

    def append_token(
        self, state: RequestState, sample: SampleState, tok: SampledToken, now: float
    ) -> bool:
        """Add one generated token; True when a stop string ended the sample with it."""
        out = sample.out
        if out.finished:
            return False
        out.token_ids.append(tok.token_id)
        out.delta_token_ids.append(tok.token_id)
        self.generation_tokens_total += 1
        metrics = state.metrics
        if metrics.first_token_time is None:
            self.first_token(state, now, sample.seq.num_cached_tokens)
        else:
            metrics.last_token_time = now
        if len(out.token_ids) > metrics.num_generation_tokens:
            metrics.num_generation_tokens = len(out.token_ids)
        if tok.logprobs is not None and out.logprobs is not None:
            lp = self.to_logprob(tok.logprobs)
            out.logprobs.append(lp)
            out.delta_logprobs = (out.delta_logprobs or []) + [lp]
            out.cumulative_logprob = (out.cumulative_logprob or 0.0) + lp.logprob
        sample.changed = True
        if sample.deferred:
            return False
        delta, stopped = sample.detok.add_tokens([tok.token_id])
        out.text += delta
        out.delta_text += delta
        if stopped:
            out.finish_reason = "stop"
            out.stop_reason = getattr(sample.detok, "stop_reason", None)
        return stopped

    def finish_sample(self, sample: SampleState, seq: Sequence, reason: str | None = None) -> None:
        """The sequence finished (a stop token, length, a grammar's end): flush held text."""
        tail = "" if sample.deferred else sample.detok.flush()
        sample.out.text += tail
        sample.out.delta_text += tail
        sample.out.finish_reason = reason or seq.finish_reason
        stops = seq.sampling_params.stop_token_ids
        if (
            sample.out.finish_reason == "stop"
            and seq.output_token_ids
            and seq.output_token_ids[-1] in stops
        ):
            sample.out.stop_reason = seq.output_token_ids[-1]
        sample.changed = True

    def finish_beams(self, state: RequestState) -> None:
        """The search's best n hypotheses become the request's completions."""
        for sample, hyp in zip(state.samples, state.beam.results(state.params.n)):
            out = sample.out
            out.token_ids = list(hyp.tokens)
            out.delta_token_ids = list(hyp.tokens)
            delta, _ = sample.detok.add_tokens(hyp.tokens)
            out.text = out.delta_text = delta + sample.detok.flush()
            out.cumulative_logprob = hyp.logprob
            out.finish_reason = hyp.finish_reason
            last_is_stop = hyp.tokens and hyp.tokens[-1] in state.params.stop_token_ids
            if hyp.finish_reason == "stop" and last_is_stop:
                out.stop_reason = hyp.tokens[-1]
            sample.changed = True
            self.generation_tokens_total += len(hyp.tokens)
            metrics = state.metrics
            metrics.num_generation_tokens = max(metrics.num_generation_tokens, len(hyp.tokens))

    def abort(self, state: RequestState) -> None:
        """Every unfinished sample ends with finish_reason "abort"."""
        for s in state.samples:
            if not s.out.finished:
                s.out.finish_reason = "abort"
                s.changed = True

    def to_logprob(self, lp: TokenLogprobs) -> Logprob:
        dec = self.tokenizer.decode
        return Logprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            rank=lp.rank,
            token=dec([lp.token_id], skip_special_tokens=False),
            top=[(t, dec([t], skip_special_tokens=False), v) for t, v in lp.top],
        )

    def emit(self, state: RequestState) -> RequestOutput:
        """Snapshot the samples that changed; a finished request is forgotten here (the engine
        frees its sequences' state when the output says finished)."""
        changed = []
        for s in state.samples:
            if s.changed:
                snap = self._snapshot(s)
                changed.append(snap)
                if s.deferred:
                    self.deferred.append((state.request_id, snap, s.detok))
        finished = state.finished
        if finished:
            state.metrics.finished_time = time.monotonic()
            self.requests.pop(state.request_id, None)
            for seq_id in state.seq_ids:
                self.samples.pop(seq_id, None)
        complete = state.prompt_logprobs is not None and state.prompt_logprobs_missing == 0
        # Fields by position (RequestOutput's order): every request at every step makes one, and
        # keywords cost twice as much.
        return RequestOutput(
            state.request_id,
            state.prompt_token_ids,
            changed,
            finished,
            state.num_cached_tokens,
            state.metrics,
            None,  # prompt: the caller's text, which the engine does not have
            state.error,
            state.prompt_logprobs if complete else None,
        )

    def _snapshot(self, sample: SampleState) -> CompletionOutput:
        o = sample.out
        whole = not self.delta_snapshots or o.finished
        lps = o.logprobs
        if lps is not None:
            lps = list(lps) if whole else o.delta_logprobs
        snap = CompletionOutput(  # by position (CompletionOutput's order), as RequestOutput's
            o.index,
            o.text,
            list(o.token_ids) if whole else o.delta_token_ids,
            o.delta_text,
            o.delta_token_ids,
            lps,
            o.delta_logprobs,
            o.cumulative_logprob,
            o.finish_reason,
            o.stop_reason,
        )
        o.delta_text, o.delta_token_ids, o.delta_logprobs = "", [], None
        sample.changed = False
        return snap

    def take_deferred(self) -> list[tuple[str, CompletionOutput, IncrementalDetokenizer]]:
        """The deferred snapshots emitted since the last call, for fill_deferred_text."""
        items, self.deferred = self.deferred, []
        return items

    def clear(self) -> None:
        self.requests.clear()
        self.samples.clear()
        self.deferred.clear()


def fill_deferred_text(
    items: list[tuple[str, CompletionOutput, IncrementalDetokenizer]],
) -> dict[str, Exception]:
    """Give deferred snapshots their text: each one's token delta through its sample's
    detokenizer, one token at a time as `append_token` does, then the flush if it finished.
    Call it on one thread, in emit order. Returns the requests whose detokenizing raised, with
    the exception (their snapshots must not reach a client)."""
    failed: dict[str, Exception] = {}
    for request_id, snap, detok in items:
        if request_id in failed:
            continue
        try:
            delta = ""
            for token_id in snap.delta_token_ids:
                delta += detok.add_tokens([token_id])[0]
            if snap.finish_reason is not None:
                delta += detok.flush()
            snap.delta_text = delta
            snap.text = detok.text
        except Exception as e:  # a tokenizer bug: this request fails alone
            log.exception("request %s: detokenizing failed", request_id)
            failed[request_id] = e
    return failed
