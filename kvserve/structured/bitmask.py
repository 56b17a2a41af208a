"""The token bitmask: which token ids a constrained request may sample next.

Layout: an int32 array of shape (num_rows, ceil(vocab_size / 32)), one row per sequence in the
batch. Token id j is allowed in a row when bit (j % 32) of word (j // 32) is set, counting bits
from the least significant (`(row[j >> 5] >> (j & 31)) & 1`). Rows are allocated all-ones, so a row
no matcher fills leaves its sequence unconstrained. Bits past vocab_size in the last word mean
nothing.

Applying it to torch logits of shape (rows, vocab) in the sampler, with `mask` the bitmask as a
torch int32 tensor on the logits' device:

    bits = (mask.unsqueeze(-1) >> torch.arange(32, device=mask.device, dtype=torch.int32)) & 1
    allowed = bits.view(mask.shape[0], -1)[:, :logits.shape[1]].bool()
    logits.masked_fill_(~allowed, float("-inf"))

apply_bitmask_numpy below does the same on a numpy array.
"""

from __future__ import annotations

import numpy as np

WORD_BITS = 32


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row for `vocab_size` token ids."""
    return (vocab_size + WORD_BITS - 1) // WORD_BITS


def allocate_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """A C-contiguous (num_rows, bitmask_words(vocab_size)) int32 array, every token allowed."""
    return np.full((num_rows, bitmask_words(vocab_size)), -1, dtype=np.int32)


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """The bitmask as a bool array of shape (num_rows, vocab_size): True where the token is
    allowed."""
    rows = np.atleast_2d(bitmask)
    as_bytes = np.ascontiguousarray(rows, dtype="<i4").view(np.uint8)  # word j -> bytes 4j..4j+3
    bits = np.unpackbits(as_bytes, axis=1, bitorder="little")
    return bits[:, :vocab_size].astype(bool)


def allowed_token_ids(bitmask: np.ndarray, row: int, vocab_size: int) -> np.ndarray:
    """The token ids row `row` allows, ascending."""
    return np.flatnonzero(unpack_bitmask(bitmask[row], vocab_size)[0])


def is_token_allowed(bitmask: np.ndarray, row: int, token_id: int) -> bool:
    return bool((int(bitmask[row, token_id >> 5]) >> (token_id & 31)) & 1)


def apply_bitmask_numpy(logits: np.ndarray, bitmask: np.ndarray) -> None:
    """Set, in place, the logits of disallowed tokens to -inf. logits: (rows, vocab) or (vocab,)
    floats; bitmask: the matching rows. Logit columns past the bitmask's width are disallowed."""
    view = logits[None, :] if logits.ndim == 1 else logits
    vocab = view.shape[1]
    allowed = unpack_bitmask(bitmask, min(vocab, bitmask.shape[-1] * WORD_BITS))
    view[:, : allowed.shape[1]][~allowed] = -np.inf
    view[:, allowed.shape[1] :] = -np.inf


def forbid_ids_from(bitmask: np.ndarray, row: int, first_id: int) -> None:
    """Clear, in place, the bits of token ids >= first_id in row `row`."""
    word, bit = divmod(first_id, WORD_BITS)
    if word >= bitmask.shape[1]:
        return
    keep = np.array((1 << bit) - 1, dtype=np.uint32).view(np.int32)
    bitmask[row, word] &= keep
    bitmask[row, word + 1 :] = 0
