"""Async load generator for any OpenAI-compatible /v1/completions endpoint (httpx, SSE streaming).

Requests leave on a Poisson process at `rate` per second (inf: all at once), at most
`max_concurrency` in flight, each timed from its send to every streamed chunk.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time

import httpx
from tqdm import tqdm

from kvserve.bench.datasets import BenchRequest
from kvserve.bench.metrics import RequestTiming


def completion_payload(
    req: BenchRequest,
    model: str,
    prompt_text: str | None = None,
    min_tokens: bool = False,
    extra: dict | None = None,
) -> dict:
    """Greedy, exactly max_tokens: ignore_eos (the vLLM / llama.cpp extension) or, for servers
    without it (llama-cpp-python), min_tokens = max_tokens."""
    body = {
        "model": model,
        "prompt": prompt_text if prompt_text is not None else req.prompt_ids,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    if min_tokens:
        body["min_tokens"] = req.max_tokens
    body.update(extra or {})
    return body


async def send_one(
    client: httpx.AsyncClient, url: str, body: dict, prompt_tokens: int, max_tokens: int
) -> RequestTiming:
    t = RequestTiming(start=time.perf_counter(), prompt_tokens=prompt_tokens, max_tokens=max_tokens)
    usage = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                t.ok, t.error = False, f"HTTP {resp.status_code}: {text}"
                return t
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("usage"):
                    usage = obj["usage"]
                choices = obj.get("choices") or []
                if not choices:
                    continue
                if choices[0].get("text"):
                    t.chunk_times.append(time.perf_counter())
                if choices[0].get("text") or choices[0].get("finish_reason") is None:
                    chunks += 1  # a token, even one whose text is still held back
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        t.ok, t.error = False, f"{type(e).__name__}: {e}"
        return t
    t.output_tokens = (
        usage["completion_tokens"] if usage and usage.get("completion_tokens") else chunks
    )
    if usage and usage.get("prompt_tokens"):
        t.prompt_tokens = usage["prompt_tokens"]
    if not t.chunk_times:
        t.ok, t.error = False, "no tokens streamed"
    return t


async def run_load(
    base_url: str,
    requests: list[BenchRequest],
    model: str,
    rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    prompt_texts: list[str] | None = None,
    min_tokens: bool = False,
    extra: dict | None = None,
    progress: bool = True,
    timeout: float = 3600,
    api_key: str | None = None,
) -> tuple[list[RequestTiming], float]:
    """Send every request; returns their timings and the wall time from first send to last reply."""
    url = base_url.rstrip("/") + "/v1/completions"
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(
        total=len(requests),
        desc=f"rate {rate:g}" + (f" conc {max_concurrency}" if max_concurrency else ""),
        unit="req",
        disable=not progress,
        dynamic_ncols=True,
    )
    limits = httpx.Limits(
        max_connections=max_concurrency or len(requests) + 1, max_keepalive_connections=64
    )

    async with httpx.AsyncClient(
        timeout=httpx.Timeout(timeout, connect=30), limits=limits, headers=auth_headers(api_key)
    ) as client:

        async def one(i: int, req: BenchRequest) -> RequestTiming:
            body = completion_payload(
                req, model, prompt_texts[i] if prompt_texts else None, min_tokens, extra
            )
            if sem is None:
                t = await send_one(client, url, body, len(req.prompt_ids), req.max_tokens)
            else:
                async with sem:
                    t = await send_one(client, url, body, len(req.prompt_ids), req.max_tokens)
            bar.update(1)
            return t

        start = time.perf_counter()
        tasks = []
        for i, req in enumerate(requests):
            tasks.append(asyncio.create_task(one(i, req)))
            if math.isfinite(rate) and i < len(requests) - 1:
                await asyncio.sleep(rng.expovariate(rate))
        timings = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(timings), duration


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def served_model(base_url: str, api_key: str | None = None) -> str:
    """The first model id the server lists (GET /v1/models), or 'default'."""
    try:
        r = httpx.get(
            base_url.rstrip("/") + "/v1/models", timeout=10, headers=auth_headers(api_key)
        )
        data = r.json().get("data") or []
        return data[0]["id"] if data else "default"
    except (httpx.HTTPError, ValueError, KeyError):
        return "default"


def wait_ready(
    base_url: str, timeout: float, proc=None, api_key: str | None = None, poll_s: float = 0.5
) -> None:
    """Poll /v1/models every `poll_s` until the server answers 200 (or the process dies, or time
    runs out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready")
        try:
            if (
                httpx.get(
                    base_url.rstrip("/") + "/v1/models", timeout=2, headers=auth_headers(api_key)
                ).status_code
                == 200
            ):
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"server at {base_url} not ready after {timeout:.0f}s")
