"""Connection limits of `kvserve serve`, on servers of their own: header, body and idle timeouts
(raw sockets: slow-loris, silent and idle connections, a partial body), --max-connections, the
API key on every route but /health (and /metrics with --metrics-public), and a second SIGTERM
exiting at once with its documented code."""

import http.client
import json
import os
import select
import signal
import socket
import time

import httpx
import pytest

from kvserve.server.launcher import FORCED_EXIT_CODE
from tests.server.conftest import API_KEY

TIMEOUT = 1  # --header-timeout, --body-timeout and --keep-alive-timeout of the module's server
GRACE = 5  # how much later than its timeout a connection may close
BASE_ARGS = [
    "--threads",
    "1",
    "--max-model-len",
    "512",
    "--kv-cache-memory",
    "64MiB",
    "--no-access-log",
]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
KEYED_ROUTES = [
    ("POST", "/tokenize", {"prompt": "Hello"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/version", None),
    ("GET", "/metrics", None),
    ("GET", "/v1/models", None),
    ("GET", "/openapi.json", None),
    ("GET", "/docs", None),
]


def _started(server_factory, args):
    srv = server_factory([*BASE_ARGS, *args])
    srv.wait_ready()
    return srv


def _finished(srv):
    srv.stop()
    os.unlink(srv.log.name)


@pytest.fixture(scope="module")
def timeouts_server(server_factory):
    srv = _started(
        server_factory,
        [
            "--api-key",
            API_KEY,
            "--header-timeout",
            str(TIMEOUT),
            "--body-timeout",
            str(TIMEOUT),
            "--keep-alive-timeout",
            str(TIMEOUT),
        ],
    )
    yield srv
    _finished(srv)


@pytest.fixture(scope="module")
def capped_server(server_factory):
    """Four connections at most; timeouts long enough to hold four idle connections meanwhile."""
    srv = _started(
        server_factory,
        [
            "--api-key",
            API_KEY,
            "--max-connections",
            "4",
            "--metrics-public",
            "--header-timeout",
            "60",
            "--keep-alive-timeout",
            "60",
        ],
    )
    yield srv
    _finished(srv)


def _connect(srv) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=TIMEOUT + GRACE)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed);
    fails when it is still open after the socket's timeout."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    except socket.timeout:
        raise AssertionError(
            f"connection still open after {sock.gettimeout()}s; got {data[:200]!r}"
        )
    return data


def _response(sock: socket.socket, method: str = "GET") -> tuple[int, dict, bytes]:
    r = http.client.HTTPResponse(sock, method=method)
    r.begin()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()


def _get(sock: socket.socket, path: str, headers: str = "") -> tuple[int, dict, bytes]:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}\r\n".encode())
    return _response(sock)


def test_silent_connection_is_closed(timeouts_server):
    with _connect(timeouts_server) as sock:
        assert _read_until_closed(sock) == b""


def test_slow_loris_headers_are_cut_off(timeouts_server):
    """Headers dripped one line at a time never complete; the connection is closed anyway."""
    with _connect(timeouts_server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        deadline = time.monotonic() + TIMEOUT + GRACE
        line = 0
        while not select.select([sock], [], [], 0.2)[0]:
            assert time.monotonic() < deadline, "slow-loris connection still open"
            try:
                sock.sendall(f"X-Drip-{line}: a\r\n".encode())
            except (BrokenPipeError, ConnectionResetError):
                break
            line += 1
        assert _read_until_closed(sock) == b""


def test_idle_keep_alive_connection_is_closed(timeouts_server):
    with _connect(timeouts_server) as sock:
        status, _, body = _get(sock, "/health")
        assert status == 200 and json.loads(body)["status"] == "ok"
        assert _read_until_closed(sock) == b""


def test_keep_alive_serves_several_requests(timeouts_server):
    with _connect(timeouts_server) as sock:
        for _ in range(3):
            assert _get(sock, "/health")[0] == 200


def test_partial_body_gets_408_and_close(timeouts_server):
    with _connect(timeouts_server) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            b"Authorization: Bearer "
            + API_KEY.encode()
            + b'\r\nContent-Length: 100\r\n\r\n{"prompt":'
        )
        status, headers, body = _response(sock, "POST")
        assert status == 408
        assert headers["connection"] == "close"
        error = json.loads(body)["error"]
        assert error["code"] == "request_timeout" and "--body-timeout" in error["message"]
        assert _read_until_closed(sock) == b""


def test_body_in_pieces_within_the_timeout_is_read(timeouts_server):
    body = json.dumps({"prompt": "Hello there"}).encode()
    with _connect(timeouts_server) as sock:
        sock.sendall(
            b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer "
            + API_KEY.encode()
            + b"\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body[:5]
        )
        time.sleep(TIMEOUT / 5)
        sock.sendall(body[5:])
        status, _, answer = _response(sock, "POST")
        assert status == 200 and json.loads(answer)["count"] > 0


def test_long_response_outlives_the_timeouts(timeouts_server):
    """A stream read slowly stays open past the header and idle timeouts: they run only between
    requests."""
    with httpx.Client(base_url=timeouts_server.base_url, headers=AUTH, timeout=120) as client:
        with client.stream(
            "POST",
            "/v1/completions",
            json={"prompt": "Count:", "max_tokens": 300, "ignore_eos": True, "stream": True},
        ) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            time.sleep(3 * TIMEOUT)
            rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]"


@pytest.mark.parametrize("method,path,body", KEYED_ROUTES)
def test_api_key_required(timeouts_server, method, path, body):
    url = timeouts_server.base_url + path
    refused = httpx.request(method, url, json=body, timeout=30)
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.request(method, url, json=body, headers=AUTH, timeout=30).status_code == 200


def test_health_needs_no_key(timeouts_server):
    assert httpx.get(f"{timeouts_server.base_url}/health", timeout=30).status_code == 200


def test_metrics_public(capped_server):
    assert httpx.get(f"{capped_server.base_url}/metrics", timeout=30).status_code == 200
    assert httpx.get(f"{capped_server.base_url}/version", timeout=30).status_code == 401


def test_connection_over_the_cap_is_refused(capped_server):
    held = [_connect(capped_server) for _ in range(4)]
    try:
        for sock in held:  # each is accepted and counted: it answers
            assert _get(sock, "/health")[0] == 200
        with _connect(capped_server) as fifth:
            status, headers, body = _get(fifth, "/health")
            assert status == 503
            assert headers["retry-after"] == "1" and headers["connection"] == "close"
            assert json.loads(body)["error"]["code"] == "too_many_connections"
            assert _read_until_closed(fifth) == b""
    finally:
        held.pop().close()
    try:
        assert _health_on_a_new_connection(capped_server) == 200
    finally:
        for sock in held:
            sock.close()


def _health_on_a_new_connection(srv) -> int:
    """/health on a fresh connection, once the server has seen a freed one close."""
    deadline = time.monotonic() + GRACE
    while True:
        with _connect(srv) as sock:
            status = _get(sock, "/health")[0]
        if status != 503 or time.monotonic() > deadline:
            return status
        time.sleep(0.1)


def test_second_sigterm_exits_at_once(server_factory):
    srv = _started(server_factory, [])
    try:
        with httpx.Client(base_url=srv.base_url, timeout=120) as client:
            with client.stream(
                "POST",
                "/v1/completions",
                json={"prompt": "Count:", "max_tokens": 500, "ignore_eos": True, "stream": True},
            ) as r:
                assert next(line for line in r.iter_lines() if line.startswith("data:"))
                srv.proc.send_signal(signal.SIGTERM)
                _wait_draining(srv)
                srv.proc.send_signal(signal.SIGTERM)
                assert srv.proc.wait(GRACE) == FORCED_EXIT_CODE
        log = srv.log_text()
        assert "second signal: exiting now" in log and "Traceback" not in log
    finally:
        _finished(srv)


def _wait_draining(srv) -> None:
    deadline = time.monotonic() + 60
    while httpx.get(f"{srv.base_url}/health", timeout=30).status_code != 503:
        assert time.monotonic() < deadline, "server never started draining"
        time.sleep(0.05)
