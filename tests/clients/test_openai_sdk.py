"""The official `openai` SDK as its README shows it: chat (plain, streamed with usage), legacy
completions, n, stop, seed, logprobs, `chat.completions.parse` with a pydantic model, a strict
json_schema, tools (auto, required, named) and a tool-result round trip."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)


def test_chat_stream_and_sampling_options(client, model_name):
    kw = dict(model=model_name, messages=[{"role": "user", "content": "Count: 1, 2, 3,"}])
    r = client.chat.completions.create(**kw, max_completion_tokens=8, temperature=0, seed=7)
    assert r.choices[0].message.content and r.usage.completion_tokens <= 8
    stream = client.chat.completions.create(
        **kw,
        max_tokens=8,
        temperature=0,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content  # greedy: streamed == not streamed
    assert (
        chunks[-1].usage.completion_tokens == r.usage.completion_tokens and not chunks[-1].choices
    )
    sampled = [
        client.chat.completions.create(
            **kw, max_tokens=6, n=2, temperature=1.0, seed=3, logprobs=True, top_logprobs=2
        )
        for _ in range(2)
    ]
    two = sampled[0]
    assert [c.index for c in two.choices] == [0, 1]
    for c in two.choices:
        assert c.logprobs.content and all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    texts = [[c.message.content for c in s.choices] for s in sampled]
    assert texts[0] == texts[1]  # the same seed: the same samples
    full = r.choices[0].message.content
    stopped = client.chat.completions.create(**kw, max_tokens=8, temperature=0, stop=[" 4"])
    expected = full[: full.index(" 4")] if " 4" in full else full
    assert stopped.choices[0].message.content == expected


def test_completions(client, model_name):
    r = client.completions.create(
        model=model_name,
        prompt="The capital of France is",
        max_tokens=6,
        temperature=0,
        logprobs=2,
        stop=["\n\n"],
    )
    c = r.choices[0]
    assert c.text and len(c.logprobs.tokens) == r.usage.completion_tokens
    assert all(len(t) <= 2 for t in c.logprobs.top_logprobs)


def test_parse_pydantic_and_strict_json_schema(client, model_name):
    ask = [{"role": "user", "content": "Tell me about Paris, France."}]
    parsed = client.chat.completions.parse(
        model=model_name, messages=ask, response_format=City, max_tokens=48, temperature=0
    )
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City) and city.name
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Is Paris in France?"}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "yes_no", "schema": schema, "strict": True},
        },
        max_tokens=16,
        temperature=0,
    )
    assert json.loads(r.choices[0].message.content)["answer"] in ("yes", "no")


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_tool_choice_forces_a_call(client, model_name, tool_choice):
    r = client.chat.completions.create(
        model=model_name,
        messages=ASK,
        tools=[WEATHER_TOOL],
        tool_choice=tool_choice,
        max_tokens=48,
        temperature=0,
    )
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    assert set(json.loads(call.function.arguments)) == {"city"}


def test_tool_auto_and_result_round_trip(client, model_name):
    r = client.chat.completions.create(
        model=model_name,
        messages=ASK,
        tools=[WEATHER_TOOL],
        tool_choice="auto",
        max_tokens=48,
        temperature=0,
    )
    msg = r.choices[0].message
    assert msg.content or msg.tool_calls  # auto: the model chooses
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
    }
    follow = client.chat.completions.create(
        model=model_name,
        messages=[
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"},
        ],
        tools=[WEATHER_TOOL],
        max_tokens=24,
        temperature=0,
    )
    assert follow.choices[0].message.content or follow.choices[0].message.tool_calls
