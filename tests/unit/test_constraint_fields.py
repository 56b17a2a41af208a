"""How the request fields that carry an output constraint combine (server/protocol.py): the same
constraint in two fields is one constraint (guidance sends guided_grammar and
structured_outputs.grammar together, as vLLM accepts); different ones are a 400; Lark grammars
that start with `?start:` are Lark; whitespace_pattern reaches the JSON grammar."""

import pytest

from kvserve.server.errors import BadRequest
from kvserve.server.protocol import CompletionRequest
from kvserve.structured.constraints import grammar_text

LARK = '?start: sum\n?sum: NUMBER | sum "+" NUMBER\n%import common.NUMBER'


def constraint(**fields):
    return CompletionRequest(prompt="x", **fields).constraint()


def test_the_same_constraint_in_two_fields_is_one():
    so, name = constraint(guided_grammar=LARK, structured_outputs={"grammar": LARK})
    assert so.grammar == LARK and name == "guided_grammar"


def test_different_constraints_are_refused_naming_the_second():
    with pytest.raises(BadRequest) as e:
        constraint(guided_grammar=LARK, structured_outputs={"regex": "a+"})
    assert e.value.param == "structured_outputs"


def test_question_mark_start_is_lark_and_gbnf_still_converts():
    so, _ = constraint(guided_grammar=LARK)
    assert "?start: sum" in grammar_text(so)
    so, _ = constraint(guided_grammar='root ::= "yes" | "no"')
    assert "yes" in grammar_text(so)


def test_whitespace_pattern_reaches_the_json_grammar():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for fields in (
        {"structured_outputs": {"json": schema, "whitespace_pattern": "[ ]?"}},
        {"guided_json": schema, "guided_whitespace_pattern": "[ ]?"},
    ):
        so, _ = constraint(**fields)
        assert so.whitespace_pattern == "[ ]?" and '"whitespace_pattern":"[ ]?"' in grammar_text(so)
    with pytest.raises(BadRequest) as e:
        constraint(guided_regex="a+", guided_whitespace_pattern="[ ]?")
    assert e.value.param == "guided_regex"
    with pytest.raises(BadRequest) as e:
        constraint(guided_whitespace_pattern="[ ]?")
    assert e.value.param == "guided_whitespace_pattern"
