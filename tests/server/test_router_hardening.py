"""`kvserve router` against a client that sends what it should not, in front of the session's
`kvserve serve` as its one replica: an odd header is forwarded cleaned up (and never takes the
replica out of rotation while another client is served), an endless chunked body gets its 413
with the router's memory flat, and JSON too deep or with a too long integer is a 400 naming the
field."""

from __future__ import annotations

import select
import socket
import threading
import time

import httpx
import pytest

from tests.server.conftest import API_KEY
from tests.server.test_router import RouterProcess

CAP = 2**20
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def router(server_process):
    r = RouterProcess([server_process.base_url], ["--router-max-body-bytes", str(CAP)])
    yield r
    r.stop()


def raw_request(url: str, head: bytes, body: bytes) -> tuple[int, bytes]:
    """One request written byte for byte (no client library cleans its headers up):
    (status, body)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nConnection: close\r\n"
            + head
            + b"Content-Length: %d\r\n\r\n" % len(body)
            + body
        )
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    status = int(answer.split(b" ", 2)[1])
    return status, answer.split(b"\r\n\r\n", 1)[1]


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def test_a_malformed_header_is_cleaned_up_and_never_takes_the_replica_out(router, model_name):
    ask = {
        "model": model_name,
        "prompt": "The capital of France is",
        "max_tokens": 8,
        "temperature": 0,
    }
    idle = httpx.post(f"{router.url}/v1/completions", json=ask, headers=AUTH, timeout=60)
    assert idle.status_code == 200
    expected = idle.json()["choices"][0]["text"]
    answers: list[tuple[int, str]] = []

    def victim():
        for _ in range(6):
            r = httpx.post(f"{router.url}/v1/completions", json=ask, headers=AUTH, timeout=60)
            answers.append(
                (r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text)
            )

    thread = threading.Thread(target=victim)
    thread.start()
    auth = f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n".encode()
    small = b'{"model": "%s", "prompt": "Hi", "max_tokens": 1}' % model_name.encode()
    attacks = 0
    while thread.is_alive() or attacks < 4:
        odd = b"Accept: */* \r\nUser-Agent: caf\xe9 \r\n"
        status, body = raw_request(router.url, auth + odd, small)
        assert status == 200, body  # odd but harmless: forwarded, cleaned up
        status, body = raw_request(
            router.url,
            b"Authorization: Bearer "
            + API_KEY.encode()
            + b"\r\nContent-Type: application/json\xff\r\n",
            small,
        )
        assert status == 400 and b'"param":"content-type"' in body, body
        attacks += 1
    thread.join()
    assert answers == [(200, expected)] * 6
    replica = router.stats()["replicas"][0]
    assert replica["healthy"] and replica["failures"] == 0, replica


def test_an_endless_chunked_body_gets_413_with_the_router_memory_flat(router):
    httpx.get(f"{router.url}/health", timeout=10)
    before = peak_rss(router.proc.pid)
    host, port = router.url.removeprefix("http://").split(":")
    chunk = b"10000\r\n" + b" " * 0x10000 + b"\r\n"
    sent, answer = 0, b""
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nAuthorization: Bearer "
            + API_KEY.encode()
            + b"\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        try:
            while sent < 256 * CAP and not select.select([s], [], [], 0)[0]:
                s.sendall(chunk)
                sent += 0x10000
        except OSError:  # the router closed the connection after its answer
            pass
        deadline = time.monotonic() + 30
        try:
            while (part := s.recv(65536)) and time.monotonic() < deadline:
                answer += part
        except OSError:
            pass
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert b'"code":"request_too_large"' in answer
    assert sent < 128 * CAP  # it stopped reading soon after the cap
    assert peak_rss(router.proc.pid) - before < 4 * CAP
    assert httpx.get(f"{router.url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize(
    "body, param",
    [
        (b'{"model": "m", "prompt": ' + b"[" * 20000 + b"]" * 20000 + b"}", "prompt"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": '
            + b"9" * 5000
            + b"}",
            "max_tokens",
        ),
    ],
)
def test_deep_json_and_a_5000_digit_integer_are_400s_naming_the_field(router, body, param):
    r = httpx.post(
        f"{router.url}/v1/chat/completions",
        content=body,
        timeout=30,
        headers={**AUTH, "content-type": "application/json"},
    )
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
