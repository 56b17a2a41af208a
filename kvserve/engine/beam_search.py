"""Beam search in the engine: one request's beams as scheduler sequences that share KV blocks.

A request with SamplingParams.use_beam_search runs `best_of` (default n) beams in step. Each beam
is a sequence in the scheduler, decoded like any other, that returns its top K tokens with their
logprobs (Sequence.beam_candidates, K from kvserve.core.beam.BeamSearch). Once every running beam
of the request has returned its candidates for this round, BeamSearch picks the next beams as
(parent, token) pairs, and:

  - a parent's first child continues the parent's sequence: the parent's last token (sampled,
    not yet computed, so not in the KV cache) becomes the chosen one;
  - each further child is a new sequence whose prompt is the parent's tokens and the chosen
    token, forked from the parent (`fork_of`): it references every block of the parent by
    refcount, and the partial block it writes first is copied (copy-on-write);
  - a parent with no child is aborted: its blocks go back to the pool, except those its
    children still share.

A beam that returned its candidates before the others of its request is held (Sequence.held: the
scheduler skips it) so that the beams stay in step. When the search is done, the best n
hypotheses become the request's n completions (an end-of-sequence token that ended one stays its
last token, as in transformers); every beam sequence is aborted.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from kvserve.core.beam import BeamSearch, Hypothesis
from kvserve.core.sequence import Sequence
from kvserve.sampling_params import SamplingParams


class BeamRun:
    """The beams of one request and their sequences, in the order of BeamSearch.running."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: set[int],
        max_tokens: int,
        new_sequence: Callable[..., Sequence],
    ):
        """`new_request(seq_id, prompt_token_ids, params, max_tokens, fork_of)` builds a scheduler
        Sequence with the user request's arrival time, priority and cache salt."""
        eos = set() if params.ignore_eos else set(eos_token_ids) | set(params.stop_token_ids)
        self.search = BeamSearch(
            width=params.beam_width,
            max_tokens=max_tokens,
            eos_token_ids=frozenset(eos),
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
        )
        self.request_id = request_id
        self.prompt_len = len(prompt_token_ids)
        self.max_tokens = max_tokens
        # Each beam decodes greedily; only its candidates matter. No stop: BeamSearch decides.
        self.seq_params = SamplingParams(
            n=1,
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            skip_special_tokens=params.skip_special_tokens,
        )
        self._new_sequence = new_sequence
        self._ids = itertools.count()
        self.seqs: list[Sequence] = [self._sequence(list(prompt_token_ids), None)]
        self._reported: dict[str, list[tuple[int, float]]] = {}

    def _sequence(self, tokens: list[int], fork_of: str | None) -> Sequence:
        generated = len(tokens) - self.prompt_len
        req = self._new_sequence(
            f"{self.request_id}#beam{next(self._ids)}",
            tokens,
            self.seq_params,
            self.max_tokens - generated,
            fork_of,
        )
        req.beam_candidates = self.search.candidates_per_beam
        return req

    def report(self, req: Sequence, top: list[tuple[int, float]]) -> bool:
        """Beam `req` returned its candidates for this round; it waits (held) for the others.
        True once every running beam has reported."""
        self._reported[req.seq_id] = top
        req.held = True
        return len(self._reported) == len(self.seqs)

    def advance(self) -> tuple[list[Sequence], list[Sequence]]:
        """Run BeamSearch on this round's candidates. Returns (new sequences to add to the
        scheduler, sequences to abort); `seqs` becomes the next round's beams (none when done)."""
        step = self.search.advance([self._reported[s.seq_id] for s in self.seqs])
        self._reported.clear()
        old = self.seqs
        if self.search.done:
            self.seqs = []
            return [], old
        first: dict[int, int] = {}  # parent index -> the token its continuing child takes
        nxt, added = [], []
        for parent_idx, token in zip(step.parents, step.tokens):
            parent = old[parent_idx]
            if parent_idx not in first:
                first[parent_idx] = token
                nxt.append(parent)
            else:
                child = self._sequence(parent.all_token_ids[:-1] + [token], parent.seq_id)
                added.append(child)
                nxt.append(child)
        for parent_idx, token in first.items():
            old[parent_idx].replace_last_output_token(token)
            old[parent_idx].held = False
        self.seqs = nxt
        return added, [s for i, s in enumerate(old) if i not in first]

    def results(self, n: int) -> list[Hypothesis]:
        return self.search.results(n)
