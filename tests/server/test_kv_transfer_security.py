"""The KV handover is no public write path into the prefix cache (kvserve/server/kv_routes.py).

The attack: import made-up KV for the first block of the chat template's default system prompt,
so that every chat user's prompt finds it as a prefix hit. Without a role the endpoints do not
exist; with one they need the transfer key; and even a trusted import lands in a namespace of
its own, which only requests presenting the key (the router's forwarded decode requests) read:
users, and a victim asking all along, keep their idle greedy answers. Then the limits: the body
cap, one import at a time, and exports that stream pinned blocks and always let them go."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from tests.server.conftest import API_KEY, SERVER_ARGS, free_port, read_metrics

KV_KEY = "kv-security-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
KV_AUTH = {**AUTH, "X-KV-Transfer-Key": KV_KEY}
QUESTIONS = ("What is the capital of France?", "Name three colors.")
BLOCK = 16


@pytest.fixture(scope="module")
def handover(server_factory):
    """A server with both roles (so it exports and imports) and the transfer key."""
    srv = server_factory(SERVER_ARGS + ["--kv-transfer-role", "both", "--kv-transfer-key", KV_KEY])
    srv.wait_ready()
    yield srv.base_url
    srv.stop()


def chat(url: str, question: str, headers: dict = AUTH, **extra) -> str:
    r = httpx.post(
        f"{url}/v1/chat/completions",
        headers=headers,
        timeout=120,
        json={
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 12,
            "temperature": 0,
            **extra,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def system_prompt_block(url: str) -> list[int]:
    """The first block of every chat prompt without a system message: the template's default."""
    ids = [chat_tokens(url, q) for q in QUESTIONS]
    assert ids[0][:BLOCK] == ids[1][:BLOCK] and min(map(len, ids)) > BLOCK
    return ids[0][:BLOCK]


def chat_tokens(url: str, question: str) -> list[int]:
    r = httpx.post(
        f"{url}/tokenize",
        headers=AUTH,
        timeout=30,
        json={"messages": [{"role": "user", "content": question}]},
    )
    return r.json()["tokens"]


def export(url: str, ids: list[int]) -> bytes:
    r = httpx.post(
        f"{url}/v1/kv/prefill", json={"prompt_token_ids": ids}, headers=KV_AUTH, timeout=120
    )
    assert r.status_code == 200, r.text
    return r.content


def made_up(template: bytes, token_ids: list[int], num_blocks: int) -> bytes:
    """A payload in `template`'s format (a real export) of random KV for `token_ids`."""
    n = int.from_bytes(template[4:8], "little")
    header = json.loads(template[8 : 8 + n])
    header.update(token_ids=token_ids, num_blocks=num_blocks)
    count = 2 * header["layers"] * num_blocks * int(np.prod(header["block_shape"]))
    noise = (np.random.default_rng(0).standard_normal(count) * 4).astype(header["dtype"]).tobytes()
    head = json.dumps(header).encode()
    return b"KVX1" + len(head).to_bytes(4, "little") + head + noise


def post_import(url: str, payload: bytes, headers: dict = KV_AUTH) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/kv/import",
        content=payload,
        timeout=120,
        headers={**headers, "content-type": "application/octet-stream"},
    )


def blocks_used(url: str) -> float:
    return read_metrics(url)["kvserve:kv_cache_blocks_used"]


def wait_blocks(url: str, done, timeout: float = 60.0) -> float:
    deadline = time.monotonic() + timeout
    while not done(used := blocks_used(url)):
        assert time.monotonic() < deadline, f"kv_cache_blocks_used stuck at {used}"
        time.sleep(0.1)
    return used


class Victim(threading.Thread):
    """Asks the questions over and over (greedy, no cache_salt) until stopped."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.answers, self.stop, self.error = url, [], threading.Event(), None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                for q in QUESTIONS:
                    self.answers.append((q, chat(self.url, q)))
        except (AssertionError, httpx.HTTPError) as e:  # reported by the test
            self.error = e

    def wait_for(self, count: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.answers) < count and self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)


def test_without_a_role_the_endpoints_do_not_exist(server):
    idle = chat(server, QUESTIONS[0])
    poison = b"KVX1" + bytes(64)
    for headers in (AUTH, {**AUTH, "X-KV-Transfer-Key": "anything"}):
        assert post_import(server, poison, headers).status_code == 404
        r = httpx.post(
            f"{server}/v1/kv/prefill",
            json={"prompt_token_ids": [1, 2]},
            headers=headers,
            timeout=30,
        )
        assert r.status_code == 404
        assert chat(server, QUESTIONS[0], headers) == idle  # the header means nothing here


def test_a_role_without_a_key_refuses_to_start():
    env = {k: v for k, v in os.environ.items() if k != "KVSERVE_KV_TRANSFER_KEY"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvserve",
            "serve",
            "--port",
            str(free_port()),
            "--kv-transfer-role",
            "decode",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    assert r.returncode == 2 and "--kv-transfer-key" in r.stderr, r.stderr[-2000:]


def test_poisoning_the_shared_prefix_fails(handover):
    # idle answers under a salt of their own (greedy answers do not depend on the cache), so the
    # unsalted users' copy of the system prompt's block is not cached yet when the import comes
    idle = {q: chat(handover, q, cache_salt="idle-answers") for q in QUESTIONS}
    system = system_prompt_block(handover)
    template = export(handover, list(range(1000, 1000 + BLOCK + 1)))
    poison = made_up(template, system, 1)
    for key in (None, "wrong", ""):
        headers = AUTH if key is None else {**AUTH, "X-KV-Transfer-Key": key}
        r = post_import(handover, poison, headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_kv_transfer_key"
    r = post_import(handover, poison)  # trusted: lands in the handover namespace
    assert r.status_code == 200 and r.json()["cached_tokens"] == BLOCK
    victim = Victim(handover)  # an unsalted user: the attack's target
    victim.start()
    try:
        victim.wait_for(1)
        for q in QUESTIONS:
            assert chat(handover, q) == idle[q]
            assert chat(handover, q, cache_salt="kv-handover") == idle[q]
        ids = chat_tokens(handover, QUESTIONS[1])
        r = post_import(handover, made_up(template, ids[: 2 * BLOCK], 2))  # while the victim asks
        assert r.status_code == 200 and r.json()["cached_tokens"] == 2 * BLOCK
        # the made-up block is live in the namespace: a request that presents the key reads it
        assert chat(handover, QUESTIONS[0], KV_AUTH) != idle[QUESTIONS[0]]
        # a wrong key on a generation request is refused, not silently ignored
        r = httpx.post(
            f"{handover}/v1/chat/completions",
            timeout=30,
            headers={**AUTH, "X-KV-Transfer-Key": "wrong"},
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        )
        assert r.status_code == 401
        victim.wait_for(len(victim.answers) + 2)
    finally:
        victim.stop.set()
        victim.join(120)
    assert victim.error is None and len(victim.answers) >= 2
    assert all(a == idle[q] for q, a in victim.answers)


def test_the_export_needs_the_key_before_anything_else(handover):
    for body in (b"not json", json.dumps({"prompt_token_ids": [1, 2, 3]}).encode()):
        r = httpx.post(
            f"{handover}/v1/kv/prefill",
            content=body,
            timeout=30,
            headers={**AUTH, "content-type": "application/json"},
        )
        assert r.status_code == 401


def raw_post(
    url: str, path: str, head: dict, body: bytes = b"", rcvbuf: int | None = None
) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket()
    s.settimeout(60)
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((host, int(port)))
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", *(f"{k}: {v}" for k, v in head.items())]
    s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    return s


def read_status(s: socket.socket) -> tuple[int, str]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(
        int(v)
        for k, v in (line.split(b":", 1) for line in head.split(b"\r\n")[1:])
        if k.strip().lower() == b"content-length"
    )
    while len(rest) < length:
        rest += s.recv(65536)
    return int(head.split()[1]), rest.decode()


def test_the_body_cap_is_a_whole_context(handover):
    template = export(handover, list(range(2000, 2000 + BLOCK + 1)))
    s = raw_post(handover, "/v1/kv/import", {**KV_AUTH, "Content-Length": str(10**9)})
    status, body = read_status(s)  # answered before a byte of the body
    s.close()
    assert status == 413
    limit = int(body.split("over the limit of ")[1].split()[0])
    context = 1024 // BLOCK  # conftest's --max-model-len
    whole = made_up(template, list(range(3000, 3000 + context * BLOCK)), context)
    assert len(whole) <= limit < len(whole) + 8 * 1024  # a context's KV, and room for its header
    assert post_import(handover, whole).json()["cached_tokens"] == context * BLOCK
    r = post_import(handover, whole + bytes(limit - len(whole)))
    assert r.status_code == 400 and "bytes of KV" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the cap counts as it reads
        yield whole
        yield bytes(limit - len(whole) + 1)

    r = httpx.post(f"{handover}/v1/kv/import", content=chunks(), headers=KV_AUTH, timeout=120)
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"


def test_one_import_at_a_time(handover):
    template = export(handover, list(range(4000, 4000 + BLOCK + 1)))
    payload = made_up(template, list(range(4000, 4000 + BLOCK)), 1)
    slow = raw_post(
        handover, "/v1/kv/import", {**KV_AUTH, "Content-Length": str(len(payload))}, payload[:8]
    )
    try:
        time.sleep(1.0)  # the slow import holds the slot
        r = post_import(handover, b"KVX1" + bytes(32))
        assert r.status_code == 429 and "Retry-After" in r.headers
        slow.sendall(payload[8:])
        assert read_status(slow)[0] == 200
    finally:
        slow.close()
    assert post_import(handover, payload).status_code == 200  # the slot is free again


def test_exports_stream_pinned_blocks_and_always_release_them(handover):
    from kvserve.engine.kv_payload import KVFormat, PayloadReader

    ids = [(i * 7919) % 40000 + 100 for i in range(1000)]
    idle = wait_blocks(handover, lambda used: True)
    assert idle == 0
    data = export(handover, ids)
    n = int.from_bytes(data[4:8], "little")
    header = json.loads(data[8 : 8 + n])
    fmt = KVFormat(
        BLOCK,
        header["layers"],
        header["dtype"],
        np.dtype(header["dtype"]).itemsize,
        tuple(header["block_shape"]),
        50000,
        1024,
    )
    reader = PayloadReader(fmt, len(data))
    reader.feed(data)
    assert reader.finish()[0].token_ids == ids[: len(ids) // BLOCK * BLOCK]
    wait_blocks(handover, lambda used: used == idle)
    # a client that stops reading holds the pins; one that goes away lets them go
    body = json.dumps({"prompt_token_ids": ids}).encode()
    head = {**KV_AUTH, "Content-Type": "application/json", "Content-Length": str(len(body))}
    s = raw_post(handover, "/v1/kv/prefill", head, body, rcvbuf=64 * 1024)
    try:  # a small receive window: the payload cannot hide in the socket buffers
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        assert wait_blocks(handover, lambda used: used >= len(ids) // BLOCK) >= len(ids) // BLOCK
    finally:
        s.close()
    wait_blocks(handover, lambda used: used == idle)
    assert chat(handover, QUESTIONS[1])  # the server serves on
