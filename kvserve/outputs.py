"""What the engine hands back for a request: text, tokens, logprobs, timings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One position (generated, or a prompt token): its token and the top-N alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    token: str  # decoded text of token_id
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (token_id, text, logprob)


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        return (
            None
            if self.first_scheduled_time is None
            else self.first_scheduled_time - self.arrival_time
        )

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        if self.last_token_time is None or self.first_token_time is None:
            return None
        return self.last_token_time - self.first_token_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.num_generation_tokens < 2 or self.decode_time is None:
            return None
        return self.decode_time / (self.num_generation_tokens - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One of a request's n samples. `text`/`token_ids` hold everything so far; `delta_*` what
    this step added. Built by position every step (OutputProcessor._snapshot): new fields go
    last."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] | None = None
    delta_logprobs: list[Logprob] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: CompletionOutput) -> CompletionOutput:
        """This sample's output followed by `later`, its next one, as one output: both deltas,
        `later`'s state. Lists are new ones: an unfinished `later` adds its delta to this
        output's lists (whole lists, or a step's as the server's snapshots carry them); a
        finished one's are whole already."""
        lps = later.logprobs
        if not later.finished and self.logprobs is not None:
            lps = self.logprobs + (later.delta_logprobs or [])
        delta_lps = later.delta_logprobs
        if self.delta_logprobs is not None:
            delta_lps = self.delta_logprobs + (later.delta_logprobs or [])
        return CompletionOutput(
            index=later.index,
            text=later.text,
            token_ids=(
                later.token_ids if later.finished else self.token_ids + later.delta_token_ids
            ),
            delta_text=self.delta_text + later.delta_text,
            delta_token_ids=self.delta_token_ids + later.delta_token_ids,
            logprobs=lps,
            delta_logprobs=delta_lps,
            cumulative_logprob=later.cumulative_logprob,
            finish_reason=later.finish_reason,
            stop_reason=later.stop_reason,
        )


@dataclass
class RequestOutput:
    """A request's state after an engine step. `outputs` holds the samples that changed this step
    (all of them in the final output the offline API returns). Built by position every step
    (OutputProcessor.emit): new fields go last."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt: str | None = None
    error: str | None = None  # set when the request failed inside the engine
    # With SamplingParams.prompt_logprobs: one entry per prompt token (the first is None, nothing
    # predicts it), in every output once the whole prompt has been computed.
    prompt_logprobs: list[Logprob | None] | None = None

    def merge(self, later: RequestOutput) -> RequestOutput:
        """This output followed by `later`, the same request's next one, as one (a stream whose
        reader fell behind sends one chunk for both): each sample that changed in either, merged
        where both changed it, in index order; everything else is `later`'s."""
        samples = {o.index: o for o in self.outputs}
        for o in later.outputs:
            before = samples.get(o.index)
            samples[o.index] = o if before is None else before.merge(o)
        return RequestOutput(
            request_id=later.request_id,
            prompt_token_ids=later.prompt_token_ids,
            outputs=[samples[i] for i in sorted(samples)],
            finished=later.finished,
            num_cached_tokens=later.num_cached_tokens,
            metrics=later.metrics,
            prompt=later.prompt if later.prompt is not None else self.prompt,
            error=later.error,
            prompt_logprobs=(
                later.prompt_logprobs if later.prompt_logprobs is not None else self.prompt_logprobs
            ),
        )
