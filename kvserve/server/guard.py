"""The ASGI guard in front of every route: the API key, the request body size limit, the
body read timeout, and the overload fast path (429 before any parsing when the queue is full)."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Callable

from kvserve.server.errors import APIError, RequestTimeout, TooLarge, Unauthorized, raw_response

DEFAULT_MAX_BODY_BYTES = 2 * 2**20
DEFAULT_BODY_TIMEOUT = 30.0
DRAIN_LIMIT = 64 * 2**20  # past this much of an oversized body, stop reading and close
# answered without the API key (the dashboard's page and script are static: its data are not)
OPEN_PATHS = frozenset({"/health", "/dashboard", "/dashboard/dashboard.js"})
METRICS_PATHS = frozenset({"/metrics", "/dashboard/data"})  # open too with --metrics-public
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class BodyRejected(Exception):
    """A request body refused before the app sees it: the error to answer, and whether to close
    the connection after it."""

    def __init__(self, error: APIError, close: bool):
        super().__init__(error.message)
        self.error = error
        self.close = close


class GuardMiddleware:
    """Pure ASGI (streaming and disconnects pass through untouched): the API key on every route
    but /health (and /metrics when `metrics_public`), and the request body, read here within
    `body_timeout` seconds and under the size limit, then replayed to the app.

    `overloaded()` returns the error for a generation request that cannot be queued now (429 when
    the waiting queue is full, 503 when draining) or None: such a request is answered as soon as
    its body is read, before JSON parsing, validation and tokenization, so a burst of them costs
    the server little and each client hears back in milliseconds."""

    def __init__(
        self,
        app,
        api_key: str | None,
        max_body_bytes: int,
        metrics_public: bool = False,
        body_timeout: float | None = None,
        overloaded: Callable[[], APIError | None] | None = None,
        raw_body_paths: frozenset[str] = frozenset(),
    ):
        """raw_body_paths: routes that read their own body, with a limit, a timeout and a
        concurrency cap of their own, before which nothing is buffered here (the KV import of
        disaggregation, kvserve/server/kv_routes.py)."""
        self.app = app
        self.raw_body_paths = raw_body_paths
        self.overloaded = overloaded
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.open_paths = (OPEN_PATHS | METRICS_PATHS) if metrics_public else OPEN_PATHS
        self.body_timeout = body_timeout or DEFAULT_BODY_TIMEOUT

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key and scope["path"] not in self.open_paths:
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if not secrets.compare_digest(auth.encode(), f"Bearer {self.api_key}".encode()):
                return await _send_error(
                    send,
                    Unauthorized(
                        "Incorrect or missing API key: "
                        "send the header 'Authorization: Bearer <key>'"
                    ),
                )
        if scope["method"] not in ("POST", "PUT", "PATCH") or scope["path"] in self.raw_body_paths:
            return await self.app(scope, receive, send)
        try:
            body = await asyncio.wait_for(self.read_body(headers, receive), self.body_timeout)
        except asyncio.TimeoutError:
            return await _send_error(
                send,
                RequestTimeout(
                    f"the request body did not arrive within {self.body_timeout:g} seconds "
                    "(--body-timeout)"
                ),
                close=True,
            )
        except BodyRejected as rejected:
            return await _send_error(send, rejected.error, close=rejected.close)
        if body is None:  # the client went away
            return
        if self.overloaded is not None and scope["path"] in GENERATION_PATHS:
            error = self.overloaded()
            if error is not None:
                return await _send_error(send, error)
        return await self.app(scope, _replay(body, receive), send)

    async def read_body(self, headers: dict, receive) -> bytes | None:
        """The whole request body, or None when the client disconnected first. Raises
        BodyRejected past the size limit (reading on up to DRAIN_LIMIT to keep the connection)."""
        limit = self.max_body_bytes
        drain = max(DRAIN_LIMIT, limit)
        too_large = TooLarge(
            f"request body is larger than the limit of {limit} bytes (--max-body-bytes)"
        )
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > drain:
            raise BodyRejected(too_large, close=True)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body = message.get("body", b"")
            size += len(body)
            more = message.get("more_body", False)
            if size > drain:
                raise BodyRejected(too_large, close=True)
            if size <= limit:
                chunks.append(body)
        if size > limit:
            raise BodyRejected(too_large, close=False)
        return b"".join(chunks)


def _replay(body: bytes, receive):
    """A receive() that hands the app the whole body once, then passes through (disconnects)."""
    replayed = False

    async def replay():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_error(send, err, close: bool = False) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def early_rejection(api_key: str | None, overloaded: Callable[[int], APIError | None]):
    """For the HTTP protocol (connections.py): given a generation request's headers and how many
    requests it let through are still on their way to the queue, the raw 429 or 503 it gets
    whatever its body holds, or None to let it through the app as usual (a wrong or missing API
    key goes on to get its 401 there)."""
    expected = f"Bearer {api_key}".encode() if api_key else None

    def reject(headers: list[tuple[bytes, bytes]], pending: int = 0) -> bytes | None:
        if expected is not None:
            auth = next((v for k, v in headers if k == b"authorization"), b"")
            if not secrets.compare_digest(auth, expected):
                return None
        error = overloaded(pending)
        return None if error is None else raw_response(error)

    return reject
