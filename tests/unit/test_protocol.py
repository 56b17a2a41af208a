"""The OpenAI protocol models and error mapping, without a model or a server."""

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from kvserve.outputs import Logprob
from kvserve.server.errors import BadRequest, validation_error
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from kvserve.server.serving import chat_logprobs, check_context, completion_logprobs

USER = [{"role": "user", "content": "hi"}]


def _as_400(model, body) -> BadRequest:
    """What the server answers for a body pydantic rejects."""
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    return validation_error(
        RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.value.errors()])
    )


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("hello", ["hello"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_completion_prompt_forms(prompt, expected):
    assert CompletionRequest.model_validate({"prompt": prompt}).prompts() == expected


@pytest.mark.parametrize(
    "prompt", [[], [[]], [True], [1, "a"], [[1], "a"], 5, None, {"text": "x"}, [1.5]]
)
def test_completion_prompt_rejected(prompt):
    err = _as_400(CompletionRequest, {"prompt": prompt})
    assert err.status == 400 and err.param == "prompt"


def test_defaults_follow_openai():
    c = CompletionRequest.model_validate({"prompt": "x"}).to_sampling_params()
    assert c.max_tokens == 16 and c.temperature == 1.0 and c.n == 1 and c.logprobs is None
    chat = ChatCompletionRequest.model_validate({"messages": USER}).to_sampling_params()
    assert chat.max_tokens is None  # chat: up to the context length


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", "0.5"),
        ("n", 1.0),
        ("n", True),
        ("max_tokens", "10"),
        ("seed", "1"),
        ("stop", 3),
        ("stop", [1]),
        ("echo", "yes"),
        ("stream", 1),
        ("priority", 0.5),
    ],
)
def test_strict_types(field, value):
    err = _as_400(CompletionRequest, {"prompt": "x", field: value})
    assert err.param == field and err.message.startswith(f"{field}: ")


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("max_tokens", 0),
        ("min_p", 2.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("logprobs", 21),
        ("top_k", -2),
        ("stop", [""]),
        ("stop", ["s"] * 17),
        ("min_tokens", 100),
    ],
)
def test_ranges_name_the_field(field, value):
    req = CompletionRequest.model_validate({"prompt": "x", field: value})
    with pytest.raises(BadRequest) as e:
        req.to_sampling_params()
    assert e.value.param == field and e.value.status == 400


def test_temperature_takes_openais_range():
    """0 to 2 inclusive, as OpenAI's API; the offline SamplingParams takes any temperature."""
    for t in (0.0, 2.0):
        req = CompletionRequest.model_validate({"prompt": "x", "temperature": t})
        assert req.to_sampling_params().temperature == t
    req = ChatCompletionRequest.model_validate({"messages": USER, "temperature": 2.01})
    with pytest.raises(BadRequest) as e:
        req.to_sampling_params()
    assert e.value.param == "temperature" and "[0, 2]" in e.value.message


def test_chat_field_names_in_errors():
    req = ChatCompletionRequest.model_validate(
        {"messages": USER, "logprobs": True, "top_logprobs": 30}
    )
    with pytest.raises(BadRequest) as e:
        req.to_sampling_params()
    assert e.value.param == "top_logprobs"
    req = ChatCompletionRequest.model_validate({"messages": USER, "max_completion_tokens": 0})
    with pytest.raises(BadRequest) as e:
        req.to_sampling_params()
    assert e.value.param == "max_completion_tokens"


def test_chat_params():
    req = ChatCompletionRequest.model_validate(
        {
            "messages": USER,
            "max_tokens": 5,
            "max_completion_tokens": 7,
            "logprobs": True,
            "top_logprobs": 3,
            "stop": "END",
            "seed": 4,
            "n": 2,
            "ignore_eos": True,
            "min_tokens": 2,
        }
    )
    req.check()
    p = req.to_sampling_params()
    assert (p.max_tokens, p.logprobs, p.stop, p.seed, p.n, p.ignore_eos, p.min_tokens) == (
        7,
        3,
        ["END"],
        4,
        2,
        True,
        2,
    )
    plain = ChatCompletionRequest.model_validate(
        {"messages": USER, "logprobs": True}
    ).to_sampling_params()
    assert plain.logprobs == 0


def test_chat_messages_forms():
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None},
                {"role": "user", "content": "c", "name": "bob"},
            ]
        }
    )
    assert req.chat_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "c"},
    ]


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"content": "x"}]}, "messages.0.role"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
            "messages.0.content",
        ),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"messages": USER, "logprobs": 1}, "logprobs"),
        ({"messages": "hi"}, "messages"),
    ],
)
def test_chat_rejected(body, param):
    err = _as_400(ChatCompletionRequest, body)
    assert err.param == param


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": USER, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
        (
            {
                "messages": USER,
                "tools": [{"type": "function", "function": {"description": "no name"}}],
            },
            "tools",
        ),
        ({"messages": USER, "response_format": {"type": "json_schema"}}, "response_format"),
        ({"messages": USER, "logit_bias": {"1": 5.0}}, "logit_bias"),
        ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_chat_unsupported_values(body, param):
    req = ChatCompletionRequest.model_validate(body)
    with pytest.raises(BadRequest) as e:
        req.check()
    assert e.value.param == param


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        (
            {"prompt": "x", "stream": False, "stream_options": {"include_usage": True}},
            "stream_options",
        ),
    ],
)
def test_completion_unsupported_values(body, param):
    req = CompletionRequest.model_validate(body)
    with pytest.raises(BadRequest) as e:
        req.check()
    assert e.value.param == param


def test_beam_search_fields():
    """best_of above n needs use_beam_search; with it, the n best of best_of beams."""
    req = CompletionRequest.model_validate({"prompt": "x", "best_of": 3})
    req.check()
    with pytest.raises(BadRequest) as e:
        req.to_sampling_params()
    assert e.value.param == "best_of" and "use_beam_search" in str(e.value)
    p = CompletionRequest.model_validate(
        {
            "prompt": "x",
            "n": 2,
            "best_of": 3,
            "use_beam_search": True,
            "length_penalty": 0.5,
            "early_stopping": "never",
        }
    ).to_sampling_params()
    assert (p.use_beam_search, p.n, p.beam_width, p.length_penalty, p.early_stopping) == (
        True,
        2,
        3,
        0.5,
        "never",
    )
    chat = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "n": 2,
            "use_beam_search": True,
            "top_p": 0.5,
        }
    )
    with pytest.raises(BadRequest) as e:
        chat.to_sampling_params()
    assert e.value.param == "top_p"


def test_accepted_and_ignored():
    req = CompletionRequest.model_validate(
        {
            "prompt": "x",
            "user": "u1",
            "best_of": 1,
            "some_new_field": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    req.check()
    assert req.stream_options.include_usage


def test_validation_error_messages():
    err = _as_400(CompletionRequest, {})
    assert err.param == "prompt" and "required" in err.message
    json_err = validation_error(
        RequestValidationError(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body", 3),
                    "msg": "JSON decode error",
                    "ctx": {"error": "Expecting value"},
                }
            ]
        )
    )
    assert json_err.status == 400 and json_err.param is None and "JSON" in json_err.message
    body = json_err.body()["error"]
    assert (
        set(body) == {"message", "type", "param", "code"}
        and body["type"] == "invalid_request_error"
    )


def test_tokenize_request():
    TokenizeRequest.model_validate({"prompt": "x"}).check()
    TokenizeRequest.model_validate({"messages": USER}).check()
    with pytest.raises(BadRequest):
        TokenizeRequest.model_validate({}).check()
    with pytest.raises(BadRequest):
        TokenizeRequest.model_validate({"prompt": "x", "messages": USER}).check()


def test_context_check_numbers():
    check_context(10, 20, 30, "prompt")
    check_context(10, None, 30, "prompt")
    with pytest.raises(BadRequest) as e:
        check_context(10, 21, 30, "messages")
    assert (
        "30" in e.value.message
        and "31" in e.value.message
        and e.value.code == "context_length_exceeded"
    )
    with pytest.raises(BadRequest):
        check_context(30, None, 30, "prompt")


def test_logprob_formats():
    lps = [
        Logprob(5, -0.25, 1, "He", [(5, "He", -0.25), (6, "Hi", -1.5)]),
        Logprob(7, float("-inf"), 3, "llo", [(8, "y", -0.1)]),
    ]
    legacy, end = completion_logprobs(lps, 1, 10)
    assert legacy["tokens"] == ["He", "llo"] and legacy["text_offset"] == [10, 12] and end == 15
    assert legacy["token_logprobs"] == [-0.25, -9999.0]
    assert legacy["top_logprobs"] == [{"He": -0.25}, {"y": -0.1, "llo": -9999.0}]
    chat = chat_logprobs(lps, 2)["content"]
    assert chat[0] == {
        "token": "He",
        "logprob": -0.25,
        "bytes": [72, 101],
        "top_logprobs": [
            {"token": "He", "logprob": -0.25, "bytes": [72, 101]},
            {"token": "Hi", "logprob": -1.5, "bytes": [72, 105]},
        ],
    }
    assert chat_logprobs(lps, 0)["content"][1]["top_logprobs"] == []
