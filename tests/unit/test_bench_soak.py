"""`kvserve bench soak` without a server: the workload it builds, how it judges answers, its
report."""

import json
import math
import random
from pathlib import Path

import pytest

from kvserve.bench import report, soak
from kvserve.bench.soak import BAD, CHAT, CMPL, DISCONNECT, GOOD, Case

VOCAB = 1000
CTX = soak.SoakContext(
    model="m",
    vocab_size=VOCAB,
    prompt_ids=[list(range(10, 30))] * 3,
    texts=["hello there", "a longer prompt"],
    random_ids=[list(range(40, 60))],
    max_body_bytes=4096,
)


def strings_in(obj):
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from strings_in(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from strings_in(v)


def numbers_in(obj):
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from numbers_in(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from numbers_in(v)


def has_lone_surrogate(obj) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for s in strings_in(obj) for c in s)


def every_variant(category: str):
    for seed in range(6):
        yield from soak.attack_variants(category, random.Random(seed), CTX)


# What the server's JSON parser (Starlette: json.loads of the body) makes of each category, and
# what it must find inside.
PARSED = {
    "surrogate": has_lone_surrogate,
    "nonfinite": lambda b: any(
        isinstance(x, float) and not math.isfinite(x) for x in numbers_in(b)
    ),
    "huge-int": lambda b: (
        any(x >= 2**63 or x < -(2**63) for x in numbers_in(b))
        or (b.get("seed") == 2**64 - 1 and b.get("n") == 2)
    ),
    "negative": lambda b: any(x < 0 for x in numbers_in(b)),
    "oov": lambda b: any(not 0 <= x < VOCAB for x in numbers_in(b["prompt"])),
    "stop-ids": lambda b: len(b["stop_token_ids"]) == 100_000,
    "messages": lambda b: (
        b["messages"] == []
        or any(m.get("role") not in ("user", "system", "assistant") for m in b["messages"])
    ),
    "wrong-type": lambda b: True,
}


@pytest.mark.parametrize("category", sorted(PARSED))
def test_attack_bodies_parse_and_carry_their_poison(category):
    for variant, path, body, stream in every_variant(category):
        parsed = json.loads(body)  # the server's parser takes it: validation must refuse it
        assert PARSED[category](parsed), (category, variant, body[:200])
        assert path in (CMPL, CHAT, "/tokenize")
        assert stream == (isinstance(parsed, dict) and parsed.get("stream") is True)


def test_surrogates_are_json_escapes_not_raw_bytes():
    for variant, _, body, _ in every_variant("surrogate"):
        assert body.isascii() and b"\\ud" in body.lower(), variant


def test_nonfinite_numbers_are_bare_literals():
    for variant, _, body, _ in every_variant("nonfinite"):
        assert any(lit in body for lit in (b"NaN", b"Infinity")), variant


def test_malformed_bodies_are_refused_by_the_json_parser():
    variants = list(every_variant("malformed"))
    assert len({v for v, *_ in variants}) >= 6
    for variant, _, body, _ in variants:
        with pytest.raises(ValueError):  # JSONDecodeError and UnicodeDecodeError alike
            json.loads(body)


def test_oversized_bodies_parse_but_exceed_the_limit():
    for variant, _, body, _ in every_variant("oversize"):
        assert len(body) > CTX.max_body_bytes
        json.loads(body)


def test_every_category_is_tested():
    assert set(soak.ATTACKS) == set(PARSED) | {
        "malformed",
        "oversize",
        "grammar",
        "tool-calls",
        "kv-handover",
    }


def test_grammar_attacks_carry_their_chains():
    variants = {v: json.loads(body) for v, _, body, _ in every_variant("grammar")}
    assert len(variants) == 5
    for variant, body in variants.items():
        if "guided_grammar" in body:
            assert body["guided_grammar"].count("\n") == soak.CHAIN_LINKS
        elif "tools" in body:
            assert body["tool_choice"] == "required"
            defs = body["tools"][0]["function"]["parameters"]["properties"]["x"]["$defs"]
            assert len(defs) == soak.CHAIN_LINKS
        elif "guided_json" in body:
            assert body["guided_json"].count("{") == 2 * soak.DEEP_JSON_LEVELS + 1
        else:
            schema = body["response_format"]["json_schema"]["schema"]
            assert len(schema.get("$defs", {})) == soak.CHAIN_LINKS or "properties" in schema, (
                variant
            )


def test_tool_call_attacks_are_chats_with_a_bad_tool_turn():
    for variant, path, body, _ in every_variant("tool-calls"):
        messages = json.loads(body)["messages"]
        assert path == CHAT
        bad = [m for m in messages if "tool_calls" in m or m["role"] == "tool"]
        assert bad, variant


def test_kv_handover_attacks_target_its_endpoints():
    variants = list(every_variant("kv-handover"))
    assert {path for _, path, _, _ in variants} == {"/v1/kv/import", "/v1/kv/prefill"}
    made_up = next(body for v, _, body, _ in variants if v == "import made-up KV")
    n = int.from_bytes(made_up[4:8], "little")
    header = json.loads(made_up[8 : 8 + n])
    assert made_up[:4] == b"KVX1" and len(header["token_ids"]) == 16


def test_workload_shares_are_exact_and_seeded():
    cases = list(soak.generate_cases(200, CTX, seed=3, disconnect_fraction=0.1, bad_fraction=0.25))
    kinds = [c.kind for c in cases]
    assert (kinds.count(BAD), kinds.count(DISCONNECT), kinds.count(GOOD)) == (50, 20, 130)
    again = list(soak.generate_cases(200, CTX, seed=3, disconnect_fraction=0.1, bad_fraction=0.25))
    assert [c.body for c in again] == [c.body for c in cases]


def test_well_formed_requests_are_strict_json_with_the_mix():
    cases = [c for c in soak.generate_cases(400, CTX, seed=0) if c.kind != BAD]
    bodies = [json.loads(c.body, parse_constant=pytest.fail) for c in cases]
    assert {c.path for c in cases} == {CMPL, CHAT}
    assert {c.stream for c in cases} == {True, False}
    assert any(b.get("n") == 2 for b in bodies) and any("seed" in b for b in bodies)
    assert any("logprobs" in b for b in bodies) and any("stop" in b for b in bodies)
    for c, b in zip(cases, bodies):
        assert b["max_tokens"] >= 1 and c.n_choices == b.get("n", 1)
        assert not has_lone_surrogate(b)
    drops = [c for c in cases if c.kind == DISCONNECT]
    assert {c.drop_after for c in drops} >= {soak.DROP_BEFORE_HEADERS, 0}
    assert all(c.stream for c in drops if c.drop_after != soak.DROP_BEFORE_HEADERS)


def test_attacks_can_be_chosen():
    cases = [
        c
        for c in soak.generate_cases(100, CTX, seed=0, bad_fraction=0.5, categories=["nonfinite"])
        if c.kind == BAD
    ]
    assert cases and all(c.name.startswith("nonfinite: ") for c in cases)


# ---- classification ----


def good(stream=False, n=1, path=CMPL, kind=GOOD):
    return Case(kind, "x", path, b"{}", stream=stream, n_choices=n)


def completion_body(n=1, text="hi", finish="length"):
    return json.dumps(
        {
            "choices": [{"index": i, "text": text, "finish_reason": finish} for i in range(n)],
            "usage": {"completion_tokens": 1},
        }
    ).encode()


def sse(*chunks, done=True):
    lines = [f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n" for c in chunks]
    return ("".join(lines) + ("data: [DONE]\n\n" if done else "")).encode()


def chunk(index=0, text="a", finish=None):
    return {"choices": [{"index": index, "text": text, "finish_reason": finish}]}


ERROR = json.dumps(
    {"error": {"message": "no", "type": "invalid_request_error", "param": "x", "code": None}}
)


@pytest.mark.parametrize(
    "case, status, body, verdict",
    [
        (good(), 200, completion_body(), soak.OK),
        (good(n=2), 200, completion_body(n=2), soak.OK),
        (good(n=2), 200, completion_body(n=1), soak.INVALID_BODY),
        (good(), 200, completion_body(finish=None), soak.INVALID_BODY),
        (
            good(),
            200,
            b'{"choices": [{"index": 0, "text": "a", "finish_reason": "stop", "logprobs": NaN}], '
            b'"usage": {}}',
            soak.INVALID_BODY,
        ),
        (
            good(path=CHAT),
            200,
            json.dumps(
                {
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "hi"},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {},
                }
            ).encode(),
            soak.OK,
        ),
        (good(path=CHAT), 200, completion_body(), soak.INVALID_BODY),  # no message
        (good(), 500, b'{"error": {}}', soak.SERVER_ERROR),
        (good(), 503, b"", soak.SERVER_ERROR),
        (good(), 429, ERROR.encode(), soak.WRONG_STATUS),
        (good(), 400, ERROR.encode(), soak.WRONG_STATUS),
        (good(stream=True), 200, sse(chunk(), chunk(text="", finish="stop")), soak.OK),
        (
            good(stream=True, n=2),
            200,
            sse(chunk(0, finish="stop"), chunk(1, finish="length")),
            soak.OK,
        ),
        (good(stream=True, n=2), 200, sse(chunk(0, finish="stop")), soak.INVALID_BODY),
        (good(stream=True), 200, sse(chunk(), chunk(finish="stop"), done=False), soak.INVALID_BODY),
        (
            good(stream=True),
            200,
            sse(
                '{"choices": [{"index": 0, "text": "a", "finish_reason": "stop", '
                '"logprobs": {"token_logprobs": [NaN]}}]}'
            ),
            soak.INVALID_BODY,
        ),
        (
            good(stream=True),
            200,
            sse(chunk(), {"error": {"message": "stream failed", "type": "server_error"}}),
            soak.SERVER_ERROR,
        ),
        (
            good(stream=True),
            200,
            sse(chunk(), {"choices": [], "usage": {"completion_tokens": 1}}, chunk(finish="stop")),
            soak.OK,
        ),
        (good(kind=DISCONNECT), 200, completion_body(), soak.DROPPED),
        (good(kind=DISCONNECT), 502, b"", soak.SERVER_ERROR),
        (Case(BAD, "x", CMPL, b""), 400, ERROR.encode(), soak.OK),
        (Case(BAD, "x", CMPL, b""), 413, ERROR.encode(), soak.OK),
        (Case(BAD, "x", CMPL, b""), 400, b'{"detail": "bad"}', soak.INVALID_BODY),
        (Case(BAD, "x", CMPL, b""), 400, b"oops", soak.INVALID_BODY),
        (Case(BAD, "x", CMPL, b""), 429, ERROR.encode(), soak.WRONG_STATUS),
        (Case(BAD, "x", CMPL, b""), 200, completion_body(), soak.WRONG_STATUS),
        (Case(BAD, "x", CMPL, b""), 500, ERROR.encode(), soak.SERVER_ERROR),
    ],
)
def test_classify(case, status, body, verdict):
    out = soak.classify(case, status, body)
    assert (out.verdict, out.status, out.kind) == (verdict, status, case.kind), out.detail


def outcomes(*spec):
    return [
        soak.Outcome(kind, name, verdict, status)
        for kind, name, verdict, status, count in spec
        for _ in range(count)
    ]


def idle_server(**kw):
    base = dict(
        health=200,
        process_alive=True,
        idle=True,
        rss_start=100 * 2**20,
        rss_end=103 * 2**20,
        metrics_start={"kvserve:engine_restarts_total": 0.0},
        metrics_end={"kvserve:engine_restarts_total": 0.0, "kvserve:kv_cache_blocks_used": 0.0},
    )
    return soak.ServerObservations(**{**base, **kw})


def failed_checks(by_class, server):
    return [c["check"] for c in soak.invariants(by_class, server, 5.0) if c["ok"] is False]


def test_invariants_pass_on_a_clean_run_and_report_bad_input_misanswers():
    by_class, by_name = soak.tally(
        outcomes(
            (GOOD, "chat", soak.OK, 200, 8),
            (DISCONNECT, "drop", soak.DROPPED, 200, 2),
            (BAD, "nonfinite: top_p=NaN", soak.SERVER_ERROR, 500, 3),
            (BAD, "malformed: truncated", soak.OK, 400, 1),
        )
    )
    assert failed_checks(by_class, idle_server()) == []  # bad inputs' 5xx are reported, not gated
    assert by_class[BAD]["sent"] == 4 and by_class[BAD][soak.SERVER_ERROR] == 3
    (row,) = soak.misanswered(by_name)
    assert row["name"] == "nonfinite: top_p=NaN" and row["statuses"] == {"500": 3}
    assert "1/4 answered 4xx" in soak.bad_input_summary(by_class)


@pytest.mark.parametrize(
    "spec, server, failing",
    [
        ([(GOOD, "chat", soak.SERVER_ERROR, 500, 1)], {}, "5xx on well-formed requests"),
        ([(DISCONNECT, "drop", soak.SERVER_ERROR, 503, 1)], {}, "5xx on well-formed requests"),
        ([(GOOD, "chat", soak.CONN_ERROR, None, 1)], {}, "other failures of well-formed requests"),
        (
            [],
            {
                "metrics_end": {
                    "kvserve:engine_restarts_total": 1.0,
                    "kvserve:kv_cache_blocks_used": 0.0,
                }
            },
            "engine restarts",
        ),
        (
            [],
            {
                "metrics_end": {
                    "kvserve:engine_restarts_total": 0.0,
                    "kvserve:kv_cache_blocks_used": 3.0,
                }
            },
            "leaked KV blocks (in use when idle)",
        ),
        ([], {"rss_end": 106 * 2**20}, "RSS drift % (<= 5)"),
        ([], {"health": 503}, "server alive, /health 200"),
        ([], {"process_alive": False}, "server alive, /health 200"),
        ([], {"idle": False}, "idle at the end (0 running, 0 waiting)"),
    ],
)
def test_each_invariant_fails_alone(spec, server, failing):
    by_class, _ = soak.tally(outcomes((GOOD, "chat", soak.OK, 200, 5), *spec))
    assert failed_checks(by_class, idle_server(**server)) == [failing]


def test_unknown_when_the_server_does_not_say():
    by_class, _ = soak.tally(outcomes((GOOD, "chat", soak.OK, 200, 1)))
    checks = soak.invariants(by_class, soak.ServerObservations(health=200, idle=True), 5.0)
    unknown = {c["check"] for c in checks if c["ok"] is None}
    assert unknown == {
        "engine restarts",
        "leaked KV blocks (in use when idle)",
        "RSS drift % (<= 5)",
    }


def test_body_limit_comes_from_the_server_flags():
    from types import SimpleNamespace as NS

    assert (
        soak.body_limit(NS(max_body_bytes=None, server_args="--threads 1 --max-body-bytes 64KiB"))
        == 65536
    )
    assert soak.body_limit(NS(max_body_bytes=None, server_args="--max-body-bytes=1MiB")) == 2**20
    assert soak.body_limit(NS(max_body_bytes="3000", server_args="--max-body-bytes 1MiB")) == 3000
    assert soak.body_limit(NS(max_body_bytes=None, server_args="")) == 2 * 2**20


# ---- the report page ----


def soak_result(passed: bool) -> dict:
    by_class, by_name = soak.tally(
        outcomes(
            (GOOD, "chat stream", soak.OK, 200, 7),
            (DISCONNECT, "drop after chunks", soak.DROPPED, 200, 2),
            (BAD, "surrogate: cache_salt", soak.SERVER_ERROR, 500, 1),
        )
    )
    server = idle_server(**({} if passed else {"rss_end": 120 * 2**20}))
    checks = soak.invariants(by_class, server, 5.0)
    run = {
        "engine": "kvserve",
        "num_requests": 10,
        "warmup": 2,
        "duration_s": 4.0,
        "requests_per_s": 2.5,
        "classes": by_class,
        "bad_inputs": soak.bad_input_summary(by_class),
        "misanswered": soak.misanswered(by_name),
        "names": list(by_name.values()),
        "server": {**vars(server), "rss_drift_pct": server.rss_drift_pct(), "restarts": 0.0},
        "invariants": checks,
        "passed": all(c["ok"] is not False for c in checks),
    }
    return json.loads(
        json.dumps(
            {
                "kind": "soak",
                "command": "kvserve bench soak --num-requests 10",
                "date": "2026-01-01T00:00:00",
                "args": {},
                "machine": {"cpu": "test cpu", "cores": 2},
                "versions": {"kvserve_commit": "abc"},
                "workload": {
                    "num_requests": 10,
                    "concurrency": 4,
                    "disconnect_fraction": 0.2,
                    "bad_fraction": 0.1,
                    "attacks": "surrogate",
                    "seed": 0,
                },
                "runs": [run],
            }
        )
    )


def test_report_renders_a_soak_section(tmp_path: Path):
    page = report.build_page([(tmp_path / "soak-10.json", soak_result(passed=True))], tmp_path)
    assert "- `soak-10`: `kvserve bench soak --num-requests 10`" in page
    assert "| 10 requests, 4 at a time, 20% dropped, 10% bad | all hold |" in page


def test_report_says_when_an_invariant_failed(tmp_path: Path):
    page = report.build_page([(tmp_path / "soak-10.json", soak_result(passed=False))], tmp_path)
    assert "| failed: RSS drift % (<= 5) |" in page


def test_transport_errors_name_their_cause():
    try:
        try:
            raise ConnectionResetError(104, "Connection reset by peer")
        except ConnectionResetError as e:
            raise RuntimeError() from e
    except RuntimeError as e:
        assert (
            soak.transport_error(e)
            == "RuntimeError <- ConnectionResetError: [Errno 104] Connection reset by peer"
        )
