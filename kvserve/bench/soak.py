"""`kvserve bench soak`: many requests, some dropped, some hostile; the server must stay whole.

Sends --num-requests requests, --concurrency at a time, to an OpenAI-compatible server (started
here, or --url): well-formed completions and chats (streaming or not, short prompts, small
max_tokens, some n=2, seed, logprobs, stop); a --disconnect-fraction of well-formed requests the
client drops before the headers, after them or after a few chunks; and a --bad-fraction of bad
requests drawn from a catalogue of attacks (lone surrogates, NaN and Infinity, huge ints, wrong
types, negative max_tokens, out-of-vocabulary ids, 100k stop ids, empty messages, unknown roles,
malformed JSON, oversized bodies, constraints past the grammar compiler's limits, tool calls of the
wrong shape, writes into the KV handover's endpoints).

Every answer is classified: a well-formed request must get 200 with a valid body, or a complete
SSE stream ending in [DONE] whose every data line is strict JSON (no NaN); a bad one must get a
4xx (not 429) with an OpenAI error body; a dropped one is not checked beyond a 5xx before the drop.
At the end it waits for the server to go idle and checks the invariants: no engine restart and
/health ok, no KV blocks left in use, no 5xx and no other failure of a well-formed request, the
server's RSS (after the first --warmup requests, then at the end) grown by at most
--max-rss-drift percent. The exit code is 1 when one fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import shlex
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from kvserve.bench import common
from kvserve.bench.loadgen import auth_headers
from kvserve.bench.throughput import add_output_args

GOOD, DISCONNECT, BAD = "well-formed", "disconnect", "bad"
CLASSES = (GOOD, DISCONNECT, BAD)
OK, DROPPED = "ok", "dropped"
SERVER_ERROR, WRONG_STATUS, INVALID_BODY, CONN_ERROR = (
    "5xx",
    "wrong status",
    "invalid body",
    "connection error",
)
VERDICTS = (OK, DROPPED, SERVER_ERROR, WRONG_STATUS, INVALID_BODY, CONN_ERROR)
FAILURES = (SERVER_ERROR, WRONG_STATUS, INVALID_BODY, CONN_ERROR)

CMPL, CHAT, TOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize"
JSON_HEADERS = {"content-type": "application/json"}
FINISH_REASONS = ("stop", "length")
STOPS = ["\n", [".", "!"], "the", ["\n\n", "##"]]
DROP_BEFORE_HEADERS = -1
REPORTED_METRICS = (
    "kvserve:num_requests_running",
    "kvserve:num_requests_waiting",
    "kvserve:kv_cache_blocks_used",
    "kvserve:kv_cache_blocks_total",
    "kvserve:kv_cache_usage_perc",
    "kvserve:engine_restarts_total",
    "kvserve:request_failures_total",
)


# ---- what is sent and what came back ----


@dataclass
class Case:
    """One request of the soak: its class, what it is (the row it is counted under), its bytes."""

    kind: str
    name: str
    path: str
    body: bytes
    stream: bool = False
    n_choices: int = 1
    drop_after: int | None = (
        None  # disconnect: data lines read before closing (-1: before the headers)
    )
    drop_delay: float = 0.0  # disconnect before the headers: seconds after sending


@dataclass
class Outcome:
    kind: str
    name: str
    verdict: str
    status: int | None = None
    detail: str = ""


def dumps(obj) -> bytes:
    """JSON as a sloppy client writes it: lone surrogates as \\udXXX escapes, NaN and Infinity as
    bare literals."""
    return json.dumps(obj, ensure_ascii=True, allow_nan=True).encode()


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def strict_json(text: str | bytes):
    """json.loads that refuses NaN, Infinity and -Infinity."""
    return json.loads(text, parse_constant=_reject_constant)


# ---- classification (pure) ----


def check_error_body(body: bytes) -> str | None:
    """None when `body` is an OpenAI error body {"error": {"message", "type", "param", "code"}}."""
    try:
        err = strict_json(body).get("error")
    except (ValueError, AttributeError):
        return f"not a JSON object: {body[:120]!r}"
    if not isinstance(err, dict) or not {"message", "type", "param", "code"} <= err.keys():
        return f"no OpenAI error object: {body[:120]!r}"
    return None if isinstance(err["message"], str) else "error.message is not a string"


def check_choice(choice, chat: bool, streamed: bool) -> str | None:
    if not isinstance(choice, dict) or not isinstance(choice.get("index"), int):
        return f"malformed choice: {str(choice)[:120]}"
    if streamed:
        part = choice.get("delta") if chat else choice.get("text")
        return (
            None
            if isinstance(part, dict if chat else str)
            else f"malformed chunk choice: {str(choice)[:120]}"
        )
    text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
    if not isinstance(text, str):
        return f"choice without text: {str(choice)[:120]}"
    return (
        None
        if choice.get("finish_reason") in FINISH_REASONS
        else f"finish_reason {choice.get('finish_reason')!r}"
    )


def check_completion(body: bytes, n_choices: int, chat: bool) -> str | None:
    """None when a non-streaming answer is strict JSON with `n_choices` finished choices and
    usage."""
    try:
        obj = strict_json(body)
    except ValueError as e:
        return f"not strict JSON: {e}"
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list) or len(choices) != n_choices:
        return f"expected {n_choices} choices: {body[:120]!r}"
    problems = [p for c in choices if (p := check_choice(c, chat, streamed=False))]
    if problems:
        return problems[0]
    return None if isinstance(obj.get("usage"), dict) else "no usage"


def sse_data(text: str) -> list[str]:
    """The payloads of an SSE stream's `data:` lines, in order."""
    return [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]


def check_stream(text: str, n_choices: int, chat: bool) -> tuple[str, str] | None:
    """None when the stream is complete: strict JSON chunks, every choice finished, then [DONE].
    Otherwise (verdict, detail): an error event is the stream's form of a 5xx."""
    data = sse_data(text)
    if not data or data[-1] != "[DONE]" or data.count("[DONE]") != 1:
        return INVALID_BODY, "stream does not end in exactly one [DONE]"
    finished: set[int] = set()
    for payload in data[:-1]:
        try:
            chunk = strict_json(payload)
        except ValueError as e:
            return INVALID_BODY, f"chunk not strict JSON ({e}): {payload[:120]}"
        if not isinstance(chunk, dict):
            return INVALID_BODY, f"chunk not an object: {payload[:120]}"
        if "error" in chunk:
            return SERVER_ERROR, f"error event: {str(chunk['error'])[:160]}"
        for choice in chunk.get("choices") or []:
            if problem := check_choice(choice, chat, streamed=True):
                return INVALID_BODY, problem
            if choice.get("finish_reason") in FINISH_REASONS:
                finished.add(choice["index"])
    if finished != set(range(n_choices)):
        return INVALID_BODY, f"choices finished: {sorted(finished)} of {n_choices}"
    return None


def classify(case: Case, status: int, body: bytes) -> Outcome:
    """The verdict on one complete answer (status and body) to `case`."""

    def outcome(verdict: str, detail: str = "") -> Outcome:
        return Outcome(case.kind, case.name, verdict, status, detail)

    snippet = body[:160].decode(errors="replace")
    if status >= 500:
        return outcome(SERVER_ERROR, snippet)
    if case.kind == BAD:
        if status < 400 or status == 429:
            return outcome(WRONG_STATUS, f"bad input answered {status}: {snippet}")
        problem = check_error_body(body)
        return outcome(INVALID_BODY, problem) if problem else outcome(OK)
    if status != 200:
        return outcome(WRONG_STATUS, snippet)
    chat = case.path == CHAT
    if case.stream:
        problem = check_stream(body.decode(errors="replace"), case.n_choices, chat)
        return outcome(*problem) if problem else outcome(OK if case.kind == GOOD else DROPPED)
    problem = check_completion(body, case.n_choices, chat)
    if problem:
        return outcome(INVALID_BODY, problem)
    return outcome(OK if case.kind == GOOD else DROPPED)


# ---- the workload (pure, seeded) ----


@dataclass
class SoakContext:
    """What requests are made of: the served model's name, its vocabulary size, short prompts
    (token ids and the same as text), and the server's body size limit."""

    model: str
    vocab_size: int
    prompt_ids: list[list[int]]
    texts: list[str]
    random_ids: list[list[int]]
    max_body_bytes: int


def sampling_extras(rng: random.Random, ctx: SoakContext, chat: bool) -> dict:
    """Optional fields of a well-formed request: n=2, seed, logprobs, stop strings and ids."""
    extras: dict = {"temperature": rng.choice([0.0, 0.7, 1.0])}
    if rng.random() < 0.2:
        extras["n"] = 2
    if rng.random() < 0.3:
        extras["seed"] = rng.randrange(2**31)
    if rng.random() < 0.2:
        extras.update(
            {"logprobs": True, "top_logprobs": rng.randint(0, 5)}
            if chat
            else {"logprobs": rng.randint(0, 5)}
        )
    if rng.random() < 0.2:
        extras["stop"] = rng.choice(STOPS)
    if rng.random() < 0.1:
        extras["stop_token_ids"] = [rng.randrange(ctx.vocab_size) for _ in range(rng.randint(1, 4))]
    return extras


def prompt_fields(rng: random.Random, ctx: SoakContext, chat: bool) -> dict:
    if chat:
        messages = [{"role": "user", "content": rng.choice(ctx.texts)}]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": "Answer briefly."})
        return {"messages": messages}
    source = rng.choice([ctx.prompt_ids, ctx.texts, ctx.random_ids])
    return {"prompt": rng.choice(source)}


def well_formed_body(
    rng: random.Random, ctx: SoakContext, chat: bool, stream: bool, max_tokens: int
) -> dict:
    body = {
        "model": ctx.model,
        "max_tokens": max_tokens,
        "stream": stream,
        **prompt_fields(rng, ctx, chat),
        **sampling_extras(rng, ctx, chat),
    }
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return body


def good_case(rng: random.Random, ctx: SoakContext) -> Case:
    chat, stream = rng.random() < 0.5, rng.random() < 0.5
    body = well_formed_body(rng, ctx, chat, stream, rng.randint(1, 16))
    name = ("chat" if chat else "completions") + (" stream" if stream else "")
    return Case(GOOD, name, CHAT if chat else CMPL, dumps(body), stream, body.get("n", 1))


def disconnect_case(rng: random.Random, ctx: SoakContext) -> Case:
    """A long-enough well-formed request the client drops: before the headers (streaming or not),
    right after them, or after 1-8 chunks."""
    chat = rng.random() < 0.5
    mode = rng.choice(["before headers", "after headers", "after chunks", "after chunks"])
    stream = mode != "before headers" or rng.random() < 0.5
    body = well_formed_body(rng, ctx, chat, stream, rng.randint(16, 64))
    body["ignore_eos"] = True
    drop_after = {"before headers": DROP_BEFORE_HEADERS, "after headers": 0}.get(
        mode, rng.randint(1, 8)
    )
    return Case(
        DISCONNECT,
        f"drop {mode}",
        CHAT if chat else CMPL,
        dumps(body),
        stream,
        body.get("n", 1),
        drop_after=drop_after,
        drop_delay=rng.uniform(0.0, 0.2),
    )


# The attacks: category -> variants, each (variant, path, body). A body is a dict (sent with dumps)
# or raw bytes. Every variant is answered 4xx by a hardened server.


def lone_surrogate(rng: random.Random) -> str:
    return "x" + rng.choice(["\ud800", "\udbff", "\udc00", "\udfff", "\ud83d"]) + "y"


def surrogate_attacks(rng: random.Random, ctx: SoakContext) -> list[tuple[str, str, dict]]:
    s, ids = lone_surrogate(rng), rng.choice(ctx.prompt_ids)  # ids: at least one full KV block
    user = [{"role": "user", "content": "hi"}]
    return [
        ("prompt", CMPL, {"prompt": rng.choice(ctx.texts) + s, "max_tokens": 4}),
        ("prompt list", CMPL, {"prompt": ["hi", s], "max_tokens": 4}),
        ("message content", CHAT, {"messages": [{"role": "user", "content": s}], "max_tokens": 4}),
        (
            "message content part",
            CHAT,
            {
                "messages": [{"role": "user", "content": [{"type": "text", "text": s}]}],
                "max_tokens": 4,
            },
        ),
        ("model", CMPL, {"model": s, "prompt": "hi", "max_tokens": 4}),
        ("cache_salt", CMPL, {"prompt": ids, "cache_salt": s, "max_tokens": 4}),
        ("cache_salt chat", CHAT, {"messages": user, "cache_salt": s, "max_tokens": 4}),
        ("stop", CMPL, {"prompt": "hi", "stop": [s], "max_tokens": 4}),
        ("stop stream", CHAT, {"messages": user, "stop": s, "max_tokens": 4, "stream": True}),
        ("/tokenize prompt", TOKENIZE, {"prompt": s}),
    ]


def nonfinite_attacks(rng: random.Random, ctx: SoakContext) -> list[tuple[str, str, dict]]:
    value = rng.choice([math.nan, math.inf, -math.inf])
    text = "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    user = [{"role": "user", "content": "hi"}]
    return [
        (f"temperature={text}", CMPL, {"prompt": "hi", "temperature": value, "max_tokens": 4}),
        (
            f"temperature={text} logprobs",
            CMPL,
            {"prompt": "hi", "temperature": value, "logprobs": 2, "max_tokens": 4},
        ),
        (
            f"temperature={text} stream",
            CHAT,
            {"messages": user, "temperature": value, "max_tokens": 4, "stream": True},
        ),
        (f"top_p={text}", CMPL, {"prompt": "hi", "top_p": value, "max_tokens": 4}),
        (
            f"repetition_penalty={text}",
            CHAT,
            {"messages": user, "repetition_penalty": value, "max_tokens": 4},
        ),
        (
            f"repetition_penalty={text} logprobs",
            CHAT,
            {
                "messages": user,
                "repetition_penalty": value,
                "logprobs": True,
                "top_logprobs": 2,
                "max_tokens": 4,
            },
        ),
        (
            f"presence_penalty={text}",
            CMPL,
            {"prompt": "hi", "presence_penalty": value, "max_tokens": 4},
        ),
        (f"min_p={text}", CMPL, {"prompt": "hi", "min_p": value, "max_tokens": 4}),
    ]


def huge_int_attacks(rng: random.Random, ctx: SoakContext) -> list[tuple[str, str, dict]]:
    return [
        ("seed=2**64", CMPL, {"prompt": "hi", "seed": 2**64, "max_tokens": 4}),
        ("seed=2**64-1 n=2", CMPL, {"prompt": "hi", "seed": 2**64 - 1, "n": 2, "max_tokens": 4}),
        (
            "seed=2**64-1 n=2 chat",
            CHAT,
            {
                "messages": [{"role": "user", "content": "hi"}],
                "seed": 2**64 - 1,
                "n": 2,
                "max_tokens": 4,
            },
        ),
        ("seed=-2**63-1", CMPL, {"prompt": "hi", "seed": -(2**63) - 1, "max_tokens": 4}),
        ("max_tokens=2**64", CMPL, {"prompt": "hi", "max_tokens": 2**64}),
        ("n=2**64", CMPL, {"prompt": "hi", "n": 2**64, "max_tokens": 4}),
        (
            "stop_token_ids=[2**64]",
            CMPL,
            {"prompt": "hi", "stop_token_ids": [2**64], "max_tokens": 4},
        ),
        ("min_tokens=2**64", CMPL, {"prompt": "hi", "min_tokens": 2**64, "max_tokens": 4}),
        ("priority=2**64", CMPL, {"prompt": "hi", "priority": 2**64, "max_tokens": 4}),
        ("logprobs=2**64", CMPL, {"prompt": "hi", "logprobs": 2**64, "max_tokens": 4}),
    ]


def wrong_type_attacks(rng: random.Random, ctx: SoakContext) -> list[tuple[str, str, dict]]:
    user = [{"role": "user", "content": "hi"}]
    fields = [
        ("prompt", 5),
        ("prompt", {"text": "hi"}),
        ("prompt", [1.5, 2]),
        ("prompt", [["hi"]]),
        ("max_tokens", "ten"),
        ("max_tokens", 1.5),
        ("n", "2"),
        ("stream", "yes"),
        ("stop", 5),
        ("stop", {"a": 1}),
        ("stop_token_ids", ["a"]),
        ("temperature", "hot"),
        ("seed", "abc"),
        ("logprobs", True),
        ("stream_options", "yes"),
        ("cache_salt", 5),
        ("model", 5),
    ]
    chat = [
        ("messages", "hi"),
        ("messages", [{"role": "user", "content": 5}]),
        ("messages", [["user", "hi"]]),
        ("logprobs", 1),
        ("top_logprobs", "3"),
    ]
    bodies = [
        ("body=NaN", CMPL, b"NaN"),
        ("body=[1, 2]", CHAT, b"[1, 2]"),
        ("body=null", CMPL, b"null"),
    ]
    return (
        [(f"{k}={json.dumps(v)}", CMPL, {"prompt": "hi", "max_tokens": 4, k: v}) for k, v in fields]
        + [
            (f"chat {k}={json.dumps(v)}", CHAT, {"messages": user, "max_tokens": 4, k: v})
            for k, v in chat
        ]
        + bodies
    )


def negative_attacks(rng: random.Random, ctx: SoakContext) -> list[tuple[str, str, dict]]:
    return [
        ("max_tokens=-1", CMPL, {"prompt": "hi", "max_tokens": -1}),
        ("max_tokens=-2**63", CMPL, {"prompt": "hi", "max_tokens": -(2**63)}),
        (
            "chat max_tokens=-1",
            CHAT,
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
        ),
        (
            "max_completion_tokens=-5",
            CHAT,
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -5},
        ),
    ]


def oov_attacks(rng: random.Random, ctx: SoakContext) -> list[tuple[str, str, dict]]:
    v = ctx.vocab_size
    return [
        (f"prompt=[{name}]", CMPL, {"prompt": ids, "max_tokens": 4})
        for name, ids in [
            ("vocab_size", [1, 2, v]),
            ("vocab_size+12345", [v + 12345]),
            ("-1", [5, -1]),
            ("2**31", [2**31]),
            ("2**63", [2**63]),
        ]
    ] + [("prompt=[[ok], [vocab_size]]", CMPL, {"prompt": [[1, 2], [v]], "max_tokens": 4})]


def stop_ids_attacks(rng: random.Random, ctx: SoakContext) -> list[tuple[str, str, dict]]:
    ids = [i % ctx.vocab_size for i in range(100_000)]
    return [
        ("stop_token_ids x100k", CMPL, {"prompt": "hi", "max_tokens": 4, "stop_token_ids": ids}),
        (
            "stop_token_ids x100k chat",
            CHAT,
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "stop_token_ids": ids,
            },
        ),
    ]


def message_attacks(rng: random.Random, ctx: SoakContext) -> list[tuple[str, str, dict]]:
    role = rng.choice(["robot", "", "USER", "function", "\u0000"])
    return [
        ("empty messages", CHAT, {"messages": [], "max_tokens": 4}),
        ("empty messages stream", CHAT, {"messages": [], "max_tokens": 4, "stream": True}),
        (
            f"unknown role {role!r}",
            CHAT,
            {"messages": [{"role": role, "content": "hi"}], "max_tokens": 4},
        ),
        (
            "unknown role after a good one",
            CHAT,
            {
                "messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}],
                "max_tokens": 4,
            },
        ),
        ("message without role", CHAT, {"messages": [{"content": "hi"}], "max_tokens": 4}),
    ]


def malformed_attacks(rng: random.Random, ctx: SoakContext) -> list[tuple[str, str, bytes]]:
    return [
        ("truncated", CMPL, b'{"prompt": "hi", "max_tokens": '),
        ("not JSON", CHAT, b"hello there"),
        ("trailing garbage", CMPL, b'{"prompt": "hi"} }'),
        ("unterminated string", CHAT, b'{"messages": [{"role": "user", "content": "hi}]}'),
        ("invalid UTF-8", CMPL, b'{"prompt": "\xff\xfe\xfa", "max_tokens": 4}'),
        ("single quotes", CMPL, b"{'prompt': 'hi'}"),
        ("empty body", CHAT, b""),
        ("two objects", CMPL, b'{"prompt": "hi", "max_tokens": 4}{"prompt": "again"}'),
    ]


def oversize_attacks(rng: random.Random, ctx: SoakContext) -> list[tuple[str, str, dict]]:
    filler = "x" * (ctx.max_body_bytes + rng.randint(1, 4096))
    return [
        ("prompt over the body limit", CMPL, {"prompt": filler, "max_tokens": 4}),
        (
            "message over the body limit",
            CHAT,
            {"messages": [{"role": "user", "content": filler}], "max_tokens": 4},
        ),
    ]


CHAIN_LINKS = 4000  # rules in a chain grammar / links in a $defs chain: past any native stack
DEEP_SCHEMA_LEVELS = 300
DEEP_JSON_LEVELS = 5000
KV_IMPORT = "/v1/kv/import"


def chain_grammar(links: int) -> str:
    """A Lark grammar whose rules form one chain: start -> r0 -> r1 -> ... -> r{links-1}."""
    rules = [f'r{i}: "a" r{i + 1}' for i in range(links - 1)]
    return "\n".join(["start: r0", *rules, f'r{links - 1}: "a"'])


def defs_chain(links: int) -> dict:
    """A JSON schema whose $defs each refer to the next: d0 -> d1 -> ... -> d{links-1}."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(links - 1)}
    defs[f"d{links - 1}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def grammar_attacks(rng: random.Random, ctx: SoakContext) -> list[tuple[str, str, dict]]:
    """Constraints past the native grammar compiler's limits (rule chains, $ref chains, nesting)."""
    user = [{"role": "user", "content": "hi"}]
    chain = defs_chain(CHAIN_LINKS)
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": chain}}},
    }
    deep_json = (
        '{"type": "object", "properties": {"a": ' * DEEP_JSON_LEVELS
        + "{}"
        + "}}" * DEEP_JSON_LEVELS
    )
    return [
        (
            f"guided_grammar chain x{CHAIN_LINKS}",
            CMPL,
            {"prompt": "hi", "max_tokens": 4, "guided_grammar": chain_grammar(CHAIN_LINKS)},
        ),
        (
            f"response_format $defs chain x{CHAIN_LINKS}",
            CHAT,
            {
                "messages": user,
                "max_tokens": 4,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": chain},
                },
            },
        ),
        (
            f"tool parameters $defs chain x{CHAIN_LINKS}",
            CHAT,
            {"messages": user, "max_tokens": 4, "tools": [tool], "tool_choice": "required"},
        ),
        (
            f"json_schema nested x{DEEP_SCHEMA_LEVELS}",
            CHAT,
            {
                "messages": user,
                "max_tokens": 4,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": nested_schema(DEEP_SCHEMA_LEVELS)},
                },
            },
        ),
        (
            f"guided_json string nested x{DEEP_JSON_LEVELS}",
            CMPL,
            {"prompt": "hi", "max_tokens": 4, "guided_json": deep_json},
        ),
    ]


def tool_call_attacks(rng: random.Random, ctx: SoakContext) -> list[tuple[str, str, dict]]:
    """Assistant tool_calls of the wrong shape, and a tool result that answers no call."""
    shapes = [
        "x",
        [1],
        [{"function": 5}],
        [{"type": "function", "function": {"arguments": "{}"}}],
        [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}],
    ]
    out = []
    for shape in shapes:
        messages = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": shape},
            {"role": "user", "content": "go on"},
        ]
        out.append(
            (f"tool_calls={json.dumps(shape)[:40]}", CHAT, {"messages": messages, "max_tokens": 4})
        )
    out.append(
        (
            "tool message without a call",
            CHAT,
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "tool", "tool_call_id": "c1", "content": "42"},
                ],
                "max_tokens": 4,
            },
        )
    )
    return out


def kv_payload(token_ids: list[int]) -> bytes:
    """A KV handover payload (engine/kv_transfer.py's format) of made-up KV for `token_ids`."""
    head = json.dumps(
        {
            "token_ids": token_ids,
            "block_size": len(token_ids),
            "num_blocks": 1,
            "layers": 1,
            "dtype": "float16",
            "block_shape": [len(token_ids), 1, 8],
        }
    ).encode()
    return b"KVX1" + len(head).to_bytes(4, "little") + head + b"\xff\x7f" * (2 * len(token_ids) * 8)


def kv_handover_attacks(rng: random.Random, ctx: SoakContext) -> list[tuple[str, str, bytes]]:
    """The KV handover's endpoints as a client would abuse them: writes into the prefix cache."""
    ids = rng.choice(ctx.prompt_ids)[:16]
    return [
        ("import made-up KV", KV_IMPORT, kv_payload(ids)),
        ("import garbage", KV_IMPORT, b"KVX1" + bytes(rng.randrange(256) for _ in range(64))),
        ("prefill export", "/v1/kv/prefill", json.dumps({"prompt_token_ids": ids}).encode()),
    ]


ATTACKS = {
    "surrogate": surrogate_attacks,
    "nonfinite": nonfinite_attacks,
    "huge-int": huge_int_attacks,
    "wrong-type": wrong_type_attacks,
    "negative": negative_attacks,
    "oov": oov_attacks,
    "stop-ids": stop_ids_attacks,
    "messages": message_attacks,
    "malformed": malformed_attacks,
    "oversize": oversize_attacks,
    "grammar": grammar_attacks,
    "tool-calls": tool_call_attacks,
    "kv-handover": kv_handover_attacks,
}


def attack_variants(
    category: str, rng: random.Random, ctx: SoakContext
) -> list[tuple[str, str, bytes, bool]]:
    """Every variant of one attack category as (variant, path, body bytes, stream)."""
    out = []
    for variant, path, body in ATTACKS[category](rng, ctx):
        if isinstance(body, bytes):
            out.append((variant, path, body, False))
        else:
            out.append((variant, path, dumps(body), body.get("stream") is True))
    return out


def bad_case(rng: random.Random, ctx: SoakContext, categories: list[str]) -> Case:
    category = rng.choice(categories)
    variant, path, body, stream = rng.choice(attack_variants(category, rng, ctx))
    return Case(BAD, f"{category}: {variant}", path, body, stream)


def case_kinds(
    num: int, disconnect_fraction: float, bad_fraction: float, rng: random.Random
) -> list[str]:
    """Exactly round(num x fraction) disconnects and bad requests, the rest well-formed,
    shuffled."""
    bad = round(num * bad_fraction)
    disconnects = min(num - bad, round(num * disconnect_fraction))
    kinds = [BAD] * bad + [DISCONNECT] * disconnects + [GOOD] * (num - bad - disconnects)
    rng.shuffle(kinds)
    return kinds


def generate_cases(
    num: int,
    ctx: SoakContext,
    seed: int,
    disconnect_fraction: float = 0.1,
    bad_fraction: float = 0.1,
    categories: list[str] | None = None,
) -> Iterator[Case]:
    """The soak's requests, made as they are sent (oversized bodies are not all held at once)."""
    rng = random.Random(seed)
    categories = categories or list(ATTACKS)
    makers = {
        GOOD: good_case,
        DISCONNECT: disconnect_case,
        BAD: lambda r, c: bad_case(r, c, categories),
    }
    for kind in case_kinds(num, disconnect_fraction, bad_fraction, rng):
        yield makers[kind](rng, ctx)


# ---- sending ----


async def drop_stream(case: Case, resp: httpx.Response) -> Outcome:
    """Read `case.drop_after` data lines of a 200 stream, then return (the caller closes it)."""
    if resp.status_code != 200:
        return classify(case, resp.status_code, await resp.aread())
    seen = 0
    if case.drop_after > 0:
        async for line in resp.aiter_lines():
            seen += line.startswith("data:")
            if seen >= case.drop_after:
                break
    return Outcome(case.kind, case.name, DROPPED, 200, f"after {seen} data lines")


async def drop_before_headers(client: httpx.AsyncClient, url: str, case: Case) -> Outcome:
    """Send, then give up after `case.drop_delay` seconds whether or not an answer came."""
    try:
        resp = await asyncio.wait_for(
            client.post(url, content=case.body, headers=JSON_HEADERS), case.drop_delay
        )
    except asyncio.TimeoutError:
        return Outcome(case.kind, case.name, DROPPED, None, "before the headers")
    return classify(case, resp.status_code, resp.content)


async def send_case(client: httpx.AsyncClient, base_url: str, case: Case) -> Outcome:
    url = base_url.rstrip("/") + case.path
    try:
        if case.drop_after == DROP_BEFORE_HEADERS:
            return await drop_before_headers(client, url, case)
        async with client.stream("POST", url, content=case.body, headers=JSON_HEADERS) as resp:
            if case.kind == DISCONNECT:
                return await drop_stream(case, resp)
            body = await resp.aread()
        return classify(case, resp.status_code, body)
    except httpx.HTTPError as e:
        return Outcome(case.kind, case.name, CONN_ERROR, None, transport_error(e))


def transport_error(e: BaseException) -> str:
    """'ReadError <- ConnectionResetError: [Errno 104] ...': the exception and what caused it."""
    names = []
    while e is not None and len(names) < 4:
        names.append(type(e).__name__)
        message, e = str(e), e.__cause__ or e.__context__
    return f"{' <- '.join(names)}: {message}"[:200]


async def run_cases(
    base_url: str,
    cases: Iterator[Case],
    concurrency: int,
    api_key: str | None,
    timeout: float,
    bar: tqdm,
) -> list[Outcome]:
    """Send the cases, `concurrency` at a time; their outcomes in the order they finished."""
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(
        timeout=httpx.Timeout(timeout, connect=30), limits=limits, headers=auth_headers(api_key)
    ) as client:

        async def worker() -> None:
            for case in cases:
                outcomes.append(await send_case(client, base_url, case))
                bar.update(1)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


# ---- the server's state ----


def read_metrics(base_url: str, api_key: str | None) -> dict[str, float]:
    """/metrics as {sample name: value summed over its labels}."""
    from prometheus_client.parser import text_string_to_metric_families

    resp = httpx.get(base_url.rstrip("/") + "/metrics", timeout=10, headers=auth_headers(api_key))
    resp.raise_for_status()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def reported_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The metrics a soak result keeps: the server's load, its KV blocks, restarts and failures."""
    return {name: metrics[name] for name in REPORTED_METRICS if name in metrics}


def is_idle(metrics: dict[str, float]) -> bool:
    return (
        metrics.get("kvserve:num_requests_running", 0) == 0
        and metrics.get("kvserve:num_requests_waiting", 0) == 0
    )


def wait_idle(base_url: str, api_key: str | None, timeout: float) -> tuple[dict[str, float], bool]:
    """Poll /metrics until nothing runs or waits; (the last metrics, whether it got idle)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            metrics = read_metrics(base_url, api_key)
        except (httpx.HTTPError, ValueError):
            metrics = {}
        if metrics and is_idle(metrics):
            return metrics, True
        if time.monotonic() > deadline:
            return metrics, False
        time.sleep(0.2)


def health_status(base_url: str, api_key: str | None) -> int | None:
    try:
        return httpx.get(
            base_url.rstrip("/") + "/health", timeout=10, headers=auth_headers(api_key)
        ).status_code
    except httpx.HTTPError:
        return None


def rss_bytes(pid: int | None) -> int | None:
    """The resident set of process `pid` (psutil), or None when unknown."""
    if pid is None:
        return None
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except Exception:  # psutil missing, process gone or not ours: RSS is unknown
        return None


def whole(value: float | None) -> int | None:
    return None if value is None else int(value)


def restarts(metrics: dict[str, float]) -> int | None:
    return whole(metrics.get("kvserve:engine_restarts_total"))


def count_tracebacks(log_path: str | None) -> int | None:
    if not log_path:
        return None
    with open(log_path, errors="replace") as f:
        return sum(line.startswith("Traceback") for line in f)


# ---- summaries and invariants (pure) ----


def tally(outcomes: list[Outcome]) -> tuple[dict, dict]:
    """(per class: sent and each verdict's count; per (class, name): sent, verdicts, statuses, an
    example)."""
    by_class = {k: {"sent": 0, **{v: 0 for v in VERDICTS}} for k in CLASSES}
    by_name: dict[str, dict] = {}
    for o in outcomes:
        by_class[o.kind]["sent"] += 1
        by_class[o.kind][o.verdict] += 1
        row = by_name.setdefault(
            f"{o.kind} | {o.name}",
            {
                "kind": o.kind,
                "name": o.name,
                "sent": 0,
                "verdicts": Counter(),
                "statuses": Counter(),
                "example": "",
            },
        )
        row["sent"] += 1
        row["verdicts"][o.verdict] += 1
        row["statuses"]["-" if o.status is None else str(o.status)] += 1
        if o.verdict in FAILURES and not row["example"]:
            row["example"] = " ".join(o.detail.split())
    return by_class, by_name


@dataclass
class ServerObservations:
    """What the soak saw of the server: /health, metrics before and after, RSS samples, its log."""

    health: int | None = None
    process_alive: bool | None = None
    idle: bool = False
    metrics_start: dict = field(default_factory=dict)
    metrics_end: dict = field(default_factory=dict)
    rss_start: int | None = None
    rss_end: int | None = None
    rss_peak: int | None = None
    rss_trace: list = field(
        default_factory=list
    )  # [seconds after the warm-up, RSS bytes], every 15 s
    log_tracebacks: int | None = None

    def restart_count(self) -> int | None:
        start, end = restarts(self.metrics_start), restarts(self.metrics_end)
        return None if start is None or end is None else end - start

    def rss_drift_pct(self) -> float | None:
        if not self.rss_start or self.rss_end is None:
            return None
        return (self.rss_end - self.rss_start) / self.rss_start * 100


def check(name: str, value, ok: bool | None) -> dict:
    return {"check": name, "value": value, "ok": ok}


def invariants(by_class: dict, server: ServerObservations, max_rss_drift: float) -> list[dict]:
    """Every check; `ok` is True, False, or None (unknown: the server does not say)."""
    well_formed = [by_class[GOOD], by_class[DISCONNECT]]
    server_errors = sum(c[SERVER_ERROR] for c in well_formed)
    other_failures = sum(
        c[v] for c in well_formed for v in (WRONG_STATUS, INVALID_BODY, CONN_ERROR)
    )
    restart_count = server.restart_count()
    leaked = whole(server.metrics_end.get("kvserve:kv_cache_blocks_used"))
    drift = server.rss_drift_pct()
    alive = server.health == 200 and server.process_alive is not False
    return [
        check(
            "engine restarts", restart_count, None if restart_count is None else restart_count == 0
        ),
        check("server alive, /health 200", server.health, alive),
        check("idle at the end (0 running, 0 waiting)", server.idle, server.idle),
        check(
            "leaked KV blocks (in use when idle)", leaked, None if leaked is None else leaked == 0
        ),
        check("5xx on well-formed requests", server_errors, server_errors == 0),
        check("other failures of well-formed requests", other_failures, other_failures == 0),
        check(
            f"RSS drift % (<= {max_rss_drift:g})",
            None if drift is None else round(drift, 2),
            None if drift is None else drift <= max_rss_drift,
        ),
    ]


def bad_input_summary(by_class: dict) -> str:
    bad = by_class[BAD]
    return (
        f"{bad[OK]}/{bad['sent']} answered 4xx with an error body; {bad[SERVER_ERROR]} 5xx, "
        f"{bad[WRONG_STATUS]} wrong status, {bad[INVALID_BODY]} invalid body, "
        f"{bad[CONN_ERROR]} connection errors"
    )


def verdict_label(ok: bool | None) -> str:
    return {True: "pass", False: "FAIL", None: "unknown"}[ok]


def misanswered(by_name: dict) -> list[dict]:
    """The (class, name) rows with at least one failure, most failures first."""
    rows = [r for r in by_name.values() if any(r["verdicts"][v] for v in FAILURES)]
    return sorted(
        rows, key=lambda r: (-sum(r["verdicts"][v] for v in FAILURES), r["kind"], r["name"])
    )


def statuses_text(row: dict) -> str:
    return ", ".join(f"{s} x{c}" for s, c in sorted(row["statuses"].items()))


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


# ---- output ----


def print_summary(run: dict) -> None:
    classes, server = run["classes"], run["server"]
    print(
        common.table(
            ["class", "sent", *VERDICTS],
            [[k, classes[k]["sent"], *(classes[k][v] for v in VERDICTS)] for k in CLASSES],
        )
    )
    print(
        f"\n{run['num_requests']} requests in {run['duration_s']:.1f}s "
        f"({run['requests_per_s']:.1f} req/s); "
        f"RSS start {mib(server['rss_start'])} MiB, end {mib(server['rss_end'])} MiB, "
        f"peak {mib(server['rss_peak'])} MiB; "
        f"server log tracebacks: {common.fmt(server['log_tracebacks'])}"
    )
    print("bad inputs: " + run["bad_inputs"] + "\n")
    print(
        common.table(
            ["invariant", "value", "result"],
            [
                [c["check"], common.fmt(c["value"]), verdict_label(c["ok"])]
                for c in run["invariants"]
            ],
        )
    )
    rows = run["misanswered"]
    if rows:
        print("\nmisanswered:")
        print(
            common.table(
                ["class", "request", "sent", "failed", "statuses", "example"],
                [
                    [
                        r["kind"],
                        r["name"],
                        r["sent"],
                        sum(r["verdicts"].get(v, 0) for v in FAILURES),
                        statuses_text(r),
                        r["example"][:90],
                    ]
                    for r in rows
                ],
            )
        )


def add_args(p) -> None:
    _add_server_args(p.add_argument_group("server"))
    _add_soak_args(p.add_argument_group("soak"))
    add_output_args(p)


def _add_server_args(g) -> None:
    g.add_argument(
        "--url",
        "--base-url",
        dest="url",
        default=None,
        help="server to soak, e.g. http://127.0.0.1:8000 (default: start `kvserve serve` here)",
    )
    g.add_argument(
        "--model",
        default=None,
        help="GGUF of the server started here, and the tokenizer of the "
        "prompts (default: SmolLM2-135M)",
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get("KVSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="bearer key (default: $KVSERVE_API_KEY or $OPENAI_API_KEY)",
    )
    g.add_argument(
        "--model-name", default=None, help="`model` field of requests (default: the server's first)"
    )
    g.add_argument(
        "--server-args", default="", help="extra `kvserve serve` flags when it is started here"
    )
    g.add_argument(
        "--server-pid",
        type=int,
        default=None,
        help="with --url: the server's pid, to sample its RSS",
    )
    g.add_argument(
        "--max-body-bytes",
        default=None,
        help="the server's body size limit, for the oversized bodies (default: --max-body-bytes "
        "of --server-args, else 2MiB)",
    )


def _add_soak_args(g) -> None:
    g.add_argument(
        "--num-requests", type=int, default=10_000, help="requests in all (default: %(default)s)"
    )
    g.add_argument(
        "--concurrency", type=int, default=16, help="requests in flight (default: %(default)s)"
    )
    g.add_argument(
        "--disconnect-fraction",
        type=float,
        default=0.1,
        help="share of requests (well-formed) the client drops (default: %(default)s)",
    )
    g.add_argument(
        "--bad-fraction",
        type=float,
        default=0.1,
        help="share of bad requests (default: %(default)s)",
    )
    g.add_argument(
        "--attacks",
        default=",".join(ATTACKS),
        help="comma list of attack categories to draw bad requests from "
        "(default: all: %(default)s)",
    )
    g.add_argument(
        "--warmup",
        type=int,
        default=200,
        help="requests before the first RSS sample (at most half of them all; "
        "default: %(default)s)",
    )
    g.add_argument(
        "--max-rss-drift",
        type=float,
        default=5.0,
        help="RSS growth allowed, %% (default: %(default)s)",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=300,
        help="seconds a request may wait for the server's next bytes (default: %(default)s)",
    )
    g.add_argument(
        "--idle-timeout",
        type=float,
        default=120,
        help="seconds to wait for the server to go idle at the end (default: %(default)s)",
    )
    g.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")


def body_limit(args) -> int:
    from kvserve.config import parse_size

    if args.max_body_bytes:
        return parse_size(args.max_body_bytes)
    server_args = shlex.split(args.server_args)
    for i, arg in enumerate(server_args):
        if arg.startswith("--max-body-bytes="):
            return parse_size(arg.split("=", 1)[1])
        if arg == "--max-body-bytes" and i + 1 < len(server_args):
            return parse_size(server_args[i + 1])
    return 2 * 2**20


def soak_context(args, base_url: str) -> SoakContext:
    """Prompts: windows of the W2 text (the standard workloads) and random token ids, 16-48
    tokens."""
    from kvserve.bench.datasets import gguf_vocab_size, random_requests, text_stream
    from kvserve.bench.loadgen import served_model
    from kvserve.bench.tokenize import decoder

    gguf = common.model_path(args.model)
    vocab = gguf_vocab_size(gguf)
    rng = random.Random(args.seed)
    random_ids = [r.prompt_ids for r in random_requests(32, "16:48", 1, args.seed, vocab)]
    try:
        stream = text_stream()
        starts = [(rng.randrange(len(stream) - 48), rng.randint(16, 48)) for _ in range(64)]
        prompt_ids = [stream[s : s + n] for s, n in starts]
    except SystemExit:  # the standard workloads file is missing (a broken install)
        prompt_ids = random_ids
    decode = decoder(gguf)
    return SoakContext(
        args.model_name or served_model(base_url, args.api_key),
        vocab,
        prompt_ids,
        [decode(ids) for ids in prompt_ids],
        random_ids,
        body_limit(args),
    )


async def sample_rss(
    pid: int | None, state: ServerObservations, stop: asyncio.Event, trace_every: float = 15.0
) -> None:
    """Until `stop`: the peak RSS (a sample a second) and a trace of it (a sample every
    `trace_every` s)."""
    start, next_trace = time.monotonic(), 0.0
    while not stop.is_set():
        rss, elapsed = rss_bytes(pid), time.monotonic() - start
        if rss is not None:
            state.rss_peak = max(state.rss_peak or 0, rss)
            if elapsed >= next_trace:
                state.rss_trace.append([round(elapsed, 1), rss])
                next_trace += trace_every
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


async def soak(
    base_url: str,
    cases: Iterator[Case],
    warmup: int,
    args,
    pid: int | None,
    state: ServerObservations,
) -> tuple[list[Outcome], float]:
    """The warm-up cases, the first RSS sample, then the rest while sampling the RSS."""
    bar = tqdm(
        total=args.num_requests,
        desc="soak",
        unit="req",
        disable=args.no_progress,
        dynamic_ncols=True,
    )
    start = time.perf_counter()
    outcomes = await run_cases(
        base_url, itertools.islice(cases, warmup), args.concurrency, args.api_key, args.timeout, bar
    )
    state.rss_start = state.rss_peak = rss_bytes(pid)
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_rss(pid, state, stop))
    outcomes += await run_cases(base_url, cases, args.concurrency, args.api_key, args.timeout, bar)
    stop.set()
    await sampler
    bar.close()
    return outcomes, time.perf_counter() - start


def observe_end(
    base_url: str, args, pid: int | None, state: ServerObservations, proc=None, log_path=None
) -> None:
    state.metrics_end, state.idle = wait_idle(base_url, args.api_key, args.idle_timeout)
    state.rss_end = rss_bytes(pid)
    state.health = health_status(base_url, args.api_key)
    state.process_alive = None if proc is None else proc.poll() is None
    state.log_tracebacks = count_tracebacks(log_path)


def run_soak(args, base_url: str, pid: int | None, proc=None, log_path: str | None = None) -> dict:
    """Soak the server at `base_url`; the run's record (counts, server state, invariants)."""
    categories = [c.strip() for c in args.attacks.split(",") if c.strip()]
    cases = generate_cases(
        args.num_requests,
        soak_context(args, base_url),
        args.seed,
        args.disconnect_fraction,
        args.bad_fraction,
        categories,
    )
    warmup = min(args.warmup, args.num_requests // 2)
    state = ServerObservations()
    with contextlib.suppress(httpx.HTTPError, ValueError):
        state.metrics_start = read_metrics(base_url, args.api_key)
    outcomes, duration = asyncio.run(soak(base_url, cases, warmup, args, pid, state))
    observe_end(base_url, args, pid, state, proc, log_path)
    by_class, by_name = tally(outcomes)
    checks = invariants(by_class, state, args.max_rss_drift)
    return {
        "engine": "kvserve",
        "base_url": args.url,
        "config": {"server_args": args.server_args},
        "num_requests": len(outcomes),
        "warmup": warmup,
        "duration_s": duration,
        "requests_per_s": len(outcomes) / duration if duration else math.nan,
        "classes": by_class,
        "bad_inputs": bad_input_summary(by_class),
        "misanswered": misanswered(by_name),
        "names": sorted(by_name.values(), key=lambda r: (r["kind"], r["name"])),
        "server": {
            **vars(state),
            "metrics_start": reported_metrics(state.metrics_start),
            "metrics_end": reported_metrics(state.metrics_end),
            "rss_drift_pct": state.rss_drift_pct(),
            "restarts": state.restart_count(),
        },
        "invariants": checks,
        "passed": all(c["ok"] is not False for c in checks),
    }


def main(args, argv: list[str]) -> int:
    from kvserve.bench.servers import kvserve_server

    unknown = set(a.strip() for a in args.attacks.split(",") if a.strip()) - set(ATTACKS)
    if unknown:
        return common.die(
            f"unknown attack categories {sorted(unknown)}: choose from {', '.join(ATTACKS)}"
        )
    if (
        not 0 <= args.bad_fraction + args.disconnect_fraction <= 1
        or args.num_requests < 1
        or args.concurrency < 1
    ):
        return common.die(
            "--num-requests and --concurrency must be >= 1, the fractions in [0, 1] together"
        )
    result = common.new_result("soak", argv, args)
    result["workload"] = {
        "num_requests": args.num_requests,
        "concurrency": args.concurrency,
        "disconnect_fraction": args.disconnect_fraction,
        "bad_fraction": args.bad_fraction,
        "attacks": args.attacks,
        "seed": args.seed,
    }
    if args.url:
        run = run_soak(args, args.url, args.server_pid)
    else:
        server = kvserve_server(args.model, shlex.split(args.server_args), args.api_key)
        with server as url:
            run = run_soak(args, url, server.proc.pid, server.proc, server.log.name)
        print(f"server log: {server.log.name}", file=sys.stderr)
    result["runs"].append(run)
    print_summary(run)
    common.save_result(result, args.output, args.save, f"soak-{args.num_requests}")
    return 0 if run["passed"] else 1
