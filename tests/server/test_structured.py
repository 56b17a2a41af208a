"""Structured output and tool calling through the server, with the official openai client."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What's the weather in Paris?"}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int


def test_response_format_json_schema_with_the_parse_helper(client, model_name):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    r = parse(
        model=model_name,
        messages=[{"role": "user", "content": "Describe a person called Bob, as JSON."}],
        response_format=Person,
        max_tokens=64,
        temperature=0,
    )
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"


def test_response_format_json_object_and_structured_outputs(client, model_name):
    r = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "A JSON object please."}],
        response_format={"type": "json_object"},
        max_tokens=120,
        temperature=0,
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(
        model=model_name,
        prompt="My phone number is",
        max_tokens=20,
        temperature=0.8,
        n=2,
        seed=1,
        extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}},
    )
    assert all(re.fullmatch(r"\d{3}-\d{4}", c.text) for c in r.choices)
    r = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Yes or no?"}],
        max_tokens=5,
        extra_body={"guided_choice": ["yes", "no"]},
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in r if c.choices)
    assert text in ("yes", "no")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {
                            "type": "object",
                            "properties": {"a": {"type": "string", "format": "no-such-format"}},
                        },
                    },
                }
            },
            "response_format",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(server, auth, body, param):
    r = httpx.post(
        f"{server}/v1/chat/completions",
        headers=auth,
        timeout=60,
        json={"messages": ASK_WEATHER, "max_tokens": 4, **body},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def check_call(call, tool) -> dict:
    assert call.type == "function" and call.function.name == tool["function"]["name"] and call.id
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_named_and_required_tool_choice(client, model_name):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model=model_name,
        messages=ASK_WEATHER,
        tools=[WEATHER, TIME],
        tool_choice=named,
        max_tokens=80,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0], WEATHER)
    r = client.chat.completions.create(
        model=model_name,
        messages=ASK_WEATHER,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=120,
        temperature=0.7,
        seed=2,
        n=2,
    )
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            check_call(call, WEATHER if call.function.name == "get_weather" else TIME)


def test_streamed_tool_calls_add_up_to_the_same_call(client, model_name):
    kwargs = dict(
        model=model_name,
        messages=ASK_WEATHER,
        tools=[WEATHER],
        temperature=0,
        max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    name, args, ids, finish = None, "", set(), None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            assert tc.index == 0
            ids |= {tc.id} if tc.id else set()
            name = tc.function.name or name
            args += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and name == "get_weather" and len(ids) == 1
    assert json.loads(args) == json.loads(whole.function.arguments)


def test_auto_and_a_tool_result_round_trip(client, model_name):
    r = client.chat.completions.create(
        model=model_name, messages=ASK_WEATHER, tools=[WEATHER], max_tokens=80, temperature=0
    )
    choice = r.choices[0]
    if choice.message.tool_calls:  # the model chose to call: the call is well formed
        assert choice.finish_reason == "tool_calls"
        call = choice.message.tool_calls[0]
        check_call(call, WEATHER)
    else:
        assert choice.message.content
        call = None
    history = ASK_WEATHER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    r = client.chat.completions.create(
        model=model_name,
        messages=history,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=30,
        temperature=0,
    )
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason in ("stop", "length")


def test_a_constrained_request_next_to_free_ones(aclient_factory, model_name):
    """Constrained and unconstrained requests in the same batches: each gets what it asked for."""
    import asyncio

    async def run():
        client = aclient_factory()
        free = [
            client.completions.create(
                model=model_name, prompt=f"Story {i}:", max_tokens=24, temperature=0
            )
            for i in range(4)
        ]
        constrained = [
            client.completions.create(
                model=model_name,
                prompt=f"Number {i}:",
                max_tokens=8,
                extra_body={"structured_outputs": {"regex": r" [0-9]{4}"}},
            )
            for i in range(4)
        ]
        return await asyncio.gather(*free, *constrained)

    outs = asyncio.run(run())
    assert all(o.choices[0].finish_reason == "length" for o in outs[:4])
    assert all(re.fullmatch(r" [0-9]{4}", o.choices[0].text) for o in outs[4:])


def test_openai_errors_surface_as_bad_request(client, model_name):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=model_name,
            messages=ASK_WEATHER,
            max_tokens=4,
            extra_body={"structured_outputs": {"grammar": "start: ("}},
        )
