"""LoRA adapters over HTTP: a `kvserve serve --enable-lora` subprocess of its own on a tiny
random Llama checkpoint (tests/model/test_lora_engine.py writes it), adapters in PEFT's file
format with random matrices, and the greedy tokens of a completion through an adapter compared
with transformers on the base whose weights were merged by hand (W + alpha / r * B @ A).

/v1/models lists each adapter with the base as its parent; an unknown model is a 404 naming it;
POST /v1/load_lora_adapter and /v1/unload_lora_adapter sit behind the API key, refuse a
malformed adapter (400, the server serves on), a name taken and more than --max-loras, and an
adapter a request in flight runs with (400)."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
import torch

from tests.model.test_lora_engine import greedy, make_base, write_peft_format
from tests.server.conftest import ServerProcess

KEY = "lora-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [5, 6, 7, 8, 9, 10, 11]
NEW_TOKENS = 8
R, ALPHA = 4, 8


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    """(base URL, base model name, {adapter: path}, {adapter or None: greedy tokens})."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("lora-server")
    base_path = str(root / "base")
    make_base(base_path, transformers)
    base = transformers.LlamaForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    refs = {None: greedy(base, PROMPT, NEW_TOKENS)}
    paths = {}
    for seed, (name, targets) in enumerate(
        {"a": ["q_proj", "v_proj", "down_proj"], "b": ["k_proj", "o_proj", "gate_proj"]}.items()
    ):
        paths[name] = str(root / name)
        weights = write_peft_format(paths[name], base, targets, R, ALPHA, seed)
        merged = transformers.LlamaForCausalLM.from_pretrained(base_path, dtype=torch.float32)
        with torch.no_grad():
            for (i, block, module), (a, b) in weights.items():
                linear = getattr(getattr(merged.model.layers[i], block), module)
                linear.weight += ALPHA / R * b @ a
        refs[name] = greedy(merged.eval(), PROMPT, NEW_TOKENS)
    assert refs["a"] != refs[None] and refs["b"] != refs[None]
    srv = ServerProcess(
        [
            "--model", base_path,
            "--enable-lora",
            "--lora-modules", f"a={paths['a']}",
            "--max-loras", "2",
            "--max-lora-rank", str(R),
            "--api-key", KEY,
            "--kv-cache-memory", "16MiB",
            "--kv-cache-dtype", "float32",
            "--threads", "1",
            "--max-model-len", "256",
            "--max-num-seqs", "1",
            "--no-access-log",
        ]
    )  # fmt: skip
    try:
        srv.wait_ready(120)
        assert "C layer stack" in srv.log_text()  # float32 weights packed for it, LoRA table
        base_name = httpx.get(f"{srv.base_url}/v1/models", headers=AUTH).json()["data"][0]["id"]
        yield srv.base_url, base_name, paths, refs
    finally:
        srv.stop()
        os.unlink(srv.log.name)


def complete(url: str, model: str, **extra) -> httpx.Response:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        **extra,
    }
    return httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)


def token_ids(resp: httpx.Response) -> list[int]:
    """The completion's tokens, from their vocabulary strings (the tokenizer names id i "ti")."""
    assert resp.status_code == 200, resp.text
    return [int(t[1:]) for t in resp.json()["choices"][0]["logprobs"]["tokens"]]


def models(url: str) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]}


def test_models_lists_each_adapter_with_its_parent(lora_server):
    url, base, paths, _ = lora_server
    listed = models(url)
    assert list(listed) == [base, "a"]
    assert listed["a"]["parent"] == base and listed["a"]["root"] == paths["a"]
    assert listed[base]["parent"] is None
    assert httpx.get(f"{url}/v1/models/a", headers=AUTH).json()["parent"] == base


def test_a_completion_through_an_adapter_matches_the_merged_model(lora_server):
    url, base, _, refs = lora_server
    resp = complete(url, "a")
    assert token_ids(resp) == refs["a"] and resp.json()["model"] == "a"
    assert token_ids(complete(url, base)) == refs[None]


def test_a_chat_completion_through_an_adapter_matches_the_merged_model(lora_server):
    url, _, _, refs = lora_server
    body = {
        "model": "a",
        "messages": [{"role": "user", "content": " ".join(f"t{t}" for t in PROMPT)}],
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
    }
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert resp.status_code == 200, resp.text
    content = resp.json()["choices"][0]["logprobs"]["content"]
    assert [int(t["token"][1:]) for t in content] == refs["a"]
    assert resp.json()["model"] == "a"


def test_an_unknown_model_is_a_404_naming_it(lora_server):
    url = lora_server[0]
    resp = complete(url, "no-such-adapter")
    assert resp.status_code == 404
    error = resp.json()["error"]
    assert "no-such-adapter" in error["message"] and error["param"] == "model"


async def unload_while_in_use(url: str, name: str) -> httpx.Response:
    """POST /v1/unload_lora_adapter while eight streamed requests run with adapter `name`, then
    close them (the server aborts them); the unload's answer."""
    body = {"model": name, "prompt": PROMPT, "max_tokens": 240, "ignore_eos": True}
    started = asyncio.Event()
    async with httpx.AsyncClient(headers=AUTH, timeout=60) as client:

        async def one():
            async with client.stream(
                "POST", f"{url}/v1/completions", json={**body, "stream": True}
            ) as stream:
                async for _ in stream.aiter_lines():
                    started.set()
                    await asyncio.sleep(3600)

        tasks = [asyncio.create_task(one()) for _ in range(8)]
        await asyncio.wait_for(started.wait(), 60)
        await asyncio.sleep(0.2)  # every request admitted: one running, the others waiting
        resp = await client.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name})
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert "in use" in resp.text, resp.text
    return resp


def test_adapters_load_and_unload_at_run_time(lora_server, tmp_path):
    url, _, paths, refs = lora_server

    def post(route: str, body: dict, headers=AUTH) -> httpx.Response:
        return httpx.post(f"{url}/v1/{route}", json=body, headers=headers, timeout=60)

    load, unload = "load_lora_adapter", "unload_lora_adapter"
    assert post(load, {"lora_name": "b", "lora_path": paths["b"]}, headers={}).status_code == 401
    malformed = tmp_path / "malformed"
    malformed.mkdir()
    (malformed / "adapter_config.json").write_text('{"r": 4, "target_modules": ["q_proj"]}')
    resp = post(load, {"lora_name": "m", "lora_path": str(malformed)})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "lora_path"
    assert "has no adapter_model.safetensors" in resp.json()["error"]["message"]
    resp = post(load, {"lora_name": "m", "lora_path": str(tmp_path / "nowhere")})
    assert resp.status_code == 400 and "not a directory" in resp.text
    assert post(load, {"lora_name": "m", "lora_path": 3}).status_code == 400
    resp = post(load, {"lora_name": "b", "lora_path": paths["b"]})
    assert resp.status_code == 200, resp.text
    assert models(url)["b"]["parent"] is not None
    assert token_ids(complete(url, "b")) == refs["b"]

    resp = post(load, {"lora_name": "c", "lora_path": paths["b"]})  # a third: over --max-loras
    assert resp.status_code == 400 and "--max-loras" in resp.text
    resp = post(load, {"lora_name": "a", "lora_path": paths["b"]})
    assert resp.status_code == 400 and "already loaded" in resp.text
    assert token_ids(complete(url, "a")) == refs["a"]  # still serving

    # An adapter requests in flight run with is not unloaded: with --max-num-seqs 1, eight
    # requests of 240 tokens each keep it in use (running or waiting) for many steps.
    assert asyncio.run(unload_while_in_use(url, "b")).status_code == 400
    resp = post(unload, {"lora_name": "b"})
    for _ in range(50):  # the closed stream's abort reaches the engine within a step
        if resp.status_code == 200:
            break
        resp = post(unload, {"lora_name": "b"})
    assert resp.status_code == 200, resp.text
    assert "b" not in models(url)
    assert complete(url, "b").status_code == 404
    assert post(unload, {"lora_name": "b"}).status_code == 404
