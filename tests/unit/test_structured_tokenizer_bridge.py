"""The llguidance tokenizer of the default model: every id's bytes are the detokenizer's, byte for
byte (byte-level BPE pieces of multi-byte characters compared as bytes), special tokens included;
ids past the tokenizer's vocabulary are never allowed."""

from __future__ import annotations

import random

import pytest
from tokenizers.pre_tokenizers import ByteLevel

from kvserve.model.tokenizer import Tokenizer
from kvserve.sampling_params import ParamError, StructuredOutputs
from kvserve.structured.bitmask import allocate_bitmask, allowed_token_ids
from kvserve.structured.compiler import GrammarCompiler
from kvserve.structured.tokenizer_bridge import ll_tokenizer


def gpt2_char_to_byte() -> dict[str, int]:
    """Byte-level BPE's alphabet: the printable character standing for each byte (GPT-2's map)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    assert set(chars) == set(ByteLevel.alphabet())
    return chars


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from tests.conftest import default_model_or_skip

    return Tokenizer.from_gguf(default_model_or_skip())


@pytest.fixture(scope="module")
def bridged(tokenizer):
    return ll_tokenizer(tokenizer, tokenizer.vocab_size)


def expected_bytes(tokenizer: Tokenizer, char_to_byte: dict[str, int], token_id: int) -> bytes:
    added = tokenizer.backend.get_added_tokens_decoder()
    if token_id in added:
        return added[token_id].content.encode("utf-8")
    return bytes(char_to_byte[c] for c in tokenizer.backend.id_to_token(token_id))


def test_every_id_has_the_detokenizers_bytes(tokenizer, bridged):
    char_to_byte = gpt2_char_to_byte()
    assert bridged.vocab_size == tokenizer.vocab_size
    mismatched, multibyte_pieces = [], 0
    for token_id in range(tokenizer.vocab_size):
        got = bridged.decode_bytes([token_id])
        want = expected_bytes(tokenizer, char_to_byte, token_id)
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if got != want or got.decode("utf-8", errors="replace") != text:
            mismatched.append((token_id, got, want, text))
        multibyte_pieces += "\ufffd" in text
    assert not mismatched, mismatched[:10]
    assert multibyte_pieces > 100  # the vocabulary's partial UTF-8 pieces were compared as bytes


def test_token_sequences_decode_to_the_detokenizers_text(tokenizer, bridged):
    """Pieces of multi-byte characters join up as the detokenizer joins them."""
    rng = random.Random(0)
    texts = [
        "naïve café — 日本語のテキスト 🙂👍🏽",
        "Ünïcödé\tand\nnewlines",
        '{"key": [1, 2.5e-3, null]}',
    ]
    sequences = [tokenizer.encode(t) for t in texts]
    sequences += [
        [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 12))] for _ in range(300)
    ]
    for ids in sequences:
        assert bridged.decode_bytes(ids).decode("utf-8", errors="replace") == tokenizer.decode(
            ids, skip_special_tokens=False
        ), ids
    for text in texts:
        assert bridged.decode_bytes(tokenizer.encode(text)) == text.encode("utf-8")


def test_special_tokens_and_eos(tokenizer, bridged):
    assert set(bridged.eos_tokens) == tokenizer.eos_token_ids
    for token_id in tokenizer.all_special_ids:
        assert bridged.is_special_token(token_id)
    assert not bridged.is_special_token(tokenizer.encode("hello")[0])


def test_a_padded_vocabulary_never_allows_the_extra_ids(tokenizer):
    size = tokenizer.vocab_size
    compiler = GrammarCompiler(tokenizer, size + 40)
    assert compiler.ll_tokenizer.vocab_size == size + 40
    mask = allocate_bitmask(1, size + 40)
    compiler.matcher(StructuredOutputs(grammar="start: <[*]>")).fill_bitmask(mask, 0)
    assert allowed_token_ids(mask, 0, size + 40).tolist() == list(range(size))
    with pytest.raises(ParamError, match="no output satisfies it"):
        compiler.compile(StructuredOutputs(grammar=f'start: <[{size + 3}]> "x"'))


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused(tokenizer):
    with pytest.raises(ValueError, match="smaller than its tokenizer"):
        ll_tokenizer(tokenizer, tokenizer.vocab_size - 1)
