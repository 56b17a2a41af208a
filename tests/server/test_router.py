"""`kvserve router` in front of two real `kvserve serve` replicas, driven by the official openai
client: answers equal a replica's own, a shared prompt prefix sticks to one replica, streaming
works through it, a killed replica is taken out at once and the other serves, and with none left
the answer is a fast 503 naming them."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, SERVER_ARGS, free_port

SYSTEM = (
    "You answer questions about the kvserve manual. The manual says: the server listens on port "
    "8000, the router spreads requests over replicas, and every replica keeps a prefix cache. "
)


class RouterProcess:
    def __init__(self, replicas: list[str], extra: list[str] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "kvserve",
            "router",
            "--port",
            str(self.port),
            "--api-key",
            API_KEY,
            "--health-interval",
            "0.5",
            *extra,
        ]
        for r in replicas:
            cmd += ["--replica", r]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stdout.read()
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code in (200, 503):
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("router not up in 60 s")

    def stats(self) -> dict:
        return httpx.get(
            f"{self.url}/router/stats", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10
        ).json()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def replicas(server_factory):
    procs = [server_factory(SERVER_ARGS + ["--threads", "1"]) for _ in range(2)]
    for p in procs:
        p.wait_ready()
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture
def router(replicas):
    for p in replicas:
        assert p.proc.poll() is None, "a replica died"
    r = RouterProcess([p.base_url for p in replicas])
    yield r
    r.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _chat(client, model, question: str, **kw):
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=12,
        temperature=0,
        **kw,
    )


def test_answers_through_the_router_equal_a_replicas_and_a_prefix_sticks(router, replicas):
    model = _client(replicas[0].base_url).models.list().data[0].id
    assert _client(router.url).models.list().data[0].id == model
    direct = _chat(_client(replicas[0].base_url), model, "Which port?").choices[0].message.content
    via = _client(router.url)
    assert _chat(via, model, "Which port?").choices[0].message.content == direct
    for q in ("What spreads requests?", "What does every replica keep?", "Which port again?"):
        _chat(via, model, q)
    counts = [r["routed"] for r in router.stats()["replicas"]]
    assert sorted(counts) == [0, 4]  # one replica got the whole conversation
    assert max(r["prefix_routed"] for r in router.stats()["replicas"]) == 3
    # ... and a stream through the router ends like the non-streamed answer
    text = "".join(
        c.choices[0].delta.content or ""
        for c in _chat(via, model, "Which port?", stream=True)
        if c.choices
    )
    assert text == direct


def test_the_router_checks_the_key_and_refuses_bad_bodies(router):
    assert httpx.get(f"{router.url}/router/stats", timeout=10).status_code == 401
    r = httpx.post(
        f"{router.url}/v1/completions",
        content=b"{not json",
        timeout=10,
        headers={"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    # a body the replica refuses comes back as the replica's own 400, naming the field
    r = httpx.post(
        f"{router.url}/v1/completions",
        json={"model": "x", "prompt": "hi", "max_tokens": -1},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=10,
    )
    assert r.status_code in (400, 404) and "error" in r.json()


def test_a_killed_replica_is_taken_out_and_none_left_is_a_fast_503(server_factory, replicas):
    extra = [server_factory(SERVER_ARGS + ["--threads", "1"])]
    extra[0].wait_ready()
    router = RouterProcess([extra[0].base_url, replicas[1].base_url])
    try:
        via = _client(router.url)
        model = via.models.list().data[0].id
        extra[0].proc.kill()
        extra[0].proc.wait()
        t0 = time.monotonic()
        for i in range(4):  # every request is answered: by the live replica
            assert (
                via.completions.create(model=model, prompt=f"Count: {i},", max_tokens=4)
                .choices[0]
                .text
                is not None
            )
        assert time.monotonic() - t0 < 30
        dead = next(r for r in router.stats()["replicas"] if r["url"] == extra[0].base_url)
        assert dead["healthy"] is False and dead["last_error"]
        router.stop()
        router = RouterProcess([extra[0].base_url])  # only the dead one
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as e:
            via = _client(router.url)
            via.completions.create(model=model, prompt="hi", max_tokens=4)
        assert e.value.status_code == 503 and extra[0].base_url in e.value.message
        assert time.monotonic() - t0 < 10
    finally:
        router.stop()
        extra[0].stop()
