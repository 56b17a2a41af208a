"""A StructuredOutputs constraint as llguidance grammar text (not yet checked against a tokenizer).

json: the schema through llguidance's JSON-schema compiler, whitespace between JSON tokens free
unless `disable_any_whitespace` (vLLM's meaning; the schema's own "x-guidance" options override);
json_object: the schema {"type": "object"}; regex: Rust `regex` syntax; choice: a Lark rule with
one literal per choice; grammar: Lark (llguidance's dialect, `%json {...}` included), or GBNF
converted to Lark.
"""
from __future__ import annotations

import json

import llguidance

from kvserve.sampling_params import ParamError, StructuredOutputs

ANY_JSON_OBJECT = '{"type": "object"}'


def choice_lark(choices: list[str]) -> str:
    """A Lark grammar matching exactly one of `choices`."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def grammar_text(so: StructuredOutputs, param: str = "structured_outputs") -> str:
    """The llguidance grammar for `so`. ParamError(param) when it cannot be translated (a GBNF
    grammar that does not parse); most errors only show when the grammar is compiled."""
    kind = so.kind
    json_options = {"whitespace_flexible": not so.disable_any_whitespace}
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(so.key()[1], defaults=json_options)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=json_options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(so.regex)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(choice_lark(so.choice))
        return llguidance.grammar_from("grammar", so.grammar)
    except ValueError as e:
        raise ParamError(param, f"the {kind} constraint is invalid: {e}") from e
