"""The token bitmask layout: bit j % 32 of word j // 32 set = token j allowed."""

from __future__ import annotations

import numpy as np

from kvserve.structured.bitmask import (
    allocate_bitmask,
    allowed_token_ids,
    apply_bitmask_numpy,
    bitmask_words,
    forbid_ids_from,
    is_token_allowed,
    unpack_bitmask,
)


def bitmask_of(allowed: list[set[int]], vocab: int) -> np.ndarray:
    mask = np.zeros((len(allowed), bitmask_words(vocab)), dtype=np.int32)
    for row, ids in enumerate(allowed):
        for j in ids:
            word = mask[row, j // 32].view(np.uint32)
            mask[row, j // 32] = np.uint32(word | (1 << (j % 32))).view(np.int32)
    return mask


def test_allocated_rows_allow_everything():
    mask = allocate_bitmask(3, 70)
    assert mask.shape == (3, 3) and mask.dtype == np.int32 and mask.flags["C_CONTIGUOUS"]
    assert unpack_bitmask(mask, 70).all()


def test_layout_bit_j_of_word_j_over_32():
    vocab = 100
    allowed = [{0, 31, 32, 63, 99}, {5}, set()]
    mask = bitmask_of(allowed, vocab)
    assert mask[0, 0] == np.int32(-(2**31) + 1)  # bits 0 and 31 of word 0
    for row, ids in enumerate(allowed):
        assert set(allowed_token_ids(mask, row, vocab).tolist()) == ids
        assert all(is_token_allowed(mask, row, j) == (j in ids) for j in range(vocab))


def test_apply_bitmask_numpy_masks_disallowed_logits():
    vocab = 70
    mask = bitmask_of([{1, 33, 69}, set(range(vocab))], vocab)
    logits = np.arange(2 * vocab, dtype=np.float32).reshape(2, vocab)
    apply_bitmask_numpy(logits, mask)
    assert np.flatnonzero(np.isfinite(logits[0])).tolist() == [1, 33, 69]
    assert np.isfinite(logits[1]).all()
    single = np.zeros(vocab, dtype=np.float32)
    apply_bitmask_numpy(single, mask[0])
    assert np.flatnonzero(np.isfinite(single)).tolist() == [1, 33, 69]


def test_logits_wider_than_the_bitmask_are_masked():
    mask = allocate_bitmask(1, 32)
    logits = np.zeros((1, 40), dtype=np.float32)
    apply_bitmask_numpy(logits, mask)
    assert np.isfinite(logits[0, :32]).all() and np.isneginf(logits[0, 32:]).all()


def test_forbid_ids_from_clears_the_tail():
    vocab = 100
    for first in (0, 31, 32, 33, 64, 95, 99):
        mask = allocate_bitmask(2, vocab)
        forbid_ids_from(mask, 1, first)
        assert allowed_token_ids(mask, 1, vocab).tolist() == list(range(first))
        assert unpack_bitmask(mask[0], vocab).all()
