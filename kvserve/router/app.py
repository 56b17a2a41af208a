"""The router's HTTP app: one OpenAI-compatible endpoint in front of data-parallel replicas.

POST /v1/completions and /v1/chat/completions go to the replica the policy picks
(kvserve/router/policy.py), streamed or not, with the client's headers (the API key is the
replicas' to check); a client that disconnects closes the upstream stream, so the replica aborts
the request. GET /v1/models is answered by a healthy replica. GET /health is 200 while a replica is
healthy; GET /router/stats shows the replicas, their load and the routing counts.

Health: every replica's /health is polled every `health_interval` seconds; a replica that fails it
is out of rotation until it passes again. A request whose replica cannot be reached (connection
refused, before anything was sent) goes to the next one; a replica that drops a request it was
serving fails that request at once with a 502 (or, mid-stream, a final error event) naming the
replica, and is out of rotation until its health check passes. With no healthy replica left, the
answer is 503 at once. What a client got wrong (headers, body size, JSON) is its 4xx and never
counts against a replica (kvserve/router/forwarding.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from kvserve.router import forwarding
from kvserve.router.policy import Replica, Router, routing_key
from kvserve.server.errors import error_body, install_error_handlers

log = logging.getLogger("kvserve.router")
KV_TRANSFER_HEADER = "X-KV-Transfer-Key"  # the replicas' handover secret (engine/kv_payload.py)


def _error(
    status: int, message: str, type: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status)


def _replica_lost(replica: Replica, e: Exception) -> None:
    """Take a replica that failed a request it was serving out of rotation (its health check
    brings it back), and say so in the log."""
    replica.healthy = False
    replica.failures += 1
    replica.last_error = f"{type(e).__name__}: {e}"
    log.error(
        "replica %s lost a request (%s); out of rotation until its health check passes",
        replica.url,
        replica.last_error,
    )


def _lost_message(replica: Replica) -> str:
    return (
        f"replica {replica.url} failed while serving this request ({replica.last_error}); "
        f"it is out of rotation until its health check passes: retry the request"
    )


def _replica_failed(replica: Replica) -> JSONResponse:
    """The client's 502 when its replica dropped the request."""
    return _error(502, _lost_message(replica), "server_error", code="replica_failed")


class RouterService:
    """What the router's routes share: the replicas, the HTTP client to them (opened and closed
    by `lifespan`) and the settings of `build_router_app`, which wires one method per route."""

    def __init__(
        self,
        router: Router,
        health_interval: float,
        request_timeout: float,
        api_key: str | None,
        prefill: Router | None,
        max_body_bytes: int,
        kv_transfer_key: str | None,
    ) -> None:
        self.router = router
        self.health_interval = health_interval
        self.request_timeout = request_timeout
        self.api_key = api_key
        self.prefill = prefill
        self.max_body_bytes = max_body_bytes
        self.kv_transfer_key = kv_transfer_key
        self.client: httpx.AsyncClient | None = None
        self.everyone = router.replicas + (prefill.replicas if prefill is not None else [])

    # -- health ------------------------------------------------------------------------------

    async def check(self, replica: Replica) -> None:
        """One health check: a replica is in rotation while its /health answers 200."""
        try:
            r = await self.client.get(
                f"{replica.url}/health", timeout=max(1.0, self.health_interval)
            )
            ok = r.status_code == 200
            error = None if ok else f"/health answered {r.status_code}"
        except httpx.HTTPError as e:
            ok, error = False, f"/health failed: {type(e).__name__}: {e}"
        if ok != replica.healthy:
            log.warning(
                "replica %s is %s%s",
                replica.url,
                "healthy" if ok else "down",
                f" ({error})" if error else "",
            )
        replica.healthy = ok
        if error:
            replica.last_error = error

    async def health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.check(r) for r in self.everyone))
            await asyncio.sleep(self.health_interval)

    @asynccontextmanager
    async def lifespan(self, app: FastAPI):
        """The client to the replicas and the health checks live as long as the app does; every
        replica is checked once before the first request."""
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.request_timeout, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        await asyncio.gather(*(self.check(r) for r in self.everyone))
        task = asyncio.create_task(self.health_loop())
        try:
            yield
        finally:
            task.cancel()
            await self.client.aclose()

    async def check_key(self, request: Request, call_next):
        """Middleware: with an API key, every route but /health needs it."""
        if self.api_key and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return _error(
                    401,
                    "Incorrect API key provided: send 'Authorization: Bearer <key>'",
                    "invalid_request_error",
                    code="invalid_api_key",
                )
        return await call_next(request)

    # -- forwarding --------------------------------------------------------------------------

    async def route(self, request: Request, path: str) -> Response:
        """Bad input (headers, body size, JSON) is refused here with a 4xx (forwarding.py); past
        that, only what goes wrong between the router and the replica counts against the replica."""
        headers = forwarding.forward_headers(request.scope["headers"])
        try:
            raw = await forwarding.read_body(request, self.max_body_bytes)
        except ClientDisconnect:
            return Response(status_code=499)  # nobody is left to answer
        body = forwarding.parse_json_body(raw)
        key = routing_key(path, body)
        stream = body.get("stream") is True
        handover = (
            await self.prefill_elsewhere(path, body, key, headers)
            if self.prefill is not None
            else None
        )
        # clients' own copies are never forwarded
        if self.prefill is not None and self.kv_transfer_key:
            headers[KV_TRANSFER_HEADER] = self.kv_transfer_key
        sent = await self.send(path, raw, key, headers, handover)
        if isinstance(sent, Response):
            return sent
        return await self.answer(*sent, stream)

    async def send(
        self, path: str, raw: bytes, key: str, headers: dict, handover: bytes | None
    ) -> tuple[Replica, httpx.Response] | Response:
        """Send the request to the replica the policy picks, and to the next one while none can
        be reached: the replica and its response (body not read yet, in flight counted), or
        the client's error (503: no healthy replica left; 502: the replica failed it)."""
        tried: tuple[Replica, ...] = ()
        while True:
            replica, _ = self.router.choose(key, exclude=tried)
            if replica is not None and handover is not None:
                await self.hand_over(replica, handover, headers)
            if replica is None:
                down = "; ".join(
                    f"{r.url}: {r.last_error or 'not checked yet'}" for r in self.router.replicas
                )
                return _error(
                    503,
                    f"no healthy replica can take the request ({down})",
                    "service_unavailable",
                    code="no_healthy_replica",
                )
            upstream = self.client.build_request(
                "POST", f"{replica.url}{path}", content=raw, headers=headers
            )
            replica.in_flight += 1
            try:
                return replica, await self.client.send(upstream, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # nothing reached the replica:
                replica.in_flight -= 1  # the next one may take it
                _replica_lost(replica, e)
                tried += (replica,)
            except httpx.LocalProtocolError as e:  # what the client sent cannot go out as HTTP:
                replica.in_flight -= 1  # its fault, not the replica's
                log.info("refused to forward a request to %s: %s", replica.url, e)
                return forwarding.unforwardable(e).response()
            except httpx.HTTPError as e:
                replica.in_flight -= 1
                _replica_lost(replica, e)
                return _replica_failed(replica)

    async def answer(self, replica: Replica, response: httpx.Response, stream: bool) -> Response:
        """The replica's answer, passed on whole, or relayed as it comes when it is a stream."""
        passed = {
            k: v
            for k, v in response.headers.items()
            if k.lower() in ("content-type", "retry-after", "x-request-id")
        }
        passed["x-kvserve-replica"] = replica.url
        if not stream or response.status_code != 200:
            try:
                content = await response.aread()
            except httpx.HTTPError as e:
                _replica_lost(replica, e)
                return _replica_failed(replica)
            finally:
                replica.in_flight -= 1
                await response.aclose()
            return Response(content, status_code=response.status_code, headers=passed)
        return StreamingResponse(self.relay(replica, response), status_code=200, headers=passed)

    async def relay(self, replica: Replica, response: httpx.Response):
        """A stream's chunks as they come; a replica that fails mid-stream ends it with an error
        event."""
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            _replica_lost(replica, e)
            body = error_body(_lost_message(replica), "server_error", code="replica_failed")
            yield f"data: {json.dumps(body)}\n\n".encode()
        finally:  # also when the client went away: closing upstream aborts the request there
            replica.in_flight -= 1
            await response.aclose()

    # -- prefill/decode disaggregation -------------------------------------------------------

    async def prefill_elsewhere(
        self, path: str, body: dict, key: str, headers: dict
    ) -> bytes | None:
        """Disaggregation, step 1: a prefill replica tokenizes the prompt as the endpoint would,
        computes it and returns its KV blocks; None when that cannot be done (the decode replica
        then computes the prompt itself: the handover only saves work)."""
        if path.endswith("/chat/completions"):
            ask = {"messages": body.get("messages")}
        elif isinstance(body.get("prompt"), str):
            ask = {"prompt": body["prompt"]}
        elif (
            isinstance(body.get("prompt"), list)
            and body["prompt"]
            and all(isinstance(t, int) for t in body["prompt"])
        ):
            ask = None
        else:
            return None
        if body.get("cache_salt") is not None:  # handed-over blocks are not in its namespace
            return None
        replica, _ = self.prefill.choose(key)
        if replica is None:
            return None
        replica.in_flight += 1
        try:
            if ask is None:
                ids = body["prompt"]
            else:
                r = await self.client.post(
                    f"{replica.url}/tokenize",
                    json={"model": body.get("model"), **ask},
                    headers=headers,
                )
                if r.status_code != 200:
                    return None
                ids = r.json()["tokens"]
            r = await self.client.post(
                f"{replica.url}/v1/kv/prefill",
                json={"prompt_token_ids": ids},
                headers={**headers, KV_TRANSFER_HEADER: self.kv_transfer_key or ""},
            )
            if r.status_code != 200:
                log.warning(
                    "prefill on %s answered %d: the decode replica computes the prompt",
                    replica.url,
                    r.status_code,
                )
                return None
            return r.content
        except httpx.HTTPError as e:
            _replica_lost(replica, e)
            return None
        finally:
            replica.in_flight -= 1

    async def hand_over(self, replica: Replica, payload: bytes, headers: dict) -> None:
        """Disaggregation, step 2: the decode replica adopts the blocks into its prefix cache."""
        try:
            r = await self.client.post(
                f"{replica.url}/v1/kv/import",
                content=payload,
                headers={
                    **headers,
                    "content-type": "application/octet-stream",
                    KV_TRANSFER_HEADER: self.kv_transfer_key or "",
                },
            )
            if r.status_code == 200:
                self.router.handed_over_tokens += r.json().get("cached_tokens", 0)
            else:
                log.warning(
                    "KV import on %s answered %d: %s", replica.url, r.status_code, r.text[:200]
                )
        except httpx.HTTPError as e:
            log.warning(
                "KV import on %s failed (%s): it computes the prompt itself", replica.url, e
            )

    # -- the routes ------------------------------------------------------------------------

    async def completions(self, request: Request):
        return await self.route(request, "/v1/completions")

    async def chat_completions(self, request: Request):
        return await self.route(request, "/v1/chat/completions")

    async def models(self, request: Request):
        headers = forwarding.forward_headers(request.scope["headers"])
        for replica in self.router.healthy():
            try:
                r = await self.client.get(f"{replica.url}/v1/models", headers=headers, timeout=10)
            except httpx.HTTPError as e:
                _replica_lost(replica, e)
                continue
            return Response(
                r.content,
                status_code=r.status_code,
                headers={"content-type": r.headers.get("content-type", "application/json")},
            )
        return _error(503, "no healthy replica", "service_unavailable", code="no_healthy_replica")

    async def health(self):
        n = len(self.router.healthy())
        return JSONResponse(
            {"healthy_replicas": n, "replicas": len(self.router.replicas)},
            status_code=200 if n else 503,
        )

    async def stats(self):
        out = self.router.stats()
        if self.prefill is not None:
            out["prefill"] = self.prefill.stats()["replicas"]
            out["handed_over_tokens"] = self.router.handed_over_tokens
        return out


def build_router_app(
    router: Router,
    health_interval: float = 2.0,
    request_timeout: float = 600.0,
    api_key: str | None = None,
    prefill: Router | None = None,
    max_body_bytes: int = forwarding.DEFAULT_MAX_BODY_BYTES,
    kv_transfer_key: str | None = None,
) -> FastAPI:
    """`api_key`: when set, every route but /health needs 'Authorization: Bearer KEY' (checked
    here, then passed on: replicas may check their own). `prefill`: the prefill replicas of
    prefill/decode disaggregation (`router` then holds the decode replicas), and
    `kv_transfer_key` the replicas' --kv-transfer-key, sent with every handover call and with
    the decode request (which then reads the handover's namespace). `max_body_bytes`:
    a larger request body is a 413 (kvserve/router/forwarding.py)."""
    service = RouterService(
        router, health_interval, request_timeout, api_key, prefill, max_body_bytes, kv_transfer_key
    )
    app = FastAPI(title="kvserve router", lifespan=service.lifespan)
    app.state.router = router
    install_error_handlers(app)  # every error, 404s and 500s too, is an OpenAI error body
    app.middleware("http")(service.check_key)
    app.post("/v1/completions")(service.completions)
    app.post("/v1/chat/completions")(service.chat_completions)
    app.get("/v1/models")(service.models)
    app.get("/health")(service.health)
    app.get("/router/stats")(service.stats)
    return app
