"""Prompt lookup (n-gram) drafts: continue the request's context the way it continued before.

The last n tokens of a request's context (prompt + outputs) are looked up in the context
itself, n from `max_n` down to `min_n`; at the most recent earlier occurrence of the longest
n-gram that has one, the tokens that followed it are the draft. Copy-heavy work (editing or
quoting a given text, code refactoring, RAG answers) repeats long spans, so drafts are often
accepted; no model runs.

A draft is at most as long as the match behind it: the context before that occurrence is
compared further back (up to MATCH_CAP tokens), and a match of m tokens drafts at most m (the
rule of SuffixDecoding, Oliaro et al. 2024: a short match is weak evidence, and every draft
token rejected still costs its row in the verifying step). A 3-token match drafts 3 tokens, a
passage being copied drafts the full length.

Cost: each request keeps, per n, a dict from n-gram to its latest start position, extended
only by the tokens added since the last call (O(new tokens x number of n) per step, never a
rescan of the context). Pure Python: no torch.
"""
from __future__ import annotations

from collections.abc import Sequence

from kvserve.core.request import Request

MATCH_CAP = 64           # tokens compared back from a match: its draft's longest length


class NgramIndex:
    """The latest start position of every n-gram of one growing token sequence, for n in
    [min_n, max_n]. The sequence handed to `propose` must extend the previous one (a request's
    tokens only grow); a shorter one rebuilds the index."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.sizes = range(max_n, min_n - 1, -1)      # longest first
        self._latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self._end = 0            # every n-gram ending at or before this position is indexed

    def _index_until(self, tokens: Sequence[int], end: int) -> None:
        if end < self._end:
            self._latest = {n: {} for n in self.sizes}
            self._end = 0
        for stop in range(self._end + 1, end + 1):
            for n in self.sizes:
                if stop >= n:
                    self._latest[n][tuple(tokens[stop - n:stop])] = stop - n
        self._end = max(self._end, end)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """The tokens that followed the most recent earlier occurrence of the longest matching
        suffix of `tokens`, at most k and at most the match's length (match_length); [] when no
        suffix of min_n or more tokens occurred before.

        A match that ends just before the suffix continues into the suffix and then into the
        draft itself (a repeating pattern keeps repeating).
        """
        length = len(tokens)
        if k <= 0 or length < 2:
            return []
        self._index_until(tokens, length - 1)      # n-grams that end before the last token
        for n in self.sizes:
            if n >= length:
                continue
            start = self._latest[n].get(tuple(tokens[length - n:]))
            if start is None:
                continue
            draft: list[int] = []
            for pos in range(start + n, start + n + min(k, match_length(tokens, start, n))):
                draft.append(tokens[pos] if pos < length else draft[pos - length])
            return draft
        return []


def match_length(tokens: Sequence[int], start: int, n: int) -> int:
    """How many tokens, up to MATCH_CAP, end the context `tokens` as they end the occurrence of its
    last n tokens at `start` (n at least: the occurrence itself, then as far back as they agree)."""
    m, length = n, len(tokens)
    while m < MATCH_CAP and start - (m - n) > 0 and tokens[start - (m - n) - 1] == tokens[length - m - 1]:
        m += 1
    return m


class NgramProposer:
    """Prompt-lookup drafts for many requests: one NgramIndex per request id."""

    def __init__(self, min_n: int, max_n: int) -> None:
        NgramIndex(min_n, max_n)             # validates the sizes once, here
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = NgramIndex(self.min_n, self.max_n)
        return index.propose(tokens, k)

    def propose_batch(self, items: list[tuple[Request, int]]) -> list[list[int]]:
        """Up to k drafts for each (request, k)."""
        return [self.propose(req.request_id, req.all_token_ids, k) if k > 0 else [] for req, k in items]

    def free(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def forget(self) -> None:
        self._indexes.clear()

    def __len__(self) -> int:
        return len(self._indexes)
