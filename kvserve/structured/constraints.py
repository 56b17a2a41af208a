"""A StructuredOutputs constraint as llguidance grammar text (not yet checked against a tokenizer).

json: the schema through llguidance's JSON-schema compiler, whitespace between JSON tokens free
unless `disable_any_whitespace` (vLLM's meaning; the schema's own "x-guidance" options override),
and objects closed: an object schema that lists `properties` and says nothing of
`additionalProperties` gets no other keys (as OpenAI's strict mode and xgrammar's default
do; without it a small model keeps inventing keys until max_tokens). The output still validates
against the schema as given;
json_object: the schema {"type": "object"}; regex: Rust `regex` syntax; choice: a Lark rule with
one terminal of every choice; grammar: Lark (llguidance's dialect, `%json {...}` included), or
GBNF (rules written `name ::= ...`) converted to Lark.
"""

from __future__ import annotations

import json

import llguidance

from kvserve.sampling_params import ParamError, StructuredOutputs, closed_objects

ANY_JSON_OBJECT = '{"type": "object"}'


def choice_lark(choices: list[str]) -> str:
    """A Lark grammar matching exactly one of `choices`: one terminal, so the lexer (an automaton)
    tells the choices apart; as alternatives of a rule, each would be a parser item of its own,
    past llguidance's 2,000 items per row at a few thousand choices."""
    return "start: CHOICE\nCHOICE: " + " | ".join(
        json.dumps(c, ensure_ascii=False) for c in choices
    )


def grammar_text(so: StructuredOutputs, param: str = "structured_outputs") -> str:
    """The llguidance grammar for `so`. ParamError(param) when it cannot be translated (a GBNF
    grammar that does not parse); most errors only show when the grammar is compiled."""
    kind = so.kind
    json_options = {"whitespace_flexible": not so.disable_any_whitespace}
    if so.whitespace_pattern is not None:
        json_options["whitespace_pattern"] = so.whitespace_pattern
    try:
        if kind == "json":
            schema = closed_objects(json.loads(so.key()[1]))
            return llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults=json_options
            )
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                ANY_JSON_OBJECT, defaults=json_options
            )
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(so.regex)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(choice_lark(so.choice))
        # GBNF rules are written `name ::= ...`; Lark's `name: ...` (`?start:`, `!rule:` too)
        return llguidance.grammar_from("grammar" if "::=" in so.grammar else "lark", so.grammar)
    except ValueError as e:
        raise ParamError(param, f"the {kind} constraint is invalid: {e}") from e
