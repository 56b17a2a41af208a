"""Hostile request bodies against the protocol models and SamplingParams: every one is a 400
naming the field (never an exception that would reach the engine), and legitimate edge values
still pass."""

from __future__ import annotations

import json
import math

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from kvserve.sampling_params import ParamError, SamplingParams
from kvserve.server.errors import BadRequest, validation_error
from kvserve.server.protocol import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
)

USER = [{"role": "user", "content": "hi"}]
LONE = "a\ud800b"


def refusal(model, body: dict) -> BadRequest | None:
    """What the server does with `body` before the engine: None if it would pass it on."""
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        return validation_error(
            RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()])
        )
    try:
        if hasattr(req, "check"):
            req.check()
        if hasattr(req, "to_sampling_params"):
            req.to_sampling_params()
    except BadRequest as e:
        return e
    return None


@pytest.mark.parametrize(
    "model, body, param",
    [
        (CompletionRequest, {"prompt": LONE}, "prompt"),
        (CompletionRequest, {"prompt": ["ok", LONE]}, "prompt.1"),
        (CompletionRequest, {"prompt": "x", "model": LONE}, "model"),
        (CompletionRequest, {"prompt": "x", "cache_salt": LONE}, "cache_salt"),
        (CompletionRequest, {"prompt": "x", "stop": LONE}, "stop"),
        (CompletionRequest, {"prompt": "x", "stop": ["ok", LONE]}, "stop.1"),
        (CompletionRequest, {"prompt": "x", "user": LONE}, "user"),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": LONE}]},
            "messages.0.content",
        ),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
            "messages.0.content.0.text",
        ),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "x", "name": LONE}]},
            "messages.0.name",
        ),
        (TokenizeRequest, {"prompt": LONE}, "prompt"),
        # inside JSON objects: tools, tool_choice, schemas, an assistant's earlier tool calls
        (
            ChatCompletionRequest,
            {
                "messages": USER,
                "tools": [{"type": "function", "function": {"name": "f", "description": LONE}}],
            },
            "tools.0",
        ),
        (
            ChatCompletionRequest,
            {"messages": USER, "tool_choice": {"type": "function", "function": {"name": LONE}}},
            "tool_choice",
        ),
        (
            ChatCompletionRequest,
            {"messages": USER, "structured_outputs": {"json": {"properties": {LONE: {}}}}},
            "structured_outputs",
        ),
        (
            ChatCompletionRequest,
            {
                "messages": USER,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"title": LONE}},
                },
            },
            "response_format.json_schema.schema",
        ),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "assistant", "tool_calls": [{"id": LONE}]}]},
            "messages.0.tool_calls.0",
        ),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(model, body, param):
    err = refusal(model, body)
    assert err is not None and err.status == 400
    assert err.param is not None and err.param.startswith(param.split(".")[0])
    assert err.param == param or err.param.startswith(param), (err.param, err.message)
    assert "surrogate" in err.message


@pytest.mark.parametrize(
    "field",
    [
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ],
)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_infinity_are_400(field, value):
    body = json.loads(json.dumps({"prompt": "x", field: value}))  # NaN / Infinity JSON literals
    err = refusal(CompletionRequest, body)
    assert err is not None and err.param == field


@pytest.mark.parametrize(
    "body, param",
    [
        ({"seed": 2**64 - 1, "n": 2}, "seed"),  # seed + n - 1 overflows the generator's 64 bits
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"n": 2**64}, "n"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"stop": "x" * 1025}, "stop"),
        ({"stop_token_ids": list(range(257))}, "stop_token_ids"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids"),
        ({"logit_bias": {"1": 5}}, "logit_bias"),
        ({"guided_json": 5}, "guided_json"),
        ({"guided_regex": "a", "structured_outputs": {"choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"rgx": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"cache_salt": "s" * 1025}, "cache_salt"),
    ],
)
def test_out_of_range_values_are_400_naming_the_field(body, param):
    err = refusal(CompletionRequest, {"prompt": "x", **body})
    assert err is not None and err.param == param, err and err.message


def test_chat_names_its_own_fields():
    err = refusal(ChatCompletionRequest, {"messages": USER, "max_completion_tokens": 0})
    assert err.param == "max_completion_tokens"
    err = refusal(ChatCompletionRequest, {"messages": USER, "logprobs": True, "top_logprobs": 21})
    assert err.param == "top_logprobs"
    err = refusal(ChatCompletionRequest, {"messages": USER, "function_call": "auto"})
    assert err.param == "function_call"
    err = refusal(
        ChatCompletionRequest, {"messages": USER, "prompt_logprobs": 1}
    )  # completions only
    assert err.param == "prompt_logprobs"


def test_too_many_prompts_is_400_before_anything_else():
    err = refusal(CompletionRequest, {"prompt": [[1]] * 100_000})
    assert err.param == "prompt" and str(MAX_PROMPTS) in err.message
    assert refusal(CompletionRequest, {"prompt": [[1]] * MAX_PROMPTS}) is None
    assert (
        refusal(CompletionRequest, {"prompt": [1] * 100_000}) is None
    )  # one long prompt: the context check's job


@pytest.mark.parametrize(
    "body",
    [
        {"seed": 2**64 - 2, "n": 2},
        {"seed": -(2**63)},
        {"temperature": 0},
        {"temperature": 2.0},
        {"stop": "é\U0001f600"},
        {"repetition_penalty": 1.3},
        {"top_k": -1},
        {"top_k": 2**40},
        {"guided_json": None},
        {"logit_bias": {}},
    ],
)
def test_edge_values_that_are_fine_still_pass(body):
    assert refusal(CompletionRequest, {"prompt": "é\U0001f600 x", **body}) is None


def test_prompt_scoring_requests_map_to_prompt_logprobs():
    """lm-evaluation-harness's loglikelihood request: echo, logprobs, max_tokens 0 (or 1)."""
    req = CompletionRequest.model_validate(
        {"prompt": [1, 2, 3], "echo": True, "logprobs": 1, "max_tokens": 0}
    )
    req.check()
    params = req.to_sampling_params()
    assert params.prompt_logprobs == 1 and params.max_tokens == 0 and params.logprobs == 1
    req = CompletionRequest.model_validate({"prompt": "x", "echo": True, "max_tokens": 0})
    req.check()
    assert req.to_sampling_params().prompt_logprobs == 0
    req = CompletionRequest.model_validate({"prompt": "x", "prompt_logprobs": 3, "max_tokens": 2})
    assert req.to_sampling_params().prompt_logprobs == 3
    assert (
        CompletionRequest.model_validate({"prompt": "x", "echo": True})
        .to_sampling_params()
        .prompt_logprobs
        is None
    )


def test_sampling_params_offline_errors_name_the_field():
    with pytest.raises(ParamError) as e:
        SamplingParams(temperature=math.nan)
    assert e.value.param == "temperature" and isinstance(e.value, ValueError)
    with pytest.raises(ParamError) as e:
        SamplingParams(ignore_eos="yes")
    assert e.value.param == "ignore_eos"
    assert (
        SamplingParams(temperature=1e-30).temperature == 0.01
    )  # tiny temperatures would overflow the logits
