"""Outlines as its docs show it for a served model: `outlines.from_vllm` (the vLLM server client,
which sends vLLM's `structured_outputs`) with a JSON schema, a Literal, a Regex and a Lark CFG
(outlines' own arithmetic grammar, `?start:` rules, aliases and `%import common`), and
`outlines.from_openai` with a pydantic model (a json_schema response_format)."""

from __future__ import annotations

import json
import re
from typing import Literal

import pytest

outlines = pytest.importorskip("outlines")
pydantic = pytest.importorskip("pydantic")

from outlines.types import CFG, Regex  # noqa: E402

KW = dict(max_tokens=24, temperature=0)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)


@pytest.fixture(scope="module")
def vllm_model(client, model_name):
    return outlines.from_vllm(client, model_name)


def test_vllm_json_literal_regex(vllm_model):
    city = City.model_validate_json(vllm_model("Tell me about Paris, France.", City, max_tokens=48))
    assert city.name
    answer = vllm_model("Is Paris in France?", Literal["yes", "no"], **KW)
    assert answer in ("yes", "no")
    year = vllm_model("When did the French Revolution start?", Regex(r"1[0-9]{3}"), **KW)
    assert re.fullmatch(r"1[0-9]{3}", year)


def test_vllm_lark_cfg(vllm_model):
    grammar = outlines.grammars.arithmetic
    assert grammar.lstrip().startswith("?start:")
    expr = vllm_model("Write an arithmetic expression that equals 10.", CFG(grammar), **KW)
    assert expr.strip() and re.fullmatch(r"[0-9+\-*/(). \t]+", expr), expr


def test_openai_json_schema(client, model_name):
    model = outlines.from_openai(client, model_name)
    out = model("Tell me about Paris, France.", City, max_tokens=48, temperature=0)
    assert City.model_validate(json.loads(out)).name
