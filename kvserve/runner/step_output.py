"""What a step gives the engine: the sampled tokens and the prompt logprobs of each sequence
(ModelRunner.execute), and how prompt-logprob rows are found in the flat batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.core.scheduler import SchedulerOutput
from kvserve.runner.sampler import TokenLogprobs, token_logprobs


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
    # by sequence id: one token, or with drafts the accepted ones then one more
    sampled: dict[str, list[SampledToken]] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)

    def update(self, other: StepOutput) -> None:
        self.sampled.update(other.sampled)
        self.prompt_logprobs.update(other.prompt_logprobs)


def prompt_logprob_spans(out: SchedulerOutput, query_start_loc: list[int]) -> list[tuple]:
    """(chunk, first flat row, rows, first target position) for each chunk that computes prompt
    positions whose next token is a prompt token, of a sequence with prompt_logprobs."""
    spans = []
    for i, c in enumerate(out.chunks):
        seq = c.seq
        if seq.sampling_params.prompt_logprobs is None:
            continue
        end = min(c.start_pos + len(c.token_ids), seq.num_prompt_tokens - 1)
        if end > c.start_pos:
            spans.append((c, query_start_loc[i], end - c.start_pos, c.start_pos + 1))
    return spans


def prompt_logprobs(spans: list[tuple], logits: torch.Tensor) -> dict[str, PromptLogprobs]:
    result, row = {}, 0
    for c, _, n, start in spans:
        seq = c.seq
        targets = seq.prompt_token_ids[start : start + n]
        result[seq.seq_id] = PromptLogprobs(
            start,
            token_logprobs(logits[row : row + n], targets, seq.sampling_params.prompt_logprobs),
        )
        row += n
    return result
