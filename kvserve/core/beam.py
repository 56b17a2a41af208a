"""Beam search bookkeeping for one request: which beams live on, which have finished.

The rules are Hugging Face transformers' (GenerationMixin._beam_search), so that the same
logprobs give the same beams and the same scores:

    each step, every running beam b (cumulative logprob s_b) offers its top K tokens t with
    logprob l; K = max(2, 1 + #eos) * width candidates with the highest s_b + l are kept (best
    first).
    A candidate "hits a stop" when t is an end-of-sequence token or the beam reaches max_tokens.
    Running beams next step:  the `width` best candidates, those that hit a stop ranked last.
    Finished hypotheses:      candidates among the first `width` that hit a stop, scored
                              (s_b + l) / generated_len ** length_penalty, merged with the
                              hypotheses kept so far; the best `width` stay.
    Stop when no running beam can beat the worst kept hypothesis (all `width` slots filled and
    the best running score / current_len ** length_penalty is not above it), when early_stopping
    is True and every slot is filled, or when every candidate hit a stop.

A running beam is the token list it generated and its cumulative logprob; the engine owns the
sequences (KV blocks) behind them and maps each next-step beam to its parent (`Step.parents`), so
children of one parent share the parent's blocks. Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_NEG = -1.0e9  # transformers' "never choose this" score


@dataclass
class Beam:
    tokens: list[int]  # generated tokens (not the prompt)
    logprob: float  # cumulative logprob of `tokens`


@dataclass
class Hypothesis:
    tokens: list[int]
    logprob: float  # cumulative logprob
    score: float  # logprob / len(tokens) ** length_penalty
    finish_reason: str  # "stop" (an end-of-sequence token, kept as the last token) or "length"


@dataclass
class Step:
    """What one call of BeamSearch.advance decided: running beam i of the next step continues
    running beam `parents[i]` of this step with token `tokens[i]`."""

    parents: list[int]
    tokens: list[int]


@dataclass
class BeamSearch:
    width: int
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True | False | "never", as transformers
    running: list[Beam] = field(default_factory=list)
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most `width`
    done: bool = False
    _improvable: bool = True

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"beam width must be at least 1, got {self.width}")
        if self.max_tokens < 1:
            raise ValueError(
                f"max_tokens must be at least 1 for beam search, got {self.max_tokens}"
            )
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f'early_stopping must be true, false or "never", got {self.early_stopping!r}'
            )
        self.eos_token_ids = frozenset(self.eos_token_ids)
        if not self.running:
            self.running = [
                Beam([], 0.0)
            ]  # transformers' width copies of the prompt, all but one at -1e9

    @property
    def candidates_per_beam(self) -> int:
        """How many top tokens (with logprobs) each running beam must offer per step."""
        return max(2, 1 + len(self.eos_token_ids)) * self.width

    def advance(self, top: list[list[tuple[int, float]]]) -> Step:
        """top[b]: running beam b's best (token, logprob) pairs, at least `candidates_per_beam`
        of them (fewer only when the vocabulary is smaller). Returns the next running beams'
        parents and tokens; sets `done` when the search is over."""
        if self.done:
            raise RuntimeError("beam search is already done")
        if len(top) != len(self.running):
            raise ValueError(f"{len(top)} candidate lists for {len(self.running)} running beams")
        keep = self.candidates_per_beam
        pool = [
            (beam.logprob + lp, b, tok) for b, beam in enumerate(self.running) for tok, lp in top[b]
        ]
        # Best first; among equal scores the lower flat index (beam, then token order) first,
        # as topk.
        pool = sorted(enumerate(pool), key=lambda x: (-x[1][0], x[0]))[:keep]
        cands = [c for _, c in pool]
        gen_len = len(self.running[0].tokens) + 1  # every running beam has the same length
        hits = [tok in self.eos_token_ids or gen_len >= self.max_tokens for _, _, tok in cands]

        # Finished hypotheses: only stops among the first `width` candidates count.
        new_hyps = []
        if (
            not (self.early_stopping is True and len(self.finished) == self.width)
            and self._improvable
        ):
            for i, (acc, b, tok) in enumerate(cands[: self.width]):
                if hits[i]:
                    reason = "stop" if tok in self.eos_token_ids else "length"
                    new_hyps.append(
                        Hypothesis(
                            self.running[b].tokens + [tok],
                            acc,
                            acc / gen_len**self.length_penalty,
                            reason,
                        )
                    )
        if new_hyps:
            merged = sorted(self.finished + new_hyps, key=lambda h: -h.score)
            self.finished = merged[: self.width]

        # Next running beams: the best `width`, stops pushed to the back (as transformers' -1e9).
        ranked = sorted(
            range(len(cands)), key=lambda i: (-(cands[i][0] + (_NEG if hits[i] else 0.0)), i)
        )
        chosen = ranked[: self.width]
        step = Step([cands[i][1] for i in chosen], [cands[i][2] for i in chosen])
        self.running = [
            Beam(
                self.running[cands[i][1]].tokens + [cands[i][2]],
                cands[i][0] + (_NEG if hits[i] else 0.0),
            )
            for i in chosen
        ]

        # Can a running beam still beat the worst kept hypothesis?
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_tokens
        else:
            best_len = gen_len
        best_running = self.running[0].logprob / best_len**self.length_penalty
        if len(self.finished) == self.width:
            self._improvable = self._improvable and best_running > self.finished[-1].score
        self.done = (
            not self._improvable
            or (len(self.finished) == self.width and self.early_stopping is True)
            or all(hits)
        )
        return step

    def results(self, n: int | None = None) -> list[Hypothesis]:
        """The best `n` (default: width) finished hypotheses, best first."""
        if not self.done:
            raise RuntimeError("beam search is not done yet")
        return self.finished[: self.width if n is None else n]
