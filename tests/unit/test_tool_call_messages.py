"""An assistant's earlier `tool_calls` and the `tool` messages answering them, as a chat request
sends them back: a wrong shape or a tool message answering no call is a 400 naming the message
(kvserve.server.protocol), never an error inside the template rendering (a 500)."""

import pytest

from kvserve.server.protocol import ChatCompletionRequest, TokenizeRequest
from kvserve.server.tools import messages_for_template
from tests.unit.test_input_hardening import refusal

USER = {"role": "user", "content": "Weather in Paris?"}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
ANSWER = {"role": "tool", "tool_call_id": "call_1", "content": "18C"}


def _assistant(tool_calls) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": tool_calls}


def _fn(**function) -> list[dict]:
    return [{"id": "c", "type": "function", "function": function}]


@pytest.mark.parametrize(
    "tool_calls, param",
    [
        ("x", "messages.1.tool_calls"),
        ([1], "messages.1.tool_calls.0"),
        ({"id": "c"}, "messages.1.tool_calls"),
        ([{"id": "c", "function": 5}], "messages.1.tool_calls.0.function"),
        ([{"function": {"name": "f", "arguments": "{}"}}], "messages.1.tool_calls.0.id"),
        (
            [{"id": "c", "type": "retrieval", "function": {"name": "f", "arguments": "{}"}}],
            "messages.1.tool_calls.0.type",
        ),
        (_fn(arguments="{}"), "messages.1.tool_calls.0.function.name"),
        (_fn(name="", arguments="{}"), "messages.1.tool_calls.0.function.name"),
        (_fn(name=5, arguments="{}"), "messages.1.tool_calls.0.function.name"),
        (_fn(name="f"), "messages.1.tool_calls.0.function.arguments"),
        (_fn(name="f", arguments={"a": 1}), "messages.1.tool_calls.0.function.arguments"),
        (_fn(name="f", arguments=None), "messages.1.tool_calls.0.function.arguments"),
    ],
)
def test_tool_calls_of_the_wrong_shape_are_400_naming_where(tool_calls, param):
    err = refusal(ChatCompletionRequest, {"messages": [USER, _assistant(tool_calls), USER]})
    assert err is not None and err.status == 400, err
    assert err.param == param, (err.param, err.message)


@pytest.mark.parametrize(
    "messages, param",
    [
        ([USER, ANSWER], "messages.1.role"),
        ([ANSWER], "messages.0.role"),
        ([USER, _assistant([CALL]), USER, ANSWER], "messages.3.role"),  # a user turn in between
        ([USER, {"role": "assistant", "content": "Sunny."}, ANSWER], "messages.2.role"),
        ([USER, _assistant([CALL]), {"role": "tool", "content": "18C"}], "messages.2.tool_call_id"),
        (
            [USER, _assistant([CALL]), {**ANSWER, "tool_call_id": "call_9"}],
            "messages.2.tool_call_id",
        ),
    ],
)
def test_a_tool_message_must_answer_the_calls_before_it(messages, param):
    for model in (ChatCompletionRequest, TokenizeRequest):
        err = refusal(model, {"messages": messages})
        assert err is not None and err.status == 400 and err.param == param, (model, err)
        assert "tool" in err.message


def test_well_formed_tool_turns_pass_and_render():
    two = [CALL, {**CALL, "id": "call_2", "function": {"name": "get_time", "arguments": ""}}]
    messages = [
        USER,
        _assistant(two),
        ANSWER,
        {**ANSWER, "tool_call_id": "call_2", "content": "noon"},
        {"role": "assistant", "content": "18C at noon."},
        USER,
    ]
    assert refusal(ChatCompletionRequest, {"messages": messages}) is None
    req = ChatCompletionRequest.model_validate({"messages": messages})
    rendered = messages_for_template(req.chat_messages(), None)
    roles = ["user", "assistant", "user", "assistant", "user"]
    assert [m["role"] for m in rendered] == roles
    assert '"name": "get_weather", "arguments": {"city": "Paris"}' in rendered[1]["content"]
    assert '"name": "get_time", "arguments": {}' in rendered[1]["content"]
    assert rendered[2]["content"] == (
        "The function get_weather returned:\n18C\n\nThe function get_time returned:\nnoon"
    )
