"""Malformed and out-of-range requests: each gets its 4xx with an OpenAI error body, never a 500,
and the server keeps serving afterwards."""

import httpx
import pytest

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def _c(**kw):
    return {"prompt": "hi", "max_tokens": 2, **kw}


def _m(**kw):
    return {"messages": USER, "max_tokens": 2, **kw}


# (name, path, json body or raw bytes, status, param the error names (None: not checked),
#  extra headers)
CASES = [
    ("malformed json", CMPL, b'{"prompt": "hi",', 400, None, {}),
    ("body not an object", CHAT, b"[1, 2]", 400, None, {}),
    ("empty body", CMPL, b"", 400, None, {}),
    ("missing prompt", CMPL, {"max_tokens": 2}, 400, "prompt", {}),
    ("missing messages", CHAT, {"max_tokens": 2}, 400, "messages", {}),
    ("empty messages", CHAT, _m(messages=[]), 400, "messages", {}),
    (
        "unknown role",
        CHAT,
        _m(messages=[{"role": "robot", "content": "x"}]),
        400,
        "messages.0.role",
        {},
    ),
    (
        "image content part",
        CHAT,
        _m(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                }
            ]
        ),
        400,
        "messages.0.content",
        {},
    ),
    ("unknown model", CHAT, _m(model="gpt-9"), 404, "model", {}),
    ("n < 1", CMPL, _c(n=0), 400, "n", {}),
    ("n too large", CMPL, _c(n=1000), 400, "n", {}),
    ("temperature < 0", CHAT, _m(temperature=-1), 400, "temperature", {}),
    ("top_p > 1", CMPL, _c(top_p=1.5), 400, "top_p", {}),
    ("top_p = 0", CMPL, _c(top_p=0), 400, "top_p", {}),
    ("max_tokens = 0", CMPL, _c(max_tokens=0), 400, "max_tokens", {}),
    ("max_tokens wrong type", CMPL, _c(max_tokens="ten"), 400, "max_tokens", {}),
    ("temperature wrong type", CHAT, _m(temperature="hot"), 400, "temperature", {}),
    ("presence_penalty out of range", CHAT, _m(presence_penalty=5), 400, "presence_penalty", {}),
    ("min_tokens > max_tokens", CMPL, _c(min_tokens=5), 400, "min_tokens", {}),
    ("logprobs > 20", CMPL, _c(logprobs=50), 400, "logprobs", {}),
    ("top_logprobs without logprobs", CHAT, _m(top_logprobs=3), 400, "top_logprobs", {}),
    ("too many stop strings", CMPL, _c(stop=[f"s{i}" for i in range(20)]), 400, "stop", {}),
    ("stop wrong type", CMPL, _c(stop=5), 400, "stop", {}),
    (
        "prompt + max_tokens over the context",
        CMPL,
        _c(prompt=[1] * 1000, max_tokens=100),
        400,
        "prompt",
        {},
    ),
    ("max_tokens over the context", CHAT, _m(max_tokens=10**6), 400, "messages", {}),
    ("prompt over the context", CMPL, _c(prompt=[1] * 1100), 400, "prompt", {}),
    ("token id outside the vocabulary", CMPL, _c(prompt=[10**7]), 400, None, {}),
    ("empty token list", CMPL, _c(prompt=[]), 400, "prompt", {}),
    (
        "stream_options without stream",
        CMPL,
        _c(stream_options={"include_usage": True}),
        400,
        "stream_options",
        {},
    ),
    (
        "unknown response_format type",
        CHAT,
        _m(response_format={"type": "xml"}),
        400,
        "response_format.type",
        {},
    ),
    (
        "malformed tools",
        CHAT,
        _m(tools=[{"type": "function", "function": {"name": ""}}]),
        400,
        "tools",
        {},
    ),
    (
        "tool_calls function not an object",
        CHAT,
        _m(messages=[*USER, {"role": "assistant", "tool_calls": [{"id": "c", "function": 5}]}]),
        400,
        "messages.1.tool_calls.0.function",
        {},
    ),
    (
        "tool_calls arguments not a string",
        CHAT,
        _m(
            messages=[
                *USER,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": {"a": 1}},
                        }
                    ],
                },
            ]
        ),
        400,
        "messages.1.tool_calls.0.function.arguments",
        {},
    ),
    (
        "tool message answering no call",
        CHAT,
        _m(messages=[*USER, {"role": "tool", "tool_call_id": "c1", "content": "42"}]),
        400,
        "messages.1.role",
        {},
    ),
    ("max_tokens 0 without echo", CMPL, _c(max_tokens=0), 400, "max_tokens", {}),
    ("seed wrong type", CMPL, _c(seed="abc"), 400, "seed", {}),
    ("missing API key", CMPL, _c(), 401, None, {"Authorization": ""}),
    ("wrong API key", CHAT, _m(), 401, None, {"Authorization": "Bearer nope"}),
    ("body over the size limit", CMPL, _c(prompt="x" * 100_000), 413, None, {}),
    ("no such route", "/v1/embeddings", {"input": "hi"}, 404, None, {}),
]


@pytest.mark.parametrize(
    "name, path, body, status, param, headers", CASES, ids=[c[0] for c in CASES]
)
def test_bad_input(server, auth, name, path, body, status, param, headers):
    send = (
        {"content": body, "headers": {"Content-Type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    r = httpx.post(
        f"{server}{path}",
        headers={**auth, **send.pop("headers", {}), **headers},
        timeout=60,
        **send,
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (
        set(err) == {"message", "type", "param", "code"}
        and isinstance(err["message"], str)
        and err["message"]
    )
    if param is not None:
        assert err["param"] == param, err
    assert err["type"] == (
        "invalid_request_error" if status in (400, 401, 404, 413) else err["type"]
    )


def test_context_error_has_the_numbers(server, auth):
    r = httpx.post(f"{server}{CMPL}", headers=auth, json=_c(prompt=[1] * 1000, max_tokens=100))
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert "1024" in err["message"] and "1100" in err["message"] and "1000" in err["message"]


def test_wrong_method_and_unprotected_routes(server, auth):
    r = httpx.get(f"{server}{CMPL}")
    assert r.status_code in (401, 405)  # the key is checked first on /v1
    r = httpx.delete(f"{server}/health")
    assert r.status_code == 405 and "error" in r.json()
    assert httpx.get(f"{server}/health").status_code == 200  # only /health needs no key
    assert httpx.get(f"{server}/metrics").status_code == 401
    assert httpx.get(f"{server}/metrics", headers=auth).status_code == 200


def test_still_serving_after_bad_input(client, model_name):
    for body in (b"{", b"null", b'{"prompt": {"a": 1}}'):
        httpx.post(
            f"{client.base_url}completions",
            content=body,
            headers={
                "Authorization": f"Bearer {client.api_key}",
                "Content-Type": "application/json",
            },
        )
    r = client.chat.completions.create(model=model_name, messages=USER, max_tokens=4)
    assert r.choices[0].message.content is not None and r.usage.completion_tokens >= 1
