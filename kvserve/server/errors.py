"""OpenAI-style errors: every failure the server answers has the body
`{"error": {"message", "type", "param", "code"}}`, whatever raised it.

Bad input is a 4xx, never a 500: request validation (pydantic) and malformed JSON are 400 with
`param` naming the field, as OpenAI answers them.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("kvserve")


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class BadRequest(APIError):
    status = 400


class Unauthorized(APIError):
    status = 401
    code = "invalid_api_key"


class NotFound(APIError):
    status = 404
    code = "not_found"


class RequestTimeout(APIError):
    status = 408
    code = "request_timeout"


class TooLarge(APIError):
    status = 413
    code = "request_too_large"


class TooManyRequests(APIError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message, headers={"Retry-After": str(retry_after)})


class Unavailable(APIError):
    status = 503
    type = "service_unavailable_error"
    code = "service_unavailable"

    def __init__(self, message: str, retry_after: int = 5, code: str | None = None):
        super().__init__(message, code=code, headers={"Retry-After": str(retry_after)})


class InternalError(APIError):
    status = 500
    type = "server_error"
    code = "internal_error"


_REASONS = {
    408: "Request Timeout",
    413: "Payload Too Large",
    429: "Too Many Requests",
    503: "Service Unavailable",
}


def raw_response(err: APIError, close: bool = False) -> bytes:
    """The whole HTTP/1.1 response for `err`, as bytes, for answering below ASGI (the HTTP
    protocol writes it to the transport itself)."""
    body = json.dumps(err.body()).encode()
    head = [
        f"HTTP/1.1 {err.status} {_REASONS.get(err.status, 'Error')}",
        "content-type: application/json",
        f"content-length: {len(body)}",
    ]
    head += [f"{k.lower()}: {v}" for k, v in (err.headers or {}).items()]
    if close:
        head.append("connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_TYPE_TAGS = {
    "str",
    "int",
    "float",
    "bool",
    "dict",
    "list",
    "none",
    "function-after",
    "function-before",
}


def validation_error(exc: RequestValidationError) -> BadRequest:
    """The first pydantic error as a 400 with the field path in `param` (e.g.
    messages.0.content)."""
    errors = exc.errors()
    if not errors:
        return BadRequest("invalid request")
    # For a union (str | list[str]) pydantic reports every member's failure; the member whose type
    # matched and whose value was wrong (e.g. a lone surrogate in list item 1) says what to fix.
    err = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    if err.get("type") == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return BadRequest(
            f"We could not parse the JSON body of your request ({detail}). "
            "The body must be a JSON object.",
            code="invalid_json",
        )
    parts: list[str] = []
    for item in err.get("loc", ())[1:]:  # loc[0] is "body"
        if isinstance(item, int):
            parts.append(str(item))
        elif item in _TYPE_TAGS or "[" in item or "(" in item:
            continue  # a union member's type tag, not a field
        else:
            parts.append(item)
    param = ".".join(parts) or None
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    if err.get("type") == "missing":
        msg = "field required"
    if err.get("type") == "model_attributes_type" or (
        not parts and err.get("type", "").endswith("_type")
    ):
        msg = "the request body must be a JSON object"
    return BadRequest(f"{param}: {msg}" if param else msg, param=param)


_STATUS_ERRORS = {401: Unauthorized, 404: NotFound, 413: TooLarge}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        if exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        cls = _STATUS_ERRORS.get(exc.status_code, APIError)
        err = cls(message)
        err.status = exc.status_code
        if exc.status_code >= 500:
            err.type = "server_error"
        return JSONResponse(
            err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )

    app.add_middleware(InternalErrorMiddleware)
    _document_400(app)


class InternalErrorMiddleware:
    """Pure ASGI, inside Starlette's ServerErrorMiddleware: an exception no handler took becomes
    a 500 with an OpenAI error body, and the keep-alive connection stays usable (Starlette's
    own 500 path re-raises, and uvicorn then drops the connection without `Connection: close`)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:  # mid-response: nothing sane to add; the body ends here
                return
            body = json.dumps(
                InternalError(f"internal error: {type(exc).__name__}").body()
            ).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 500,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})


_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def _document_400(app: FastAPI) -> None:
    """The OpenAPI document says what the server answers: 400 with an OpenAI error body where
    FastAPI would write 422 (validation errors are 400 here)."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = generate()
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                responses = operation.get("responses", {})
                if responses.pop("422", None) is not None:
                    responses["400"] = {
                        "description": "Invalid request: the error names the field in `param`",
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/ErrorResponse"}
                            }
                        },
                    }
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        components["ErrorResponse"] = _ERROR_SCHEMA
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
