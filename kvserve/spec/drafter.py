"""The engine's side of speculative decoding: drafts per request, acceptance per request, counters.

After each step the engine asks `Drafter.propose_batch(requests)` for the drafts of every request
that just sampled and still runs (n-gram lookup, kvserve/spec/ngram.py, or a draft model,
kvserve/spec/draft_model.py); the scheduler feeds them with the request's last token next step
(kvserve/core/scheduler.py), the runner verifies them (kvserve/spec/rejection.py), and the
engine reports the outcome with `record` and the duration of every decode-only step with
`observe_step`. The draft length adapts per request to its acceptance and to what a token row
costs on this machine (kvserve/spec/adaptive.py, kvserve/spec/step_cost.py), and never exceeds
the tokens the request may still generate. A draft model must first feed the context it has not
seen (the prompt, on a request's first draft); that catch-up is made only when drafting at the
request's acceptance (or the prior's, if higher) saves more over the next CATCH_UP_HORIZON steps
than it costs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from kvserve.config import EngineConfig, ModelConfig, SpeculativeConfig
from kvserve.core.sequence import Sequence
from kvserve.model.early_exit import first_layers
from kvserve.model.loader import load_model
from kvserve.spec.adaptive import AdaptiveDraftLength
from kvserve.spec.draft_model import DraftModelProposer
from kvserve.spec.ngram import NgramProposer
from kvserve.spec.step_cost import StepCostModel

log = logging.getLogger("kvserve")
CATCH_UP_HORIZON = 64  # decode steps over which a draft model's catch-up must pay for itself


@dataclass
class SpecDecodeStats:
    """Monotone counters, named after vLLM's spec_decode metrics."""

    num_drafts: int = 0  # verifications of at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(
        default_factory=list
    )  # [j]: drafts accepted at position j
    draft_seconds: float = 0.0  # proposing drafts
    verify_seconds: float = 0.0  # model steps that verified drafts


class Drafter:
    def __init__(self, config: SpeculativeConfig, proposer=None) -> None:
        """`proposer`: NgramProposer (default) or DraftModelProposer (see `create`)."""
        self.config = config
        self.proposer = (
            proposer
            if proposer is not None
            else NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        )
        self._lengths: dict[str, AdaptiveDraftLength] = {}
        self.step_cost = StepCostModel()
        self.stats = SpecDecodeStats(accepted_per_position=[0] * config.num_speculative_tokens)

    @classmethod
    def create(
        cls, config: SpeculativeConfig, draft, engine_config: EngineConfig, num_blocks: int
    ) -> Drafter:
        """The drafter for `config.method`; `draft`: the draft model (load_draft; None for ngram),
        `num_blocks`: the blocks of its KV cache."""
        if draft is None:
            return cls(config)
        return cls(config, DraftModelProposer(draft, engine_config, num_blocks))

    def describe(self) -> str:
        """One line for the start-up banner."""
        if not isinstance(self.proposer, DraftModelProposer):
            return f"n-gram prompt lookup, up to {self.config.num_speculative_tokens} drafts"
        p = self.proposer
        what = (
            f"the model's first {p.arch.num_layers} layers"
            if self.config.method == "self_speculative"
            else f"draft model {self.config.model} ({p.arch.num_layers} layers)"
        )
        return (
            f"{what}, up to {self.config.num_speculative_tokens} greedy drafts, "
            f"its own KV cache {p.kv_cache_bytes / 2**20:.0f} MiB"
        )

    def observe_step(self, rows: int, seconds: float, verified: bool) -> None:
        """A decode-only step (no prompt token) of `rows` token rows, drafts included, took
        `seconds`; verified: some of its rows were drafts."""
        self.step_cost.observe(rows, seconds)
        if verified:
            self.stats.verify_seconds += seconds

    def token_price(self, batch_rows: int) -> float:
        """What one draft token costs, as a share of a step's throughput: its row in the
        verifying step, plus, for a draft model, its share of a drafting round."""
        share = self.step_cost.row_share(batch_rows)
        round_cost = getattr(self.proposer, "round_cost", None)
        if round_cost is not None:
            step, draft = self.step_cost.seconds(batch_rows), round_cost.seconds(batch_rows)
            if step and draft:
                share += draft / step
        return share

    def propose_batch(self, reqs: list[Sequence], batch_rows: int = 1) -> list[list[int]]:
        """Draft tokens to verify after each request's last token (possibly none); batch_rows: the
        decoding requests of the step, each one row without drafts (the price of a draft row)."""
        price = self.token_price(batch_rows)
        items = []
        for req in reqs:
            room = (
                req.max_tokens - req.num_output_tokens - 1
            )  # the step emits the drafts accepted + 1 token
            length = self._lengths.get(req.seq_id)
            if length is None:
                length = self._lengths[req.seq_id] = AdaptiveDraftLength(
                    self.config.num_speculative_tokens
                )
            k = min(length.next_length(price), room) if room > 0 else 0
            if k > 0 and not self._catch_up_pays(req, length, price, batch_rows, room):
                k = 0
            items.append((req, k))
        return self.proposer.propose_batch(items)

    def _catch_up_pays(
        self, req: Sequence, length: AdaptiveDraftLength, price: float, batch_rows: int, room: int
    ) -> bool:
        """Whether a draft model's catch-up for `req` (the context it has not fed yet: the whole
        prompt on a request's first draft, the tokens decoded since its last one) is worth its
        time: what it costs beyond the one-token feed of a request that drafts every step must
        be less than what drafting then saves over the next min(room, CATCH_UP_HORIZON) steps.
        Unknown costs (no feed or step timed yet) pay: the first feed measures them."""
        tokens_of = getattr(self.proposer, "catch_up_tokens", None)
        if tokens_of is None:
            return True
        tokens = tokens_of(req)
        if tokens <= 2:
            return True
        cost, base = self.proposer.catch_up_seconds(tokens), self.proposer.catch_up_seconds(1)
        step = self.step_cost.seconds(batch_rows)
        if cost is None or base is None or not step:
            return True
        return cost - base < step * length.gain_per_step(price) * min(room, CATCH_UP_HORIZON)

    def propose(self, req: Sequence, batch_rows: int = 1) -> list[int]:
        return self.propose_batch([req], batch_rows)[0]

    def record(self, seq_id: str, num_drafts: int, num_accepted: int) -> None:
        """One verification's outcome: `num_accepted` of `num_drafts` draft tokens were accepted."""
        if num_drafts <= 0:
            return
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            s.accepted_per_position[j] += 1
        length = self._lengths.get(seq_id)
        if length is not None:
            length.record(num_drafts, num_accepted)

    def observe(self, sched, seconds: float, sampled: dict) -> None:
        """After a step: count each verification's accepted drafts (the runner's answer, before
        any stop cut), and learn what a token row costs from steps of decodes only (each chunk
        its last token plus its drafts; a prompt chunk's rows take another kernel)."""
        for c in sched.chunks:
            toks = sampled.get(c.seq.seq_id)
            if c.draft_token_ids and toks:
                self.record(c.seq.seq_id, len(c.draft_token_ids), len(toks) - 1)
        if sched.chunks and all(
            len(c.token_ids) == 1 + len(c.draft_token_ids)
            and c.start_pos >= c.seq.num_prompt_tokens
            for c in sched.chunks
        ):
            verified = any(c.draft_token_ids for c in sched.chunks)
            self.observe_step(sched.num_batched_tokens, seconds, verified=verified)

    def propose_for(self, seqs: list[Sequence], batch_rows: int) -> None:
        """Put each sequence's drafts for its next step on it (`spec_token_ids`); a draft is only
        a guess, so where proposing fails these sequences decode without one."""
        t0 = time.perf_counter()
        if seqs:
            try:
                proposed = self.propose_batch(seqs, batch_rows)
            except Exception:
                log.exception(
                    "drafting failed for %d sequence(s); they decode without drafts this step",
                    len(seqs),
                )
                proposed = [[] for _ in seqs]
            for seq, drafts in zip(seqs, proposed):
                seq.spec_token_ids = drafts
        self.stats.draft_seconds += time.perf_counter() - t0

    def metrics(self) -> dict:
        """The counters under vLLM's spec_decode metric names."""
        s = self.stats
        return {
            "spec_decode_num_drafts": s.num_drafts,
            "spec_decode_num_draft_tokens": s.num_draft_tokens,
            "spec_decode_num_accepted_tokens": s.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(s.accepted_per_position),
            "spec_decode_draft_seconds": s.draft_seconds,
            "spec_decode_verify_seconds": s.verify_seconds,
        }

    def free(self, seq_id: str) -> None:
        self._lengths.pop(seq_id, None)
        self.proposer.free(seq_id)

    def forget_sequences(self) -> None:
        """Drop every request's state (the engine reset); the counters stay monotone."""
        self._lengths.clear()
        self.proposer.forget()


def load_draft(config: SpeculativeConfig, target, engine_config: EngineConfig):
    """The draft model of a model-drafting method (a LoadedModel), None for ngram: the target's
    first draft_layers layers (default: a third), or the model at config.model, which must share
    the target's tokenizer."""
    if config.method == "ngram":
        return None
    if config.method == "self_speculative":
        return first_layers(target, config.draft_layers or max(1, target.arch.num_layers // 3))
    draft = load_model(
        ModelConfig(
            model=config.model, dtype=engine_config.model.dtype, quantization=config.quantization
        )
    )
    check_same_vocabulary(target, draft)
    return draft


def check_same_vocabulary(target, draft) -> None:
    """A draft model must speak the target's tokens: same vocabulary size and the same ids for a
    probe text; ValueError says which differs."""
    if draft.arch.vocab_size != target.arch.vocab_size:
        raise ValueError(
            f"speculative_config.model {draft.path} has a vocabulary of {draft.arch.vocab_size} "
            f"tokens, the target {target.path} {target.arch.vocab_size}: a draft model must share "
            f"the target's tokenizer"
        )
    probe = (
        'Speculative decoding: the quick brown fox, 12345 {"json": [1, 2]}\n\tdef f(x): return x'
    )
    if draft.tokenizer.encode(probe) != target.tokenizer.encode(probe):
        raise ValueError(
            f"speculative_config.model {draft.path} tokenizes text differently from the target "
            f"{target.path}: a draft model must share the target's tokenizer"
        )
