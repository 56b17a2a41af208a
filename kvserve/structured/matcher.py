"""GrammarMatcher: one sequence's position in its grammar (an llguidance.LLMatcher).

Each step: fill_bitmask() writes the tokens the grammar allows next into a row of the batch
bitmask (bitmask.py), the sampler masks the logits with it, and accept_token() advances the matcher
with the sampled token. EOS ids are allowed exactly where the grammar accepts; once
is_terminated(), only EOS is, and the sequence should finish.

A matcher never raises for a grammar or token error: it enters an error state (`error` says why)
and from then on allows only EOS. Methods that compute a mask release the GIL. One matcher must
not be used from two threads at once; different matchers may be, and BatchMaskFiller fills many
rows in parallel.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import llguidance.numpy
import numpy as np

from kvserve.structured.bitmask import forbid_ids_from

NON_VERBOSE_MARK = "<non-verbose/>"  # llguidance's stand-in for the parser state it leaves out


class GrammarMatcher:
    """A per-sequence matcher over a compiled grammar (GrammarCompiler.matcher makes them)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, tokenizer_vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size
        # Ids in [tokenizer_vocab_size, vocab_size) have no text: a grammar naming them (<[id]>)
        # must still not get them sampled.
        self._first_padding_id = tokenizer_vocab_size if tokenizer_vocab_size < vocab_size else None

    @property
    def ll_matcher(self) -> llguidance.LLMatcher:
        return self._matcher

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (a C-contiguous int32 array from
        allocate_bitmask(rows, vocab_size))."""
        llguidance.numpy.fill_next_token_bitmask(self._matcher, bitmask, row)
        self.clear_padding_ids(bitmask, row)

    def clear_padding_ids(self, bitmask: np.ndarray, row: int) -> None:
        if self._first_padding_id is not None:
            forbid_ids_from(bitmask, row, self._first_padding_id)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token. False (and the matcher in its error state) when the
        grammar does not allow it. Accepting an allowed EOS terminates the matcher."""
        return self._matcher.consume_token(token_id)

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance by several tokens (replaying a sequence's output); False as accept_token."""
        return self._matcher.consume_tokens(list(token_ids))

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of `token_ids` the grammar would accept, without advancing
        (for speculative drafts)."""
        return self._matcher.validate_tokens(list(token_ids))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected speculative tokens)."""
        if num_tokens > 0 and not self._matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._matcher.get_error()}")

    def reset(self) -> None:
        """Back to the grammar's start, as if no token had been accepted."""
        self._matcher.reset()

    def is_terminated(self) -> bool:
        """No token but EOS can follow (the grammar is complete, an EOS was accepted, or the
        matcher is in its error state)."""
        return self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        """The text so far is a complete match: EOS is allowed now."""
        return self._matcher.is_accepting()

    @property
    def eos_allowed(self) -> bool:
        return self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the matcher is in its error state, or None."""
        if not self._matcher.is_error():
            return None
        return (
            self._matcher.get_error().replace(NON_VERBOSE_MARK, "").strip()
            or "unknown grammar error"
        )


class BatchMaskFiller:
    """Fills the rows of many matchers at once on llguidance's own thread pool (GIL released)."""

    def __init__(self, num_threads: int | None = None):
        self._executor = llguidance.LLExecutor(num_threads)

    def fill(self, rows: Sequence[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
        """For each (matcher, row): fill bitmask[row]. Each matcher appears at most once."""
        if not rows:
            return
        llguidance.numpy.fill_next_token_bitmask_par(
            self._executor, [(m.ll_matcher, row) for m, row in rows], bitmask
        )
        for m, row in rows:
            m.clear_padding_ids(bitmask, row)
