"""Connection limits of `kvserve serve`, below the ASGI app (the body read timeout is in guard.py).

- `protocol_class(limits)`: uvicorn's HTTP protocol (httptools' C parser when installed, else
  h11's pure-Python one: about half the server's time per request when a burst gets 429s) with
  `ConnectionLimitsMixin`: a header read timeout (a connection whose
  request line and headers are not complete within `header_timeout` seconds of opening, or of the
  end of the previous response, is closed: slow-loris and never-speaking connections) and a cap
  on open connections (one over `max_connections` gets a 503 with Retry-After and is closed).
  uvicorn's own idle keep-alive timer stays as it is.
- The open-files limit: `raise_open_files_limit()` lifts the soft RLIMIT_NOFILE to the hard one,
  `default_max_connections()` keeps the cap below it.
- `AcceptErrorHandler`, the event loop's exception handler: when accept() fails at the fd limit
  (EMFILE / ENFILE), the pending connection is accepted on a reserve descriptor and closed at
  once (refused, not left hanging), and the error is logged once per interval with a count,
  instead of asyncio's traceback per failed accept. Every other error goes to asyncio's handler.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import socket
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field

from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools not installed
    HttpToolsProtocol = None

from kvserve.server.errors import Unavailable, raw_response

log = logging.getLogger("kvserve")

DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_KEEP_ALIVE_TIMEOUT = 5.0
MAX_CONNECTIONS_CEILING = 2048
FD_RESERVE = 64  # descriptors kept for everything that is not a client connection
REFUSAL_LINGER = 1.0  # seconds a refused connection may take to read its 503 before it is closed
LOG_INTERVAL = 10.0
OUT_OF_FDS = (errno.EMFILE, errno.ENFILE)
OUT_OF_RESOURCES = OUT_OF_FDS + (errno.ENOBUFS, errno.ENOMEM)


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    max_connections: int = MAX_CONNECTIONS_CEILING
    # (headers of a generation request, how many admitted requests have not reserved their
    # queue places yet) -> the raw response it gets anyway (429 queue full, 503 draining), or
    # None; answered by the httptools protocol before any ASGI work
    early_reject: Callable[[list[tuple[bytes, bytes]], int], bytes | None] | None = None
    pending: PendingAdmissions = field(default_factory=lambda: PendingAdmissions())


class PendingAdmissions:
    """Generation requests let through the early check whose queue places are not reserved yet
    (their body is being read or parsed). A burst's requests all pass the headers check before
    the first one reaches the engine's reservation; counting them keeps the early 429 exact."""

    def __init__(self) -> None:
        self.count = 0


class Admission:
    """One request counted in PendingAdmissions until release() (idempotent): at its queue
    reservation (serving.reserve_capacity) or when its response ends, whichever comes first."""

    def __init__(self, pending: PendingAdmissions) -> None:
        self.pending = pending
        self.open = True
        pending.count += 1

    def release(self) -> None:
        if self.open:
            self.open = False
            self.pending.count -= 1


# The request's Admission, in the context its ASGI task is created with.
CURRENT_ADMISSION: ContextVar[Admission | None] = ContextVar("kvserve_admission", default=None)


class RateLimitedLog:
    """Logs a kind of warning at most once per `interval` seconds; the next one that gets through
    says how many were suppressed in between."""

    def __init__(self, interval: float = LOG_INTERVAL, logger: logging.Logger = log):
        self.interval = interval
        self.logger = logger
        self.last_logged: dict[str, float] = {}
        self.suppressed: dict[str, int] = {}

    def warning(self, kind: str, message: str) -> None:
        now = time.monotonic()
        last = self.last_logged.get(kind)
        if last is not None and now - last < self.interval:
            self.suppressed[kind] = self.suppressed.get(kind, 0) + 1
            return
        self.last_logged[kind] = now
        skipped = self.suppressed.pop(kind, 0)
        suffix = f" ({skipped} more since the last such message)" if skipped else ""
        self.logger.warning("%s%s", message, suffix)


def raise_open_files_limit() -> int:
    """Lift the soft RLIMIT_NOFILE to the hard limit when it is lower; returns the soft limit
    in force afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, hard, e)
    return soft


def default_max_connections(open_files_limit: int) -> int:
    """A connection cap that leaves FD_RESERVE descriptors (or half of a tiny limit) free."""
    if open_files_limit == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS_CEILING
    return max(
        1, min(MAX_CONNECTIONS_CEILING, max(open_files_limit - FD_RESERVE, open_files_limit // 2))
    )


def refusal_response(max_connections: int) -> bytes:
    """The raw HTTP/1.1 503 written to a connection over the cap before closing it."""
    return raw_response(
        Unavailable(
            f"the server has {max_connections} open connections, its limit "
            "(--max-connections); retry later",
            retry_after=1,
            code="too_many_connections",
        ),
        close=True,
    )


class ConnectionLimitsMixin:
    """For a uvicorn HTTP protocol (h11 or httptools: both keep `cycle`, `connections`, `loop`,
    `transport`): the header read timeout and the connection cap. Between requests the header
    timer runs alongside uvicorn's keep-alive timer (which any received byte stops); once a
    request's headers are in, neither runs until its response is sent."""

    limits = ConnectionLimits()
    warnings = RateLimitedLog()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timer: asyncio.TimerHandle | None = None
        self.refused = False
        self.linger_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self.refuse(transport)
            return
        super().connection_made(transport)
        self.update_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel_header_timer()
        if self.linger_timer is not None:
            self.linger_timer.cancel()
        if not self.refused:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        super().data_received(data)
        self.update_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.update_header_timer()

    def refuse(self, transport: asyncio.Transport) -> None:
        """Answer 503 and close. The close waits for the client's end of stream (or REFUSAL_LINGER
        seconds) while discarding what it sends: closing on unread request bytes would reset the
        connection, and the client would lose the 503."""
        self.refused = True
        self.warnings.warning(
            "refused",
            f"refusing connections over --max-connections "
            f"{self.limits.max_connections} (503, then closed)",
        )
        transport.write(refusal_response(self.limits.max_connections))
        if transport.can_write_eof():
            transport.write_eof()
        self.linger_timer = self.loop.call_later(REFUSAL_LINGER, transport.close)

    def request_in_progress(self) -> bool:
        """A request's headers are in and its response is not yet complete."""
        return self.cycle is not None and not self.cycle.response_complete

    def update_header_timer(self) -> None:
        if self.transport.is_closing() or self.request_in_progress():
            self.cancel_header_timer()
        elif self.header_timer is None:
            self.header_timer = self.loop.call_later(
                self.limits.header_timeout, self.header_timed_out
            )

    def cancel_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def header_timed_out(self) -> None:
        self.header_timer = None
        if not self.transport.is_closing() and not self.request_in_progress():
            log.debug(
                "closing a connection whose request headers did not arrive within %.1fs",
                self.limits.header_timeout,
            )
            self.transport.close()


GENERATION_PATHS = frozenset({b"/v1/completions", b"/v1/chat/completions"})


class EarlyRejectMixin:
    """For uvicorn's httptools protocol: a generation request that `limits.early_reject` says
    can only get a 429 or 503 now is answered from the parser's headers callback, before any
    ASGI work (no request cycle, no task, no middleware): a burst of them costs the event loop
    little. Only when no other request is in flight on the connection (pipelined responses must
    keep their order) and the client does not wait for `100 Continue`; its body is read and
    dropped, and the connection stays open unless the client asked to close it."""

    def on_message_begin(self) -> None:
        self.rejecting = False
        self.release_admission()
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        response = self.early_response()
        if response is None:
            if not self.is_generation():
                return super().on_headers_complete()
            self.admission = Admission(self.limits.pending)
            token = CURRENT_ADMISSION.set(self.admission)  # the ASGI task copies this context
            try:
                return super().on_headers_complete()
            finally:
                CURRENT_ADMISSION.reset(token)
        self.rejecting = True
        self.transport.write(response)

    def is_generation(self) -> bool:
        return (
            self.parser.get_method() == b"POST" and self.url.split(b"?", 1)[0] in GENERATION_PATHS
        )

    def early_response(self) -> bytes | None:
        reject = self.limits.early_reject
        if (
            reject is None
            or not self.is_generation()
            or self.expect_100_continue
            or self.pipeline
            or (self.cycle is not None and not self.cycle.response_complete)
        ):
            return None
        return reject(self.headers, self.limits.pending.count)

    def release_admission(self) -> None:
        admission = getattr(self, "admission", None)
        if admission is not None:
            admission.release()
            self.admission = None

    def on_response_complete(self) -> None:
        self.release_admission()
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        self.release_admission()
        super().connection_lost(exc)

    def on_body(self, body: bytes) -> None:
        if not getattr(self, "rejecting", False):
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not getattr(self, "rejecting", False):
            return super().on_message_complete()
        self.rejecting = False
        if not self.parser.should_keep_alive():
            self.transport.close()
            return
        self.on_response_complete()


def protocol_class(limits: ConnectionLimits, use_httptools: bool = True) -> type:
    """uvicorn's HTTP protocol (httptools when installed and `use_httptools`, else h11) with
    ConnectionLimitsMixin (and, on httptools, EarlyRejectMixin) bound to `limits`, for
    `uvicorn.Config(http=...)`."""
    if use_httptools and HttpToolsProtocol is not None:
        bases = (ConnectionLimitsMixin, EarlyRejectMixin, HttpToolsProtocol)
    else:
        bases = (ConnectionLimitsMixin, H11Protocol)
    return type(
        f"Limited{bases[-1].__name__}", bases, {"limits": limits, "warnings": RateLimitedLog()}
    )


class AcceptErrorHandler:
    """The loop's exception handler (`loop.set_exception_handler(AcceptErrorHandler())`): accept()
    out of file descriptors refuses the waiting connection and logs once per interval; any other
    error goes to asyncio's default handler."""

    def __init__(self, interval: float = LOG_INTERVAL):
        self.warnings = RateLimitedLog(interval)
        self.reserve_fd = open_reserve_fd()
        self.refused = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if not (isinstance(exc, OSError) and exc.errno in OUT_OF_RESOURCES and "socket" in context):
            loop.default_exception_handler(context)
            return
        if exc.errno in OUT_OF_FDS:
            self.refuse_waiting_connection(context["socket"])
        self.warnings.warning(
            "accept",
            f"accept() failed: {exc.strerror} (errno {exc.errno}); "
            f"refusing new connections until descriptors free up "
            f"({self.refused} refused so far)",
        )

    def refuse_waiting_connection(self, listening) -> None:
        """Close the reserve descriptor, accept one waiting connection on it, close that, and
        take the reserve back."""
        if self.reserve_fd is None:
            self.reserve_fd = open_reserve_fd()
            return
        os.close(self.reserve_fd)
        self.reserve_fd = None
        listener = socket.socket(fileno=listening.fileno())  # the same descriptor, not a copy
        try:
            listener.setblocking(False)
            conn, _ = listener.accept()
            conn.close()
            self.refused += 1
        except OSError:
            pass
        finally:
            listener.detach()
            self.reserve_fd = open_reserve_fd()


def open_reserve_fd() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY)
    except OSError:
        return None
