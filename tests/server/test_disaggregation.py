"""Prefill/decode disaggregation: `kvserve router --prefill-replica P --replica D` in front of two
real `kvserve serve` instances. P computes each prompt and hands its KV blocks to D
(/v1/kv/prefill, /v1/kv/import); D finds them in its prefix cache and decodes. The answer equals a
single instance's (greedy), D's prompt tokens come from the handed-over blocks, and bad payloads
get a 400."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, SERVER_ARGS, read_metrics
from tests.server.test_router import RouterProcess

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MANUAL = ("The kvserve manual, chapter 3. The prefill instance computes the prompt of every request and "
          "writes its keys and values into paged blocks of sixteen tokens. The decode instance receives those "
          "blocks, finds them in its prefix cache, and generates the answer one token at a time, so long "
          "prompts never stall the tokens of requests that are already decoding. ")


@pytest.fixture(scope="module")
def pd(server_factory):
    procs = [server_factory(SERVER_ARGS + ["--threads", "1"]) for _ in range(2)]
    for p in procs:
        p.wait_ready()
    prefill, decode = procs
    router = RouterProcess([decode.base_url], ["--prefill-replica", prefill.base_url])
    yield prefill, decode, router
    router.stop()
    for p in procs:
        p.stop()


def _ask(url: str, question: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=[{"role": "system", "content": MANUAL},
                                                              {"role": "user", "content": question}],
                                       max_tokens=16, temperature=0)
    return r.choices[0].message.content, r.usage.prompt_tokens


def test_the_decode_instance_answers_from_the_prefill_instances_blocks(pd):
    prefill, decode, router = pd
    before = read_metrics(decode.base_url)
    answer, prompt_tokens = _ask(router.url, "What does the decode instance receive?")
    after = read_metrics(decode.base_url)
    hits = after["kvserve:prefix_cache_hits_total"] - before.get("kvserve:prefix_cache_hits_total", 0)
    assert hits >= (prompt_tokens - 1) // 16 * 16 - 16 > 0       # all but the last block's tokens
    stats = httpx.get(f"{router.url}/router/stats", headers=AUTH, timeout=10).json()
    assert stats["handed_over_tokens"] >= hits and stats["prefill"][0]["routed"] == 1
    # the same answer as an instance that computed everything itself
    assert _ask(prefill.base_url, "What does the decode instance receive?")[0] == answer


def test_kv_endpoints_refuse_bad_input(pd):
    prefill, decode, _ = pd
    r = httpx.post(f"{decode.base_url}/v1/kv/import", content=b"junk" * 10, headers=AUTH, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    payload = httpx.post(f"{prefill.base_url}/v1/kv/prefill", json={"prompt_token_ids": list(range(1, 40))},
                         headers=AUTH, timeout=60).content
    assert payload[:4] == b"KVX1"
    r = httpx.post(f"{decode.base_url}/v1/kv/import", content=payload[:-7], headers=AUTH, timeout=10)
    assert r.status_code == 400 and "bytes of KV" in r.json()["error"]["message"]
    for header in (b'{"token_ids": [], "block_size": NaN}', b'{"token_ids": [1], "block_size": 16, "num_blocks": '
                   b'18446744073709551616, "layers": 30, "dtype": "float16", "block_shape": [16, 3, 64]}'):
        crafted = b"KVX1" + len(header).to_bytes(4, "little") + header
        r = httpx.post(f"{decode.base_url}/v1/kv/import", content=crafted, headers=AUTH, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = httpx.post(f"{decode.base_url}/v1/kv/import", content=payload, headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.json()["cached_tokens"] == 32
    for bad in ([], [10**9], [-1], [2**64], [1] * 5000):
        r = httpx.post(f"{prefill.base_url}/v1/kv/prefill", json={"prompt_token_ids": bad}, headers=AUTH, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_token_ids"
    for bad in (b'{"prompt_token_ids": [NaN]}', b'{"prompt_token_ids": ["\\ud800"]}', b'{"prompt_token_ids": 5}'):
        r = httpx.post(f"{prefill.base_url}/v1/kv/prefill", content=bad, timeout=10,
                       headers={**AUTH, "content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("prompt_token_ids"), r.text
    assert httpx.post(f"{decode.base_url}/v1/kv/import", content=payload, timeout=10).status_code == 401
