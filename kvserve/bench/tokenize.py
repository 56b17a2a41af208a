"""A tokenizer for the benchmark client side: ShareGPT text -> ids, and ids -> text for servers
that take only text prompts (llama-cpp-python). kvserve's own tokenizer, read from the model
file."""

from __future__ import annotations

import os
from functools import lru_cache


@lru_cache(maxsize=2)
def tokenizer_of(model: str):
    """kvserve's Tokenizer of a GGUF file or HF directory (cached)."""
    from kvserve.model.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(model) if os.path.isdir(model) else Tokenizer.from_gguf(model)


def encoder(model: str):
    tok = tokenizer_of(model)
    return lambda text: tok.encode(text, add_special_tokens=False)


def decoder(model: str):
    tok = tokenizer_of(model)
    return lambda ids: tok.decode(ids, skip_special_tokens=False)
