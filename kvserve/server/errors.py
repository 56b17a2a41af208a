"""OpenAI-style errors: every failure the server answers has the body
`{"error": {"message", "type", "param", "code"}}`, whatever raised it.

Bad input is a 4xx, never a 500: request validation (pydantic) and malformed JSON are 400 with
`param` naming the field, as OpenAI answers them.
"""
from __future__ import annotations

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

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
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

    def __init__(self, message: str, retry_after: int = 5):
        super().__init__(message, headers={"Retry-After": str(retry_after)})


class InternalError(APIError):
    status = 500
    type = "server_error"
    code = "internal_error"


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "function-after", "function-before"}


def validation_error(exc: RequestValidationError) -> BadRequest:
    """The first pydantic error as a 400 with the field path in `param` (e.g. messages.0.content)."""
    errors = exc.errors()
    if not errors:
        return BadRequest("invalid request")
    err = errors[0]
    if err.get("type") == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return BadRequest(f"We could not parse the JSON body of your request ({detail}). "
                          "The body must be a JSON object.", code="invalid_json")
    parts: list[str] = []
    for item in err.get("loc", ())[1:]:           # loc[0] is "body"
        if isinstance(item, int):
            parts.append(str(item))
        elif item in _TYPE_TAGS or "[" in item or "(" in item:
            break                                 # a union member's type tag, not a field
        else:
            parts.append(item)
    param = ".".join(parts) or None
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    if err.get("type") == "missing":
        msg = "field required"
    if err.get("type") == "model_attributes_type" or (not parts and err.get("type", "").endswith("_type")):
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
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return InternalError(f"internal error: {type(exc).__name__}").response()
