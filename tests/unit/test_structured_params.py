"""StructuredOutputs: exactly one constraint kind, of the right type; canonical cache keys."""

from __future__ import annotations

import pytest

from kvserve.sampling_params import ParamError, StructuredOutputs


@pytest.mark.parametrize(
    "kwargs, kind",
    [
        ({"json": {"type": "object"}}, "json"),
        ({"json": '{"type": "string"}'}, "json"),
        ({"json_object": True}, "json_object"),
        ({"regex": "[a-z]+"}, "regex"),
        ({"choice": ["yes", "no"]}, "choice"),
        ({"grammar": 'start: "a"'}, "grammar"),
    ],
)
def test_each_kind_alone_is_accepted(kwargs, kind):
    assert StructuredOutputs(**kwargs).kind == kind


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of"),
        ({"regex": "a", "grammar": 'start: "a"'}, "got regex, grammar"),
        ({"json": {"type": "object"}, "json_object": True}, "got json, json_object"),
        ({"json": 3}, "JSON schema"),
        ({"json": "[1, 2]"}, "JSON schema object"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": {"const": float("nan")}}, "not serializable"),
        ({"json": {"a": {1, 2}}}, "not serializable"),
        ({"regex": ""}, "non-empty string"),
        ({"regex": 5}, "non-empty string"),
        ({"grammar": "\ud800"}, "non-empty string"),
        ({"choice": []}, "non-empty list of strings"),
        ({"choice": "yes"}, "non-empty list of strings"),
        ({"choice": ["a", None]}, "non-empty list of strings"),
        ({"json_object": "yes"}, "json_object must be true or false"),
        (
            {"regex": "a", "disable_any_whitespace": 1},
            "disable_any_whitespace must be true or false",
        ),
    ],
)
def test_invalid_constraints_raise_param_error(kwargs, message):
    with pytest.raises(ParamError) as err:
        StructuredOutputs(**kwargs)
    assert err.value.param == "structured_outputs"
    assert message in str(err.value)


def test_key_is_canonical_and_hashable():
    as_dict = StructuredOutputs(json={"type": "object", "properties": {"b": {}, "a": {}}})
    as_text = StructuredOutputs(json='{ "type" : "object", "properties": {"b": {}, "a": {}} }')
    assert as_dict.key() == as_text.key()
    assert hash(as_dict.key()) == hash(as_text.key())
    # Property order decides the output's key order: it is part of the key.
    reordered = StructuredOutputs(json={"type": "object", "properties": {"a": {}, "b": {}}})
    assert reordered.key() != as_dict.key()
    compact = StructuredOutputs(
        json={"type": "object", "properties": {"b": {}, "a": {}}}, disable_any_whitespace=True
    )
    assert compact.key() != as_dict.key()
    assert StructuredOutputs(choice=["a", "b"]).key() == ("choice", ("a", "b"))
    assert StructuredOutputs(regex="a+").key() != StructuredOutputs(grammar="a+").key()
    assert (
        len(
            {
                StructuredOutputs(json_object=True).key(),
                StructuredOutputs(json={"type": "object"}).key(),
            }
        )
        == 2
    )
