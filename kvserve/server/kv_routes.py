"""The KV handover's HTTP side (prefill/decode disaggregation), off unless the server has a role.

`--kv-transfer-role prefill` adds POST /v1/kv/prefill, `decode` adds POST /v1/kv/import, `both`
adds both; without a role neither exists (404). Each call needs the header X-KV-Transfer-Key
with `--kv-transfer-key` ($KVSERVE_KV_TRANSFER_KEY), a secret of its own: a users' API key does
not open it (and when the server has one, the guard asks for it as on every route).

Namespace: handed-over blocks are computed, exported and adopted under a PrivateSalt of this
server (core/block_pool.py), which no client's cache_salt can name. Only a generation request
that presents the transfer key and has no cache_salt of its own (the router forwarding the
decode request) reads them. `--kv-transfer-shared-prefix` puts them in the namespace every
unsalted request shares instead (the operator trusts every prefill replica and the network).

Limits: an import body is read here, not in the guard: at most `--max-kv-transfer-bytes`
(default: the payload of a whole context, kv_payload.KVFormat.payload_limit), one import at a
time (a second waits up to SLOT_WAIT_S, then 429), checked as it arrives and copied once. An
export pins its blocks on the engine thread and streams them a layer at a time from a worker
thread (kvserve/engine/kv_transfer.py), EXPORT_SLOTS at a time; the pins are dropped when the
response ends, whether it completed, the client went away or stopped reading.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import uuid

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from kvserve.config import parse_size
from kvserve.engine import kv_transfer
from kvserve.engine.async_engine import EngineDeadError
from kvserve.engine.kv_payload import (
    KEY_HEADER,
    PayloadReader,
    PayloadTooLarge,
    check_transfer_args,
)
from kvserve.sampling_params import SamplingParams
from kvserve.server.errors import (
    APIError,
    BadRequest,
    RequestTimeout,
    TooLarge,
    TooManyRequests,
    Unauthorized,
)
from kvserve.server.guard import DEFAULT_BODY_TIMEOUT, DRAIN_LIMIT
from kvserve.server.protocol import KVPrefillRequest
from kvserve.server.serving import (
    check_context,
    check_output,
    merge,
    open_streams,
    with_cancellation,
)

log = logging.getLogger("kvserve")

PREFILL_PATH = "/v1/kv/prefill"
IMPORT_PATH = "/v1/kv/import"
IMPORT_SLOTS = 1  # imports read and adopted at once
EXPORT_SLOTS = 2  # exports pinned and streamed at once
SLOT_WAIT_S = 5.0  # how long a call waits for a slot before its 429


def raw_body_paths(role: str | None) -> frozenset[str]:
    """The routes that read their own body (the guard passes them through unread)."""
    return frozenset({IMPORT_PATH}) if role in ("decode", "both") else frozenset()


def _closing(err: APIError) -> APIError:
    """The error, answered with Connection: close (the rest of the body is left unread)."""
    err.headers = {**(err.headers or {}), "Connection": "close"}
    return err


def _parse(model, raw: bytes):
    """A JSON body as `model`, with the same 400s FastAPI gives for its own bodies."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise BadRequest(
            f"We could not parse the JSON body of your request ({e}). The body must "
            "be a JSON object.",
            code="invalid_json",
        ) from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]
        raise RequestValidationError(errors) from None


class KVHandover:
    """The handover of one server: its role, key, namespace, limits and slots."""

    def __init__(
        self,
        engine,
        role: str,
        key: str,
        shared_prefix: bool = False,
        max_bytes: str | int | None = None,
        body_timeout: float | None = None,
    ) -> None:
        """ValueError when `role` is unknown, the key is missing or this engine cannot hand
        over KV (prefix caching off, several attention windows, several ranks)."""
        check_transfer_args(role, key)
        self.engine = engine
        self.role = role
        self.key = key.encode()
        self.format = kv_transfer.kv_format(engine.core)
        self.limit = parse_size(max_bytes) if max_bytes else self.format.payload_limit()
        self.salt = None if shared_prefix else kv_transfer.new_namespace()
        self.body_timeout = body_timeout or DEFAULT_BODY_TIMEOUT
        self.imports = asyncio.Semaphore(IMPORT_SLOTS)
        self.exports = asyncio.Semaphore(EXPORT_SLOTS)

    @property
    def exports_kv(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def imports_kv(self) -> bool:
        return self.role in ("decode", "both")

    def check_key(self, request: Request) -> None:
        given = request.headers.get(KEY_HEADER, "").encode("latin-1")
        if not hmac.compare_digest(given, self.key):
            raise Unauthorized(
                f"Incorrect or missing KV transfer key: send the header "
                f"'{KEY_HEADER}: <key>' with the server's --kv-transfer-key",
                code="invalid_kv_transfer_key",
            )

    def claim_namespace(self, body, request: Request) -> None:
        """A generation request that presents the transfer key (a wrong one is a 401) and has no
        cache_salt of its own reads and writes the handover's namespace."""
        if not self.imports_kv or KEY_HEADER not in request.headers:
            return
        self.check_key(request)
        if body.cache_salt is None and self.salt is not None:
            body.cache_salt = self.salt

    async def _slot(self, slots: asyncio.Semaphore, what: str, count: int) -> None:
        try:
            await asyncio.wait_for(slots.acquire(), SLOT_WAIT_S)
        except asyncio.TimeoutError:
            raise TooManyRequests(
                f"{what} run {count} at a time and none finished within "
                f"{SLOT_WAIT_S:g} s: retry later"
            ) from None

    # ---- export ----
    async def prefill(self, raw_request: Request) -> Response:
        """Compute the prompt (a one-token request) in the handover namespace, then stream the
        KV blocks the prefix cache now holds for it."""
        self.check_key(raw_request)
        ids = _parse(KVPrefillRequest, await raw_request.body()).prompt_token_ids
        engine = self.engine
        check_context(len(ids), 1, engine.max_model_len, "prompt_token_ids")
        # the engine checks the ids (empty, outside the vocabulary) and admission as for any request
        streams = await open_streams(
            engine,
            [ids],
            SamplingParams(max_tokens=1, temperature=0),
            f"kvprefill-{uuid.uuid4().hex}",
            0,
            self.salt,
            names={"prompt": "prompt_token_ids"},
        )
        async for _, out in merge(streams):
            check_output(out)
        await self._slot(self.exports, "KV exports", EXPORT_SLOTS)
        try:
            pinned = await self._pin(ids)
        except BaseException:
            self.exports.release()
            raise
        return ExportResponse(self, pinned)

    async def _pin(self, ids: list[int]) -> kv_transfer.Pinned:
        """Pin on the engine thread; if this caller is cancelled meanwhile, the pins the engine
        thread still takes are dropped as soon as they exist."""
        task = asyncio.ensure_future(
            self.engine.call(lambda core: kv_transfer.pin_blocks(core, ids, self.salt))
        )
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._release_orphan)
            raise

    def _release_orphan(self, task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is None:
            asyncio.ensure_future(self.release(task.result()))

    async def release(self, pinned: kv_transfer.Pinned) -> None:
        """Drop an export's pins on the engine thread (sent at once, even if this is cancelled)."""
        try:
            await self.engine.call(lambda core: kv_transfer.release(pinned))
        except EngineDeadError as e:  # the engine is gone: so are its blocks
            log.warning("could not release a KV export's blocks: %r", e)

    # ---- import ----
    async def import_kv(self, raw_request: Request) -> dict:
        """Adopt a prefill instance's KV blocks into this engine's prefix cache."""
        self.check_key(raw_request)  # before a byte of the body is read
        declared = raw_request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            raise _closing(
                TooLarge(
                    f"the KV payload of {declared} bytes is over the limit of "
                    f"{self.limit} bytes (--max-kv-transfer-bytes)",
                    "body",
                )
            )
        try:
            await self._slot(self.imports, "KV imports", IMPORT_SLOTS)
        except APIError as e:
            raise _closing(e) from None
        try:
            header, kv = await asyncio.wait_for(self._read(raw_request), self.body_timeout)
            tokens = await self.engine.call(
                lambda core: kv_transfer.adopt_blocks(
                    core, header.token_ids, header.num_blocks, kv, self.salt
                )
            )
        except asyncio.TimeoutError:
            late = f"the KV payload did not arrive within {self.body_timeout:g} s (--body-timeout)"
            raise _closing(RequestTimeout(late)) from None
        except PayloadTooLarge as e:
            raise _closing(TooLarge(str(e), "body")) from None
        except ValueError as e:
            raise _closing(BadRequest(str(e), "body")) from None
        finally:
            self.imports.release()
        return {"cached_tokens": tokens}

    async def _read(self, raw_request: Request):
        """The checked payload (header, KV bytes). After a refusal the rest of the body is read
        and dropped, up to DRAIN_LIMIT, so the client reads the answer before the close."""
        reader, error, dropped = PayloadReader(self.format, self.limit), None, 0
        try:
            async for chunk in raw_request.stream():
                if error is None:
                    try:
                        reader.feed(chunk)
                    except ValueError as e:
                        error = e
                else:
                    dropped += len(chunk)
                    if dropped > DRAIN_LIMIT:
                        break
        except ClientDisconnect:
            error = ValueError("the client went away before the KV payload was complete")
        if error is None:
            try:
                return reader.finish()
            except ValueError as e:
                error = e
        del reader  # its buffer goes now, not when a cycle through the traceback is collected
        raise error.with_traceback(None)

    def install(self, app: FastAPI) -> None:
        if self.exports_kv:

            @app.post(PREFILL_PATH)
            @with_cancellation
            async def kv_prefill(raw_request: Request):
                """Disaggregated prefill: compute the prompt, then hand over its KV blocks
                (kvserve/engine/kv_transfer.py), as application/octet-stream."""
                return await self.prefill(raw_request)

        if self.imports_kv:

            @app.post(IMPORT_PATH)
            async def kv_import(raw_request: Request):
                """Disaggregated decode: adopt a prefill instance's KV blocks."""
                return await self.import_kv(raw_request)


class ExportResponse(Response):
    """The payload of pinned blocks: header, then each layer's K and V read by a worker thread
    as the client takes them. The pins and the export slot are let go when it ends, however."""

    media_type = "application/octet-stream"

    def __init__(self, handover: KVHandover, pinned: kv_transfer.Pinned) -> None:
        self.handover = handover
        self.pinned = pinned
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", self.media_type.encode()),
            (b"content-length", str(pinned.size).encode()),
        ]

    async def __call__(self, scope, receive, send) -> None:
        gone = asyncio.Event()
        watcher = asyncio.create_task(_watch_disconnect(receive, gone))
        timeout = self.handover.body_timeout
        pinned = self.pinned
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            chunks = [pinned.prefix]
            for part in range(pinned.num_parts if pinned.blocks else 0):
                if gone.is_set():
                    return
                await asyncio.wait_for(
                    send({"type": "http.response.body", "body": chunks.pop(), "more_body": True}),
                    timeout,
                )
                chunks.append(await asyncio.to_thread(kv_transfer.read_part, pinned, part))
            await asyncio.wait_for(
                send({"type": "http.response.body", "body": chunks.pop(), "more_body": False}),
                timeout,
            )
        except asyncio.TimeoutError:
            log.warning(
                "a KV export's client took no data for %gs (--body-timeout): cut off", timeout
            )
        except kv_transfer.ExportAborted as e:
            log.warning("KV export cut off: %s", e)
        finally:
            watcher.cancel()
            self.handover.exports.release()
            await self.handover.release(pinned)


async def _watch_disconnect(receive, gone: asyncio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()
