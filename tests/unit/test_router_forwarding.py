"""What the router refuses from a client before forwarding (kvserve/router/forwarding.py), and
whose fault a failed forward is (kvserve/router/app.py): a client's bad headers, body or JSON get
its own 4xx and never count against the replica; a replica that drops a request does count."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fastapi.testclient import TestClient

from kvserve.router import forwarding
from kvserve.router.app import build_router_app
from kvserve.router.forwarding import MAX_JSON_DEPTH, forward_headers, parse_json_body
from kvserve.router.policy import Router
from kvserve.server.errors import APIError


def refused(fn, *args) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args)
    return e.value


def test_headers_are_allow_listed_trimmed_and_bad_ones_named():
    out = forward_headers(
        [
            (b"Accept", b"*/* "),
            (b"authorization", b"\tBearer k "),
            (b"authorization", b"Bearer second"),
            (b"cookie", b"a=b"),
            (b"connection", b"keep-alive, x"),
            (b"user-agent", b"caf\xe9"),
            (b"content-type", b"application/json"),
        ]
    )
    assert out == {"accept": "*/*", "authorization": "Bearer k", "content-type": "application/json"}
    for name in (b"content-type", b"authorization"):
        err = refused(forward_headers, [(name, b"application/json\xe9")])
        assert err.status == 400 and err.param == name.decode()
    assert refused(forward_headers, [(b"content-type", b"a\x01b")]).param == "content-type"


def test_json_nesting_and_integer_length_are_400s_naming_the_field():
    levels = MAX_JSON_DEPTH + 5
    nested = b'{"model": "m", "prompt": ' + b"[" * levels + b"]" * levels + b"}"
    err = refused(parse_json_body, nested)
    assert err.status == 400 and err.param == "prompt" and "nests more than" in err.message
    # too deep for json.loads itself (RecursionError): the field is found by a scan of the text
    deep = (
        b'{"model": "m", "x": "[{", "messages": ' + b'{"a": [' * 5000 + b"1" + b"]}" * 5000 + b"}"
    )
    assert refused(parse_json_body, deep).param == "messages"
    assert refused(parse_json_body, b"[" * 100_000).param is None
    big = b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b"}"
    err = refused(parse_json_body, big)
    assert err.status == 400 and err.param == "max_tokens" and "5000 digits" in err.message
    assert refused(parse_json_body, b'{"prompt": [1, -' + b"7" * 5000 + b"]}").param == "prompt.1"
    assert parse_json_body(b'{"max_tokens": ' + b"9" * 4300 + b"}")["max_tokens"] == int("9" * 4300)
    assert parse_json_body(b'{"prompt": "' + b"9" * 5000 + b'"}')["prompt"] == "9" * 5000
    bad = refused(parse_json_body, b'{"n": ' + b"9" * 5000 + b", }")
    assert bad.code == "invalid_json" and "set_int_max_str_digits" not in bad.message
    assert refused(parse_json_body, b"[1]").code == "invalid_json"
    assert refused(parse_json_body, b"\xff{}").code == "invalid_json"


class FakeReplica(BaseHTTPRequestHandler):
    """/health answers 200; a POST is echoed as JSON, or dropped unanswered when its body asks."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.answer(b'{"ok": true}')

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        if b"drop-me" in body:
            self.close_connection = True
            return
        self.answer(json.dumps({"headers": dict(self.headers), "body": body.decode()}).encode())

    def answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def routed():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeReplica)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    router = Router([f"http://127.0.0.1:{server.server_address[1]}"])
    app = build_router_app(router, health_interval=30, max_body_bytes=4096)
    with TestClient(app) as client:
        yield client, router.replicas[0]
    server.shutdown()
    server.server_close()


def test_a_client_fault_is_a_400_and_the_replica_stays_in(routed, monkeypatch):
    client, replica = routed
    r = client.post("/v1/completions", json={"prompt": "hi"}, headers={"accept": "*/*"})
    assert r.status_code == 200 and r.json()["headers"]["accept"] == "*/*"
    r = client.post("/v1/completions", json={"prompt": "x" * 5000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert r.headers["connection"] == "close"

    def chunks():
        for _ in range(10):
            yield b" " * 1000

    r = client.post("/v1/completions", content=chunks())  # no length given: counted
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    deep = MAX_JSON_DEPTH + 10
    r = client.post("/v1/completions", content=b'{"prompt": [' + b"[" * deep + b"]" * deep + b"]}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    # a header the HTTP client refuses to send (whatever let it through) is the client's fault
    monkeypatch.setattr(forwarding, "forward_headers", lambda raw: {"accept": "a\x00b"})
    r = client.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    assert replica.healthy and replica.failures == 0 and replica.in_flight == 0
    r = client.get("/no/such/route")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_a_replica_that_drops_a_request_counts_against_it(routed):
    client, replica = routed
    r = client.post("/v1/completions", json={"prompt": "drop-me"})
    assert r.status_code == 502 and r.json()["error"]["code"] == "replica_failed"
    assert not replica.healthy and replica.failures == 1 and replica.in_flight == 0
