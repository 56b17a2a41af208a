"""Prompt lookup (n-gram) drafts: continue the request's context the way it continued before.

The last n tokens of a request's context (prompt + outputs) are looked up in the context
itself, n from `max_n` down to `min_n`; for the longest n-gram that occurred before, its most
recent CANDIDATES occurrences are compared further back with the context (up to MATCH_CAP
tokens), and the one that agrees longest (the most recent among equals) is followed: the tokens
after it are the draft.

Two rules keep drafts to the lookups that tend to be accepted (scripts/spec_row_cost.py
replays them over greedy answers; figures in docs/benchmarks.md):
- A draft is at most as long as the match behind it: a match of m tokens drafts at most m (the
  rule of SuffixDecoding, Oliaro et al. 2024: a short match is weak evidence, and every draft
  token rejected still costs its row in the verifying step). A 3-token match drafts 3 tokens, a
  passage being copied drafts the full length.
- No draft when the occurrences that agree longest disagree on the next token: the context has
  continued the same words in different ways, and the lookup would only guess between them
  (code repeats `for start, end in` before different calls). Over copy-heavy answers such
  lookups are accepted far less often than the others.

Copy-heavy work (editing or quoting a given text, code refactoring, RAG answers) repeats long
spans, so drafts are often accepted; no model runs.

Cost: each request keeps, per n, a dict from n-gram to its latest CANDIDATES start positions,
extended only by the tokens added since the last call (O(new tokens x number of n) per step,
never a rescan of the context); a lookup compares at most CANDIDATES x MATCH_CAP tokens. Pure
Python: no torch.
"""

from __future__ import annotations

from collections import deque

from kvserve.core.sequence import Sequence

MATCH_CAP = 64  # tokens compared back from a match: its draft's longest length
CANDIDATES = 8  # most recent occurrences of an n-gram compared per lookup


class NgramIndex:
    """The latest CANDIDATES start positions of every n-gram of one growing token sequence, for n
    in [min_n, max_n]. The sequence handed to `propose` must extend the previous one (a request's
    tokens only grow); a shorter one rebuilds the index."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.sizes = range(max_n, min_n - 1, -1)  # longest first
        self._starts: dict[int, dict[tuple[int, ...], deque[int]]] = {n: {} for n in self.sizes}
        self._end = 0  # every n-gram ending at or before this position is indexed

    def _index_until(self, tokens: list[int], end: int) -> None:
        if end < self._end:
            self._starts = {n: {} for n in self.sizes}
            self._end = 0
        for stop in range(self._end + 1, end + 1):
            for n in self.sizes:
                if stop >= n:
                    key = tuple(tokens[stop - n : stop])
                    starts = self._starts[n].get(key)
                    if starts is None:
                        starts = self._starts[n][key] = deque(maxlen=CANDIDATES)
                    starts.append(stop - n)
        self._end = max(self._end, end)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """The tokens that followed the earlier occurrence of the longest matching suffix of
        `tokens` that agrees longest with the context (match_length; the most recent among
        equals), at most k and at most that match's length; [] when no suffix of min_n or more
        tokens occurred before, or when the occurrences that agree longest went on differently.

        A match that ends just before the suffix continues into the suffix and then into the
        draft itself (a repeating pattern keeps repeating).
        """
        length = len(tokens)
        if k <= 0 or length < 2:
            return []
        self._index_until(tokens, length - 1)  # n-grams that end before the last token
        for n in self.sizes:
            if n >= length:
                continue
            starts = self._starts[n].get(tuple(tokens[length - n :]))
            if not starts:
                continue
            best, start, nexts = 0, 0, set()
            for s in reversed(starts):  # most recent first
                m = match_length(tokens, s, n)
                if m > best:
                    best, start, nexts = m, s, {tokens[s + n]}
                elif m == best:
                    nexts.add(tokens[s + n])
            if len(nexts) > 1:  # equally good evidence for different tokens
                return []
            draft: list[int] = []
            for pos in range(start + n, start + n + min(k, best)):
                draft.append(tokens[pos] if pos < length else draft[pos - length])
            return draft
        return []


def match_length(tokens: list[int], start: int, n: int) -> int:
    """How many tokens, up to MATCH_CAP, end the context `tokens` as they end the occurrence of its
    last n tokens at `start` (n at least: the occurrence itself, then as far back as they agree)."""
    m, length = n, len(tokens)
    while (
        m < MATCH_CAP
        and start - (m - n) > 0
        and tokens[start - (m - n) - 1] == tokens[length - m - 1]
    ):
        m += 1
    return m


class NgramProposer:
    """Prompt-lookup drafts for many requests: one NgramIndex per request id."""

    def __init__(self, min_n: int, max_n: int) -> None:
        NgramIndex(min_n, max_n)  # validates the sizes once, here
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, seq_id: str, tokens: list[int], k: int) -> list[int]:
        index = self._indexes.get(seq_id)
        if index is None:
            index = self._indexes[seq_id] = NgramIndex(self.min_n, self.max_n)
        return index.propose(tokens, k)

    def propose_batch(self, items: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to k drafts for each (request, k)."""
        return [self.propose(req.seq_id, req.all_token_ids, k) if k > 0 else [] for req, k in items]

    def free(self, seq_id: str) -> None:
        self._indexes.pop(seq_id, None)

    def forget(self) -> None:
        self._indexes.clear()

    def __len__(self) -> int:
        return len(self._indexes)
