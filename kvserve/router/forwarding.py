"""What the router takes from a client before it forwards anything: the headers it passes on, the
body (read under a size cap as it arrives) and the body's JSON (bounded nesting and integer size).

Everything here fails with a 4xx APIError (kvserve/server/errors.py) naming what to fix: a bad
request is the client's fault, never the replica's, so it must be refused here, before a replica
sees it, and must not take a healthy replica out of rotation.
"""

from __future__ import annotations

import json
import re

import httpx
from starlette.requests import Request

from kvserve.server.errors import BadRequest, TooLarge

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
MAX_JSON_DEPTH = 160  # above the replicas' own bound on a schema's nesting (128 levels,
# sampling_params.MAX_SCHEMA_DEPTH) plus the request's few levels
MAX_INT_DIGITS = 4300  # Python's own limit for int from str (sys.int_info); the replica
# checks each field's range

# The headers a replica needs (True: the request cannot go without them as sent) or may use
# (False: dropped when their value cannot be forwarded). Everything else (hop-by-hop headers,
# cookies, proxies' additions) stays at the router.
FORWARD_HEADERS = {
    "authorization": True,
    "content-type": True,
    "accept": False,
    "user-agent": False,
}
# RFC 9110 field-value of visible ASCII: what the router's HTTP client (h11) sends as a str
_FIELD_VALUE = re.compile(rb"(?:[\x21-\x7e](?:[\x20\x09\x21-\x7e]*[\x21-\x7e])?)?")


def forward_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The allow-listed headers of a request (ASGI scope["headers"]), values without surrounding
    whitespace; the first of repeated ones (the one the router's key check read). A value that is
    not visible ASCII is a 400 naming the header, or dropped where the replica can do without it."""
    out: dict[str, str] = {}
    for name, value in raw:
        key = name.decode("latin-1").lower()
        if key not in FORWARD_HEADERS or key in out:
            continue
        value = value.strip(b" \t")
        if _FIELD_VALUE.fullmatch(value):
            out[key] = value.decode("ascii")
        elif FORWARD_HEADERS[key]:
            raise BadRequest(
                f"the {key} header holds characters that cannot be forwarded "
                "(control or non-ASCII bytes): send visible ASCII only",
                param=key,
                code="invalid_header",
            )
    return out


def unforwardable(e: httpx.LocalProtocolError) -> BadRequest:
    """The 400 for a request the router's HTTP client refused to send as given: what the client
    sent is at fault, not the replica."""
    return BadRequest(
        f"the request cannot be forwarded as sent ({e}): check its headers", code="invalid_request"
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, counted as it arrives: a 413 (closing the connection) as soon as the
    declared length or the bytes received pass `limit`, so no more than `limit` is ever held."""
    too_large = TooLarge(
        f"the request body is over the router's limit of {limit} bytes "
        "(kvserve router --router-max-body-bytes)",
        headers={"Connection": "close"},
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        if len(body) + len(chunk) > limit:
            raise too_large
        body += chunk
    return bytes(body)


class _LongInt(str):
    """An integer literal of more than MAX_INT_DIGITS digits, kept as its text (never converted:
    int() from a long string is slow, and over 4,300 digits Python refuses it)."""


def _parse_int(text: str) -> int | _LongInt:
    return _LongInt(text) if len(text) - text.startswith("-") > MAX_INT_DIGITS else int(text)


_NESTED = frozenset({dict, list, _LongInt})


def parse_json_body(raw: bytes) -> dict:
    """The body as a JSON object; a 400 when it is not one, nests more than MAX_JSON_DEPTH levels
    (param: the top-level field) or holds an integer of more than MAX_INT_DIGITS digits (param:
    its path)."""
    try:
        try:
            body = json.loads(raw)
        except ValueError:  # JSONDecodeError, UnicodeDecodeError, an integer too long
            body = json.loads(raw, parse_int=_parse_int)  # the hook is slow on ints: 2nd try only
    except RecursionError:
        raise _too_deep(_deep_field(raw)) from None
    except ValueError as e:
        raise BadRequest(
            f"We could not parse the JSON body of your request ({e}). "
            "The body must be a JSON object.",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", code="invalid_json")
    stack = [(body, (), 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, _LongInt):
            param = ".".join(map(str, path))
            digits = len(value.lstrip("-"))
            raise BadRequest(
                f"{param}: an integer of {digits} digits is over the limit of "
                f"{MAX_INT_DIGITS} digits",
                param=param,
                code="invalid_value",
            )
        if depth > MAX_JSON_DEPTH:
            raise _too_deep(str(path[0]))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        values = value.values() if isinstance(value, dict) else value
        if _NESTED.isdisjoint(map(type, values)):  # scalars only (a prompt's token ids)
            continue
        stack.extend((v, (*path, k), depth + 1) for k, v in items if type(v) in _NESTED)
    return body


def _too_deep(param: str | None) -> BadRequest:
    where = f"{param}: " if param else ""
    return BadRequest(
        f"{where}the JSON nests more than {MAX_JSON_DEPTH} levels deep",
        param=param,
        code="invalid_value",
    )


_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"(\s*:)?|[\[\]{}]', re.DOTALL)


def _deep_field(raw: bytes) -> str | None:
    """The top-level field of `raw` whose value nests past MAX_JSON_DEPTH (for a body too deep
    for json.loads to parse at all); None when it is not in a field of a top-level object."""
    depth, field = 0, None
    for m in _TOKEN.finditer(raw):
        token = m.group()
        if token[:1] == b'"':
            if depth == 1 and m.group(1):
                key = token[: token.rindex(b'"') + 1]
                try:
                    field = json.loads(key)
                except ValueError:
                    field = key[1:-1].decode("latin-1")
        elif token in (b"[", b"{"):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return field if raw.lstrip()[:1] == b"{" else None
        else:
            depth -= 1
    return None
