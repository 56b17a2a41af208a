"""kvserve's Tokenizer as an llguidance.LLTokenizer: the byte string of every token id.

llguidance reads the `tokenizers` JSON (byte-level BPE maps each character of a token back to its
byte; byte-fallback tokens `<0xAB>` to their byte; added and special tokens to their text), so a
token's bytes are what the detokenizer produces for it. Special tokens are kept apart from text:
a grammar can only produce them by naming them (`<|im_end|>`, `<[2]>`), and the EOS ids are the
ones the matcher allows where the grammar accepts.

Ids past the tokenizer's vocabulary (a model whose embedding is padded) exist in the LLTokenizer
as named, empty special tokens; GrammarMatcher clears them from every mask.
"""

from __future__ import annotations

from copy import copy

import llguidance

from kvserve.model.tokenizer import Tokenizer


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """An LLTokenizer over ids [0, vocab_size): the model's vocabulary, which must hold every id of
    the tokenizer. EOS is every id of `tokenizer.eos_token_ids`. It reads the whole vocabulary:
    build it once per model."""
    tokenizer_size = tokenizer.vocab_size
    if vocab_size < tokenizer_size:
        raise ValueError(
            f"the model's vocabulary ({vocab_size} ids) is smaller than its tokenizer's "
            f"({tokenizer_size}): constrained decoding needs every token id to have a logit"
        )
    backend = copy(tokenizer.backend)  # serialized without padding or truncation settings
    backend.no_padding()
    backend.no_truncation()
    eos = sorted(tokenizer.eos_token_ids) or None
    try:
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    except ValueError as e:
        raise ValueError(f"llguidance cannot read this tokenizer: {e}") from e
