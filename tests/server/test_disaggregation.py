"""Prefill/decode disaggregation: `kvserve router --prefill-replica P --replica D
--kv-transfer-key K` in front of two real `kvserve serve` instances started with
`--kv-transfer-role prefill|decode --kv-transfer-key K`. P computes each prompt and hands its KV
blocks to D (/v1/kv/prefill, /v1/kv/import); D finds them in its prefix cache and decodes. The
answer equals a single instance's (greedy), D's prompt tokens come from the handed-over blocks,
and bad payloads get a 400. The endpoints' security (key, namespace, limits):
test_kv_transfer_security.py."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, SERVER_ARGS, read_metrics
from tests.server.test_router import RouterProcess

KV_KEY = "kv-transfer-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
KV_AUTH = {**AUTH, "X-KV-Transfer-Key": KV_KEY}
MANUAL = (
    "The kvserve manual, chapter 3. The prefill instance computes the prompt of every request and "
    "writes its keys and values into paged blocks of sixteen tokens. The decode instance receives "
    "those blocks, finds them in its prefix cache, and generates the answer one token at a time, "
    "so long "
    "prompts never stall the tokens of requests that are already decoding. "
)


@pytest.fixture(scope="module")
def pd(server_factory):
    procs = [
        server_factory(
            SERVER_ARGS
            + ["--threads", "1", "--kv-transfer-role", role, "--kv-transfer-key", KV_KEY]
        )
        for role in ("prefill", "decode")
    ]
    for p in procs:
        p.wait_ready()
    prefill, decode = procs
    router = RouterProcess(
        [decode.base_url], ["--prefill-replica", prefill.base_url, "--kv-transfer-key", KV_KEY]
    )
    yield prefill, decode, router
    router.stop()
    for p in procs:
        p.stop()


def _ask(url: str, question: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": MANUAL}, {"role": "user", "content": question}],
        max_tokens=16,
        temperature=0,
    )
    return r.choices[0].message.content, r.usage.prompt_tokens


def test_the_decode_instance_answers_from_the_prefill_instances_blocks(pd):
    prefill, decode, router = pd
    before = read_metrics(decode.base_url)
    answer, prompt_tokens = _ask(router.url, "What does the decode instance receive?")
    after = read_metrics(decode.base_url)
    hits = after["kvserve:prefix_cache_hits_total"] - before.get(
        "kvserve:prefix_cache_hits_total", 0
    )
    assert hits >= (prompt_tokens - 1) // 16 * 16 - 16 > 0  # all but the last block's tokens
    stats = httpx.get(f"{router.url}/router/stats", headers=AUTH, timeout=10).json()
    assert stats["handed_over_tokens"] >= hits and stats["prefill"][0]["routed"] == 1
    # the same answer as an instance that computed everything itself
    assert _ask(prefill.base_url, "What does the decode instance receive?")[0] == answer


def kv_import(replica, content: bytes, headers: dict = KV_AUTH) -> httpx.Response:
    return httpx.post(
        f"{replica.base_url}/v1/kv/import", content=content, headers=headers, timeout=10
    )


def kv_prefill(replica, ids, timeout: float = 10) -> httpx.Response:
    return httpx.post(
        f"{replica.base_url}/v1/kv/prefill",
        json={"prompt_token_ids": ids},
        headers=KV_AUTH,
        timeout=timeout,
    )


def test_kv_endpoints_refuse_bad_input(pd):
    prefill, decode, _ = pd
    r = kv_import(decode, b"junk" * 10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    payload = kv_prefill(prefill, list(range(1, 40)), timeout=60).content
    assert payload[:4] == b"KVX1"
    r = kv_import(decode, payload[:-7])
    assert r.status_code == 400 and "bytes of KV" in r.json()["error"]["message"]
    for header in (
        b'{"token_ids": [], "block_size": NaN}',
        (
            b'{"token_ids": [1], "block_size": 16, "num_blocks": 18446744073709551616, '
            b'"layers": 30, "dtype": "float16", "block_shape": [16, 3, 64]}'
        ),
    ):
        r = kv_import(decode, b"KVX1" + len(header).to_bytes(4, "little") + header)
        assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = kv_import(decode, payload)
    assert r.status_code == 200 and r.json()["cached_tokens"] == 32
    for bad in ([], [10**9], [-1], [2**64], [1] * 5000):
        r = kv_prefill(prefill, bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_token_ids"
    for bad in (
        b'{"prompt_token_ids": [NaN]}',
        b'{"prompt_token_ids": ["\\ud800"]}',
        b'{"prompt_token_ids": 5}',
    ):
        r = httpx.post(
            f"{prefill.base_url}/v1/kv/prefill",
            content=bad,
            timeout=10,
            headers={**KV_AUTH, "content-type": "application/json"},
        )
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("prompt_token_ids"), (
            r.text
        )
    assert kv_import(decode, payload).status_code == 200
    # the users' API key alone opens neither endpoint; the transfer key alone neither (the guard)
    assert kv_import(decode, payload, AUTH).status_code == 401
    assert kv_import(decode, payload, {"X-KV-Transfer-Key": KV_KEY}).status_code == 401
    # each replica has only its role's endpoint (as for any unknown path, the guard reads the
    # body first: a small one)
    assert kv_import(prefill, payload[:64]).status_code == 404
    assert kv_prefill(decode, [1, 2]).status_code == 404


def test_a_router_with_prefill_replicas_needs_the_transfer_key():
    env = {k: v for k, v in os.environ.items() if k != "KVSERVE_KV_TRANSFER_KEY"}
    nowhere = "http://127.0.0.1:9"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvserve",
            "router",
            "--replica",
            nowhere,
            "--prefill-replica",
            nowhere,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert r.returncode == 2 and "--kv-transfer-key" in r.stderr
