"""The ASGI guard in front of every route: the API key, and the request body size limit."""
from __future__ import annotations

import json
import secrets

from kvserve.server.errors import TooLarge, Unauthorized

DEFAULT_MAX_BODY_BYTES = 2 * 2**20
DRAIN_LIMIT = 64 * 2**20  # past this much of an oversized body, stop reading and close


class GuardMiddleware:
    """Pure ASGI (streaming and disconnects pass through untouched): the API key on /v1 routes,
    and the request body size limit (read here, then replayed to the app)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key and scope["path"].startswith("/v1"):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if not secrets.compare_digest(auth.encode(), f"Bearer {self.api_key}".encode()):
                return await _send_error(send, Unauthorized(
                    "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'"))
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        limit = self.max_body_bytes
        too_large = TooLarge(f"request body is larger than the limit of {limit} bytes (--max-body-bytes)")
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > DRAIN_LIMIT:
            return await _send_error(send, too_large, close=True)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            more = message.get("more_body", False)
            if size > DRAIN_LIMIT:
                return await _send_error(send, too_large, close=True)
            if size <= limit:
                chunks.append(body)
        if size > limit:
            return await _send_error(send, too_large)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


async def _send_error(send, err, close: bool = False) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
