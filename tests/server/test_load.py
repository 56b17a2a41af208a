"""Disconnects free their KV blocks; 64 concurrent streams all complete with correct usage; no
leak."""

import asyncio
import time

import httpx

LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}


def test_dropped_streams_are_aborted(server, auth, metrics, idle):
    """8 long streaming requests, connections dropped after their first tokens: /metrics shows
    nothing running and the KV cache back at its idle value."""
    before = idle(1.0)
    idle_kv = before["kvserve:kv_cache_usage_perc"]
    aborted_before = before.get("kvserve:request_success_total{finished_reason=abort}", 0)
    clients, responses = [], []
    for i in range(8):
        body = (
            {**LONG, "prompt": f"Story number {i}: once upon a time"}
            if i % 2
            else {**LONG, "messages": [{"role": "user", "content": f"Tell story number {i}."}]}
        )
        path = "/v1/completions" if i % 2 else "/v1/chat/completions"
        c = httpx.Client(base_url=server, headers=auth, timeout=120)
        r = c.send(c.build_request("POST", path, json=body), stream=True)
        assert r.status_code == 200
        clients.append(c)
        responses.append(r)
    for r in responses:  # every request is generating
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    during = metrics()
    assert during["kvserve:num_requests_running"] + during["kvserve:num_requests_waiting"] >= 1
    assert during["kvserve:kv_cache_usage_perc"] > idle_kv
    for r, c in zip(responses, clients):  # drop the connections mid-stream
        r.close()
        c.close()
    after = idle(idle_kv, timeout=30)
    assert after["kvserve:kv_cache_usage_perc"] == idle_kv
    assert after["kvserve:request_success_total{finished_reason=abort}"] - aborted_before == 8


def test_dropped_non_streaming_request_is_aborted(server, auth, metrics, idle):
    idle_kv = idle(1.0)["kvserve:kv_cache_usage_perc"]
    body = {"prompt": "Count to one thousand:", "max_tokens": 400, "ignore_eos": True}
    with httpx.Client(base_url=server, headers=auth, timeout=0.5) as c:
        try:
            c.post("/v1/completions", json=body)  # gives up after 0.5 s and closes the connection
        except httpx.TimeoutException:
            pass
    t0 = time.monotonic()
    idle(idle_kv, timeout=30)
    assert time.monotonic() - t0 < 30


def test_64_concurrent_streams(server, auth, aclient_factory, model_name, metrics, idle):
    idle_kv = idle(1.0)["kvserve:kv_cache_usage_perc"]
    prompts = [f"Request {i}: write a sentence about the number {i}." for i in range(64)]
    expected_prompt_tokens = [
        len(httpx.post(f"{server}/tokenize", json={"prompt": p}, headers=auth).json()["tokens"])
        for p in prompts
    ]

    async def one(client, i):
        stream = await client.completions.create(
            model=model_name,
            prompt=prompts[i],
            max_tokens=8 + i % 5,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, finish, usage = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        return text, finish, usage

    async def run_all():
        client = aclient_factory()
        try:
            return await asyncio.gather(*(one(client, i) for i in range(64)))
        finally:
            await client.close()

    before = metrics()
    results = asyncio.run(run_all())
    for i, (text, finish, usage) in enumerate(results):
        assert finish == "length" and text
        assert usage.completion_tokens == 8 + i % 5
        assert usage.prompt_tokens == expected_prompt_tokens[i]
    after = idle(idle_kv, timeout=30)
    assert after["kvserve:kv_cache_usage_perc"] == idle_kv  # no block leaked
    generated = after["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"]
    assert generated == sum(8 + i % 5 for i in range(64))
    finished = (
        after["kvserve:request_success_total{finished_reason=length}"]
        - before["kvserve:request_success_total{finished_reason=length}"]
    )
    assert finished == 64


def test_greedy_answer_is_the_same_alone_and_among_15_others(client, aclient_factory, model_name):
    """A temperature-0 request's text does not depend on what else the server runs beside it
    (other users' prompts chunked into the same steps, sampled neighbours, batched decodes)."""
    prompt, n = "List three primary colors:", 32
    alone = (
        client.completions.create(
            model=model_name,
            prompt=prompt,
            max_tokens=n,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )

    async def run_all():
        c = aclient_factory()
        try:
            others = [
                c.completions.create(
                    model=model_name,
                    prompt=("In the beginning " * (10 + 9 * i)) + f"#{i}",
                    max_tokens=4 + 3 * i,
                    temperature=0.9,
                    seed=i,
                    extra_body={"ignore_eos": True},
                )
                for i in range(15)
            ]
            mine = c.completions.create(
                model=model_name,
                prompt=prompt,
                max_tokens=n,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return await asyncio.gather(mine, *others)
        finally:
            await c.close()

    batched = asyncio.run(run_all())[0].choices[0].text
    assert batched == alone
