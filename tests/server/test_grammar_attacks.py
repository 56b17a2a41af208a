"""Constraints built to break the native grammar compiler, sent to a real server while a victim
client asks the same greedy question over and over: each is a 400 naming its field (or, within
the limits, a correct answer), no message carries a native backtrace, the victim's answers equal
its idle answer, and the server is alive and healthy afterwards. Large compiles run on their own
threads: /health answers while several run."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from kvserve import sampling_params as sp
from tests.server.conftest import API_KEY, MAX_MODEL_LEN
from tests.unit.test_grammar_limits import chain_grammar, defs_chain, nested

AUTH = {"Authorization": f"Bearer {API_KEY}"}
USER = [{"role": "user", "content": "Pick one."}]


@pytest.fixture(scope="module")
def big_server(server_factory):
    """A server that takes 4 MiB bodies (the session's takes 64 KiB), so the constraints reach
    the compiler's limits rather than the body's."""
    srv = server_factory(
        [
            "--api-key",
            API_KEY,
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-body-bytes",
            "4MiB",
            "--kv-cache-memory",
            "128MiB",
            "--no-access-log",
        ]
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def url(big_server) -> str:
    return big_server.base_url


@pytest.fixture(scope="module")
def model(url) -> str:
    return httpx.get(f"{url}/v1/models", headers=AUTH, timeout=30).json()["data"][0]["id"]


def attacks(model: str) -> list[tuple[str, str, dict, str | None]]:
    """(name, path, body, the param of its 400, or None for a 200)."""
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"x": defs_chain(4000)}},
        },
    }
    deep_json = '{"type": "object", "properties": {"a": ' * 5000 + "{}" + "}}" * 5000
    chat = {"model": model, "messages": USER, "max_tokens": 4}
    cmpl = {"model": model, "prompt": "Pick one:", "max_tokens": 4}
    return [
        (
            "chain grammar x4000",
            "/v1/completions",
            {**cmpl, "guided_grammar": chain_grammar(4000)},
            "guided_grammar",
        ),
        (
            "response_format $defs chain x4000",
            "/v1/chat/completions",
            {
                **chat,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": defs_chain(4000)},
                },
            },
            "response_format",
        ),
        (
            "structured_outputs $defs chain x4000",
            "/v1/completions",
            {**cmpl, "structured_outputs": {"json": defs_chain(4000)}},
            "structured_outputs",
        ),
        (
            "tool parameters $defs chain x4000",
            "/v1/chat/completions",
            {**chat, "tools": [tool], "tool_choice": "required"},
            "tools",
        ),
        (
            "schema nested x300",
            "/v1/chat/completions",
            {
                **chat,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": nested(300)},
                },
            },
            "response_format",
        ),
        (
            "guided_json string nested x5000",
            "/v1/completions",
            {**cmpl, "guided_json": deep_json},
            "guided_json",
        ),
        (
            "guided_choice x100k",
            "/v1/completions",
            {**cmpl, "guided_choice": [f"c{i}" for i in range(100_000)]},
            "guided_choice",
        ),
        (
            "chain grammar within the limit",
            "/v1/completions",
            {**cmpl, "guided_grammar": chain_grammar(sp.MAX_GRAMMAR_RULES - 1)},
            None,
        ),
    ]


def test_grammar_attacks_are_400s_and_the_victim_is_untouched(url, big_server, model):
    ask = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    expected = httpx.post(f"{url}/v1/completions", json=ask, headers=AUTH, timeout=120).json()[
        "choices"
    ][0]["text"]
    answers: list[tuple[int, str]] = []
    stop = threading.Event()

    def victim():
        while not stop.is_set():
            r = httpx.post(f"{url}/v1/completions", json=ask, headers=AUTH, timeout=120)
            answers.append(
                (r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text)
            )

    thread = threading.Thread(target=victim)
    thread.start()
    try:
        for name, path, body, param in attacks(model):
            r = httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=120)
            if param is None:
                assert r.status_code == 200, (name, r.text[:500])
                continue
            assert r.status_code == 400, (name, r.status_code, r.text[:500])
            err = r.json()["error"]
            assert err["param"] == param, (name, err)
            assert "backtrace" not in err["message"] and "panic" not in err["message"], name
    finally:
        stop.set()
        thread.join(timeout=300)
    assert answers and all(a == (200, expected) for a in answers), answers
    assert big_server.proc.poll() is None
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200


def test_two_thousand_choices_answer_one_of_them(url, model):
    choices = [f"option {i}" for i in range(2000)]
    for _ in range(2):  # the second one from the cache
        r = httpx.post(
            f"{url}/v1/completions",
            headers=AUTH,
            timeout=120,
            json={
                "model": model,
                "prompt": "Pick an option:",
                "max_tokens": 8,
                "temperature": 0,
                "guided_choice": choices,
            },
        )
        assert r.status_code == 200, r.text[:500]
        assert r.json()["choices"][0]["text"] in choices


def test_health_answers_while_large_compiles_run(url, model):
    def big(i: int) -> dict:  # distinct, so none is a cache hit
        return {
            "model": model,
            "prompt": "x",
            "max_tokens": 1,
            "guided_json": json.dumps(
                {
                    "type": "object",
                    "properties": {
                        f"p{i}_{j}": {"type": "string", "description": "d" * 40}
                        for j in range(6000)
                    },
                }
            ),
        }

    results: list[int] = []
    threads = [
        threading.Thread(
            target=lambda i=i: results.append(
                httpx.post(
                    f"{url}/v1/completions", json=big(i), headers=AUTH, timeout=300
                ).status_code
            )
        )
        for i in range(4)
    ]
    for t in threads:
        t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    assert httpx.get(f"{url}/health", timeout=60).status_code == 200
    waited = time.monotonic() - t0
    for t in threads:
        t.join(timeout=600)
    assert len(results) == 4 and set(results) <= {200, 400}, results  # 400: past the matcher's row
    assert waited < 5.0, f"/health took {waited:.1f} s while schemas compiled"


@pytest.mark.parametrize(
    "body",
    [
        {"guided_regex": "a" * (sp.MAX_REGEX_BYTES + 1)},
        {"guided_choice": ["y" * 600_000, "z" * 600_000]},
    ],
)
def test_oversized_constraints_name_their_field(url, model, body):
    r = httpx.post(
        f"{url}/v1/completions",
        headers=AUTH,
        timeout=120,
        json={"model": model, "prompt": "x", "max_tokens": 1, **body},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(body)), r.text[:300]
