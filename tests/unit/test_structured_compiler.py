"""GrammarCompiler and GrammarMatcher: every constraint kind compiles and masks correctly (a valid
text's tokens are each allowed, EOS only where the grammar accepts, a wrong token is rejected),
bad constraints raise ParamError with llguidance's message, the cache hits, and tool-call grammars
hold the arguments to their schemas. Most tests use a tiny byte-level BPE tokenizer built here;
the ones marked so use the default model's."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
from tokenizers import AddedToken, decoders, models
from tokenizers import Tokenizer as Backend
from tokenizers.pre_tokenizers import ByteLevel

from kvserve.model.tokenizer import Tokenizer
from kvserve.sampling_params import ParamError, StructuredOutputs
from kvserve.server.tools import tool_choice_constraint
from kvserve.structured.bitmask import allocate_bitmask, allowed_token_ids, is_token_allowed
from kvserve.structured.compiler import GrammarCompiler
from kvserve.structured.matcher import BatchMaskFiller, GrammarMatcher

PADDING = 7  # the tiny model's vocabulary is larger than its tokenizer's, as padded embeddings are


def tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE over the 256 byte symbols, a few merges, and two EOS special tokens."""
    alphabet = sorted(ByteLevel.alphabet())
    merges = [
        ("{", '"'),
        ('"', ":"),
        ('"', ","),
        ("Ġ", '"'),
        ("n", "a"),
        ("na", "m"),
        ("nam", "e"),
        ("Ġ", "1"),
    ]
    vocab = {c: i for i, c in enumerate(alphabet)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    backend = Backend(models.BPE(vocab, merges))
    backend.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<|endoftext|>", "<|im_end|>")]
    )
    return Tokenizer(backend, bos_token_id=None, eos_token_id=backend.token_to_id("<|endoftext|>"))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, tokenizer.vocab_size + PADDING)


@pytest.fixture(scope="module")
def model_compiler():
    from tests.conftest import default_model_or_skip

    tokenizer = Tokenizer.from_gguf(default_model_or_skip())
    return tokenizer, GrammarCompiler(tokenizer, tokenizer.vocab_size)


def walk(
    compiler: GrammarCompiler, tokenizer: Tokenizer, matcher: GrammarMatcher, text: str
) -> None:
    """Feed `text`'s tokens; each must be allowed by the mask before it, EOS allowed exactly when
    the matcher accepts; at the end the text is complete and EOS is allowed."""
    mask = allocate_bitmask(2, compiler.vocab_size)
    eos = sorted(tokenizer.eos_token_ids)
    for token_id in tokenizer.encode(text):
        matcher.fill_bitmask(mask, 1)
        assert is_token_allowed(mask, 1, token_id), (text, tokenizer.decode([token_id]))
        assert all(is_token_allowed(mask, 1, e) == matcher.is_accepting() for e in eos)
        assert matcher.accept_token(token_id), matcher.error
    matcher.fill_bitmask(mask, 1)
    assert matcher.is_accepting() and matcher.eos_allowed and matcher.error is None
    assert all(is_token_allowed(mask, 1, e) for e in eos)
    assert (mask[0] == -1).all()  # other rows untouched


CASES = [  # (constraint, valid text, a text it must refuse)
    (
        StructuredOutputs(
            json={
                "type": "object",
                "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
                "required": ["name", "n"],
            }
        ),
        '{"name": "Bob", "n": 12}',
        '{"n": 1',
    ),
    (
        StructuredOutputs(
            json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            disable_any_whitespace=True,
        ),
        '{"a":-3}',
        '{"a": -3',
    ),
    (
        StructuredOutputs(json={"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}),
        '["x", "y"]',
        '["z',
    ),
    (StructuredOutputs(json_object=True), '{"any": [1, {"b": null}]}', "[1"),
    (StructuredOutputs(regex=r"\d{3}-[a-z]+"), "123-abc", "12a"),
    (StructuredOutputs(choice=["yes", "no", 'say "hi"\n']), 'say "hi"\n', "yeah"),
    (StructuredOutputs(grammar='start: "x" NUM ("," NUM)*\nNUM: /[0-9]+/'), "x1,22,333", "x1,,"),
    (StructuredOutputs(grammar='root ::= "(" [a-c]+ ")"'), "(abca)", "(d"),  # GBNF, converted
]


@pytest.mark.parametrize("so, valid, invalid", CASES, ids=[c[0].kind for c in CASES])
def test_each_kind_masks_a_valid_text_and_rejects_an_invalid_one(
    compiler, tokenizer, so, valid, invalid
):
    walk(compiler, tokenizer, compiler.matcher(so), valid)
    matcher = compiler.matcher(so)
    assert not matcher.accept_tokens(tokenizer.encode(invalid))
    assert matcher.error and matcher.is_terminated()
    mask = allocate_bitmask(1, compiler.vocab_size)
    matcher.fill_bitmask(mask, 0)  # a matcher in its error state allows only EOS
    assert set(allowed_token_ids(mask, 0, compiler.vocab_size).tolist()) == tokenizer.eos_token_ids


def test_a_token_outside_the_mask_is_rejected(compiler, tokenizer):
    matcher = compiler.matcher(StructuredOutputs(choice=["alpha", "beta"]))
    mask = allocate_bitmask(1, compiler.vocab_size)
    matcher.fill_bitmask(mask, 0)
    allowed = set(allowed_token_ids(mask, 0, compiler.vocab_size).tolist())
    assert allowed and not allowed & tokenizer.eos_token_ids  # EOS only where the grammar accepts
    wrong = next(t for t in range(tokenizer.vocab_size) if t not in allowed)
    assert not matcher.accept_token(wrong)
    assert "doesn't satisfy the grammar" in matcher.error


def test_a_closed_grammar_terminates_and_then_allows_only_eos(compiler, tokenizer):
    matcher = compiler.matcher(StructuredOutputs(choice=["yes", "no"]))
    assert matcher.accept_tokens(tokenizer.encode("no"))
    assert matcher.is_terminated() and matcher.is_accepting()
    mask = allocate_bitmask(1, compiler.vocab_size)
    matcher.fill_bitmask(mask, 0)
    assert set(allowed_token_ids(mask, 0, compiler.vocab_size).tolist()) == tokenizer.eos_token_ids
    assert matcher.accept_token(tokenizer.eos_token_id)


def test_padding_ids_past_the_tokenizer_are_never_allowed(compiler, tokenizer):
    mask = allocate_bitmask(1, compiler.vocab_size)
    compiler.matcher(StructuredOutputs(grammar="start: <[*]>")).fill_bitmask(mask, 0)
    assert allowed_token_ids(mask, 0, compiler.vocab_size).tolist() == list(
        range(tokenizer.vocab_size)
    )


def test_rollback_and_reset_restore_earlier_masks(compiler, tokenizer):
    so = StructuredOutputs(json={"type": "object", "properties": {"name": {"type": "string"}}})
    matcher = compiler.matcher(so)
    tokens = tokenizer.encode('{"name": "Al')
    masks = []
    for token_id in tokens:
        mask = allocate_bitmask(1, compiler.vocab_size)
        matcher.fill_bitmask(mask, 0)
        masks.append(mask)
        assert matcher.accept_token(token_id)
    assert matcher.validate_tokens(tokenizer.encode('ice"}')) == len(tokenizer.encode('ice"}'))
    assert matcher.validate_tokens(tokenizer.encode('ice"]')) == len(tokenizer.encode('ice"'))
    matcher.rollback(2)
    mask = allocate_bitmask(1, compiler.vocab_size)
    matcher.fill_bitmask(mask, 0)
    assert (mask == masks[-2]).all()
    matcher.reset()
    matcher.fill_bitmask(mask, 0)
    assert (mask == masks[0]).all()


def test_batch_filler_matches_one_by_one(compiler, tokenizer):
    matchers = [compiler.matcher(so) for so, _, _ in CASES[:4]]
    for m, (_, valid, _) in zip(matchers, CASES):
        assert m.accept_tokens(tokenizer.encode(valid)[:2])
    expected = allocate_bitmask(6, compiler.vocab_size)
    for row, m in zip((0, 2, 3, 5), matchers):
        m.fill_bitmask(expected, row)
    batch = allocate_bitmask(6, compiler.vocab_size)
    BatchMaskFiller(num_threads=2).fill(list(zip(matchers, (0, 2, 3, 5))), batch)
    assert (batch == expected).all()
    assert (batch[1] == -1).all() and (batch[4] == -1).all()


@pytest.mark.parametrize(
    "so, param, message",
    [
        (StructuredOutputs(grammar="start: foo"), "structured_outputs", 'unknown name: "foo"'),
        (
            StructuredOutputs(grammar='root ::= "a" ('),
            "structured_outputs",
            "Failed to convert the grammar from GBNF",
        ),
        (StructuredOutputs(regex="a(b"), "structured_outputs", "unclosed group"),
        (StructuredOutputs(regex="(?=a)b"), "structured_outputs", "look-around"),
        (
            StructuredOutputs(json={"not": {"type": "string"}}),
            "response_format",
            'Unimplemented keys: ["not"]',
        ),
        (
            StructuredOutputs(json={"type": "string", "format": "no-such-format"}),
            "response_format",
            "Unknown format",
        ),
        (
            StructuredOutputs(json={"$ref": "#/definitions/missing"}),
            "response_format",
            "does not exist",
        ),
        (
            StructuredOutputs(json={"type": "integer", "minimum": 5, "maximum": 2}),
            "response_format",
            "Unsatisfiable",
        ),
        (StructuredOutputs(grammar="start: <|no_such_token|>"), "tools", "unknown special token"),
        # compiles, and its first mask spends the lexer's budget that every copy shares: the second
        # sequence's mask would fail at its first step
        (StructuredOutputs(regex="a{99999999}"), "structured_outputs", "too many expressions"),
    ],
)
def test_bad_constraints_raise_param_error_with_llguidances_message(compiler, so, param, message):
    for _ in range(2):  # compiled, then from the cache
        with pytest.raises(ParamError) as err:
            compiler.matcher(so, param=param)
        assert err.value.param == param and message in str(err.value)


def test_cache_hits_on_equal_constraints_and_evicts_least_recent(tokenizer):
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, cache_size=2)
    schema = {"type": "object", "properties": {"k": {"type": "boolean"}}}
    first = compiler.compile(StructuredOutputs(json=schema))
    assert compiler.compile(StructuredOutputs(json=json.dumps(schema, indent=2))) == first
    compiler.matcher(StructuredOutputs(json=schema))
    info = compiler.cache_info()
    assert (info.hits, info.misses, info.size) == (2, 1, 1)
    compiler.compile(StructuredOutputs(regex="a"))
    compiler.compile(StructuredOutputs(regex="b"))  # evicts the schema
    compiler.compile(StructuredOutputs(json=schema))
    assert compiler.cache_info().misses == 4 and compiler.cache_info().size == 2


def test_matchers_from_one_cache_entry_are_independent(compiler, tokenizer):
    so = StructuredOutputs(choice=["left", "right"])
    a, b = compiler.matcher(so), compiler.matcher(so)
    assert a.accept_tokens(tokenizer.encode("left"))
    walk(compiler, tokenizer, b, "right")


def test_compile_and_matchers_from_many_threads(compiler, tokenizer):
    constraints = [
        StructuredOutputs(
            json={
                "type": "object",
                "properties": {f"k{i % 3}": {"type": "integer"}},
                "required": [f"k{i % 3}"],
            }
        )
        for i in range(12)
    ]
    errors = []

    def work(so: StructuredOutputs, key: str) -> None:
        try:
            walk(compiler, tokenizer, compiler.matcher(so), f'{{"{key}": 7}}')
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [
        threading.Thread(target=work, args=(so, f"k{i % 3}")) for i, so in enumerate(constraints)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


RANDOM_WALK_SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": -5, "maximum": 500},
            "name": {"type": "string", "maxLength": 6},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "name"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"anyOf": [{"type": "null"}, {"type": "string", "pattern": "^[xy]{1,3}$"}]},
        "minItems": 1,
        "maxItems": 4,
    },
    {
        "$defs": {
            "leaf": {
                "type": "object",
                "properties": {"v": {"enum": [1, 2, "three"]}},
                "required": ["v"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"left": {"$ref": "#/$defs/leaf"}, "right": {"$ref": "#/$defs/leaf"}},
        "required": ["left"],
        "additionalProperties": False,
    },
]


@pytest.mark.parametrize("schema", RANDOM_WALK_SCHEMAS)
def test_random_walks_through_the_mask_give_valid_json(compiler, tokenizer, schema):
    """Sample uniformly among the allowed tokens until the grammar ends: every output parses and
    validates against the schema."""
    jsonschema = pytest.importorskip("jsonschema")
    rng = np.random.default_rng(0)
    so = StructuredOutputs(json=schema, disable_any_whitespace=True)
    mask = allocate_bitmask(1, compiler.vocab_size)
    finished = 0
    for _ in range(30):
        matcher, ids = compiler.matcher(so), []
        for _ in range(300):
            matcher.fill_bitmask(mask, 0)
            allowed = allowed_token_ids(mask, 0, compiler.vocab_size)
            eos = [t for t in allowed if t in tokenizer.eos_token_ids]
            token = int(eos[0] if eos and rng.random() < 0.5 else rng.choice(allowed))
            assert matcher.accept_token(token), matcher.error
            if token in tokenizer.eos_token_ids:
                break
            ids.append(token)
        else:
            continue
        jsonschema.validate(json.loads(tokenizer.decode(ids)), schema)
        finished += 1
    assert finished >= 20


# ---- tool-call grammars (tools.py) on the tiny tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "$defs": {"N": {"type": "integer"}},
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/N"}, "b": {"$ref": "#/$defs/N"}},
            "required": ["a", "b"],
        },
    },
}
LABEL = {
    "type": "function",
    "function": {
        "name": "label",
        "parameters": {
            "$defs": {"N": {"type": "string", "enum": ["red", "blue"]}},
            "type": "object",
            "properties": {"color": {"$ref": "#/$defs/N"}},
            "required": ["color"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}


def tool_matcher(compiler, tool_choice, **kwargs) -> GrammarMatcher:
    return compiler.matcher(
        tool_choice_constraint([WEATHER, ADD, LABEL, NOW], tool_choice, **kwargs), param="tools"
    )


def test_required_tool_calls_follow_each_functions_schema(compiler, tokenizer):
    text = (
        '<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},\n'
        '{"name": "add", "arguments": {"a": 1, "b": 2}},\n'
        '{"name": "label", "arguments": {"color": "red"}},\n'
        '{"name": "now", "arguments": {}}\n]</tool_call>'
    )
    matcher = tool_matcher(compiler, "required")
    walk(compiler, tokenizer, matcher, text)
    assert matcher.is_terminated()
    for bad in [
        '<tool_call>[{"name": "get_time"',  # no such function
        '<tool_call>[{"name": "add", "arguments": {"a": 1}}',  # b is required
        '<tool_call>[{"name": "add", "arguments": {"a": "1"',  # a is an integer ($defs)
        '<tool_call>[{"name": "label", "arguments": {"color": "green"',  # its own $defs: an enum
        '<tool_call>[{"name": "now", "arguments": {"x"',  # no parameters at all
        "<tool_call>[]",
        "Sure, <tool_call>",
    ]:  # at least one call, at once
        assert not tool_matcher(compiler, "required").accept_tokens(tokenizer.encode(bad)), bad


def test_a_named_tool_choice_allows_one_call_of_that_function(compiler, tokenizer):
    named = {"type": "function", "function": {"name": "add"}}
    walk(
        compiler,
        tokenizer,
        tool_matcher(compiler, named),
        '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>',
    )
    assert not tool_matcher(compiler, named).accept_tokens(
        tokenizer.encode('<tool_call>[{"name": "get_weather"')
    )
    assert not tool_matcher(compiler, named).accept_tokens(
        tokenizer.encode('<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, {')
    )
    single = tool_matcher(compiler, "required", parallel_tool_calls=False)
    assert not single.accept_tokens(
        tokenizer.encode('<tool_call>[{"name": "now", "arguments": {}}, {')
    )


def test_compact_tool_calls_without_whitespace(compiler, tokenizer):
    walk(
        compiler,
        tokenizer,
        tool_matcher(compiler, "required", disable_any_whitespace=True),
        '<tool_call>[{"name":"now","arguments":{}}]</tool_call>',
    )
    assert not tool_matcher(compiler, "required", disable_any_whitespace=True).accept_tokens(
        tokenizer.encode("<tool_call>[\n")
    )


# ---- the default model's tokenizer


def test_json_schema_walk_on_the_default_model(model_compiler):
    tokenizer, compiler = model_compiler
    schema = {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
            "score": {"type": "number", "minimum": 0},
            "kind": {"enum": ["book", "film"]},
            "meta": {"type": ["object", "null"], "properties": {"year": {"type": "integer"}}},
        },
        "required": ["title", "tags", "kind"],
        "additionalProperties": False,
    }
    text = json.dumps(
        {
            "title": "Le Petit Prince — ü",
            "tags": ["conte", "日本"],
            "score": 4.5,
            "kind": "book",
            "meta": {"year": 1943},
        },
        ensure_ascii=False,
    )
    walk(compiler, tokenizer, compiler.matcher(StructuredOutputs(json=schema)), text)
    walk(
        compiler,
        tokenizer,
        compiler.matcher(StructuredOutputs(regex=r"[A-Z][a-z]+ \d{4}")),
        "Paris 2024",
    )


def test_compile_time_of_a_typical_schema(model_compiler):
    """Measured and printed (`pytest -s`), not asserted."""
    tokenizer, compiler = model_compiler
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0},
            "email": {"type": "string", "format": "email"},
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string"},
                    "city": {"type": "string"},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["street", "city"],
            },
            "roles": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}},
        },
        "required": ["name", "age", "address"],
    }
    so = StructuredOutputs(json=schema)
    t0 = time.perf_counter()
    compiler.compile(so)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    matcher = compiler.matcher(so)
    hit = time.perf_counter() - t0
    mask = allocate_bitmask(1, compiler.vocab_size)
    t0 = time.perf_counter()
    matcher.fill_bitmask(mask, 0)
    first_mask = time.perf_counter() - t0
    print(
        f"\ntypical schema: compile {cold * 1e3:.2f} ms, matcher from cache {hit * 1e3:.3f} ms, "
        f"first mask {first_mask * 1e3:.3f} ms"
    )
    assert np.any(mask)
