"""A second, tiny server (one running request, one waiting slot): health during a long prefill,
429 with Retry-After past --max-waiting, and SIGTERM draining to exit code 0."""

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

ARGS = [
    "--max-num-seqs",
    "1",
    "--max-waiting",
    "1",
    "--max-num-batched-tokens",
    "2048",
    "--max-model-len",
    "1024",
    "--kv-cache-memory",
    "64MiB",
    "--shutdown-timeout",
    "120",
    "--no-access-log",
]


@pytest.fixture(scope="module")
def tiny(server_factory):
    srv = server_factory(ARGS)
    srv.wait_ready()
    yield srv
    srv.stop()
    os.unlink(srv.log.name)


def _stream(base_url: str, body: dict):
    """Open a streaming completion; returns (client, response, line iterator)."""
    c = httpx.Client(base_url=base_url, timeout=300)
    r = c.send(
        c.build_request("POST", "/v1/completions", json={**body, "stream": True}), stream=True
    )
    return c, r, r.iter_lines()


def _raw_post(port: int, path: str, body: dict) -> socket.socket:
    """Send a request on a plain socket and leave it pending (close the socket to drop it)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def _metric(base_url: str, name: str) -> float:
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_health_answers_during_long_prefill(tiny):
    """A 1000-token prompt is one long prefill step; /health keeps answering meanwhile."""
    prompt = [1000 + i % 5000 for i in range(1000)]
    done = threading.Event()
    result = {}

    def long_request():
        result["r"] = httpx.post(
            f"{tiny.base_url}/v1/completions", timeout=300, json={"prompt": prompt, "max_tokens": 1}
        )
        done.set()

    t = threading.Thread(target=long_request)
    t.start()
    answered_while_busy = 0
    while not done.is_set():
        if (
            httpx.get(f"{tiny.base_url}/health", timeout=60).status_code == 200
            and not done.is_set()
        ):
            answered_while_busy += 1
    t.join()
    assert result["r"].status_code == 200
    assert answered_while_busy >= 2


def test_queue_full_gets_429(tiny):
    long = {"prompt": "Count slowly:", "max_tokens": 300, "ignore_eos": True}
    c1, r1, lines1 = _stream(tiny.base_url, long)  # runs (max-num-seqs 1)
    assert r1.status_code == 200 and next(x for x in lines1 if x.startswith("data:"))
    second = _raw_post(tiny.port, "/v1/completions", long)  # waits in the queue (max-waiting 1)
    deadline = time.monotonic() + 60
    while _metric(tiny.base_url, "kvserve:num_requests_waiting") < 1:
        assert time.monotonic() < deadline, "second request never queued"
        time.sleep(0.02)
    r3 = httpx.post(f"{tiny.base_url}/v1/completions", json=long, timeout=60)
    assert r3.status_code == 429 and int(r3.headers["Retry-After"]) >= 1
    assert r3.json()["error"]["type"] == "rate_limit_error"
    r1.close()
    c1.close()
    second.close()  # dropping the queued request's connection aborts it too
    deadline = time.monotonic() + 60
    while _metric(tiny.base_url, "kvserve:num_requests_running") or _metric(
        tiny.base_url, "kvserve:num_requests_waiting"
    ):
        assert time.monotonic() < deadline, "requests not aborted"
        time.sleep(0.05)


def test_sigterm_drains_then_exits_0(tiny):
    c, r, lines = _stream(
        tiny.base_url,
        {
            "prompt": "Once upon a time",
            "max_tokens": 40,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert r.status_code == 200
    first = next(x for x in lines if x.startswith("data:"))
    tiny.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while httpx.get(f"{tiny.base_url}/health").status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    refused = httpx.post(f"{tiny.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "service_unavailable"
    rest = [x for x in lines if x.startswith("data:")]  # the running request still finishes
    assert first and rest[-1] == "data: [DONE]" and '"completion_tokens":40' in rest[-2]
    assert any('"finish_reason":"length"' in x for x in rest)
    c.close()
    assert tiny.proc.wait(60) == 0
