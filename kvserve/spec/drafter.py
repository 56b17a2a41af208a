"""The engine's side of speculative decoding: drafts per request, acceptance per request, counters.

After each step the engine asks `Drafter.propose(request)` for the drafts of every request that
just sampled and still runs; the scheduler feeds them with the request's last token next step
(kvserve/core/scheduler.py), the runner verifies them (kvserve/spec/rejection.py), and the
engine reports the outcome with `record` and the duration of every decode-only step with
`observe_step`. The draft length adapts per request to its acceptance and to what a token row
costs on this machine (kvserve/spec/adaptive.py, kvserve/spec/step_cost.py), and never exceeds
the tokens the request may still generate.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.config import SpeculativeConfig
from kvserve.core.request import Request
from kvserve.spec.adaptive import AdaptiveDraftLength
from kvserve.spec.ngram import NgramProposer
from kvserve.spec.step_cost import StepCostModel


@dataclass
class SpecDecodeStats:
    """Monotone counters, named after vLLM's spec_decode metrics."""
    num_drafts: int = 0                # verifications of at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)   # [j]: drafts accepted at position j
    draft_seconds: float = 0.0         # proposing drafts
    verify_seconds: float = 0.0        # model steps that verified drafts


class Drafter:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self._lengths: dict[str, AdaptiveDraftLength] = {}
        self.step_cost = StepCostModel()
        self.stats = SpecDecodeStats(accepted_per_position=[0] * config.num_speculative_tokens)

    def observe_step(self, rows: int, seconds: float, verified: bool) -> None:
        """A decode-only step (no prompt token) of `rows` token rows, drafts included, took
        `seconds`; verified: some of its rows were drafts."""
        self.step_cost.observe(rows, seconds)
        if verified:
            self.stats.verify_seconds += seconds

    def propose(self, req: Request, batch_rows: int = 1) -> list[int]:
        """Draft tokens to verify after the request's last token (possibly none); batch_rows: the
        decoding requests of the step, each one row without drafts (the price of a draft row)."""
        room = req.max_tokens - req.num_output_tokens - 1   # the step emits the drafts accepted + 1 token
        if room <= 0:
            return []
        length = self._lengths.get(req.request_id)
        if length is None:
            length = self._lengths[req.request_id] = AdaptiveDraftLength(self.config.num_speculative_tokens)
        k = min(length.next_length(self.step_cost.row_share(batch_rows)), room)
        return self.proposer.propose(req.request_id, req.all_token_ids, k) if k > 0 else []

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """One verification's outcome: `num_accepted` of `num_drafts` draft tokens were accepted."""
        if num_drafts <= 0:
            return
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            s.accepted_per_position[j] += 1
        length = self._lengths.get(request_id)
        if length is not None:
            length.record(num_drafts, num_accepted)

    def free(self, request_id: str) -> None:
        self._lengths.pop(request_id, None)
        self.proposer.free(request_id)

    def forget_requests(self) -> None:
        """Drop every request's state (the engine reset); the counters stay monotone."""
        self._lengths.clear()
        self.proposer = NgramProposer(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
