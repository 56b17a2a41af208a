"""GET /dashboard and /dashboard/data on a real `kvserve serve`: the page and its script are served
from the package (no outside URL), the data need the API key, and the data follow the load that
the official openai client puts on the server."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import pytest

from kvserve.server.guard import GuardMiddleware
from tests.server.conftest import API_KEY

SERIES_KEYS = {
    "time",
    "running",
    "waiting",
    "kv_usage_pct",
    "output_tokens_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "prefix_hit_rate_pct",
    "preemptions_per_min",
    "spec_acceptance_pct",
}


def dashboard_data(server: str) -> dict:
    r = httpx.get(
        f"{server}/dashboard/data", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_page_and_script_are_served_without_outside_urls(server):
    page = httpx.get(f"{server}/dashboard", timeout=10)  # static: no key needed
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="dashboard/dashboard.js">' in page.text
    script = httpx.get(f"{server}/dashboard/dashboard.js", timeout=10)
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert "dashboard/data" in script.text
    for body in (page.text, script.text):  # works offline: nothing is fetched from elsewhere
        assert not re.search(r"(src|href)=\"(https?:)?//", body)
        assert "cdn" not in body.lower()


def test_data_need_the_api_key(server):
    r = httpx.get(f"{server}/dashboard/data", timeout=10)
    assert r.status_code == 401
    assert "API key" in r.json()["error"]["message"]


@pytest.mark.parametrize("metrics_public", [False, True])
def test_guard_opens_the_page_and_the_data_only_with_metrics_public(metrics_public):
    """The guard alone, in process: the static page and script never need the key; the data
    follow /metrics (open with --metrics-public)."""

    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guard = GuardMiddleware(ok, api_key=API_KEY, max_body_bytes=1024, metrics_public=metrics_public)

    async def statuses():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=guard), base_url="http://t"
        ) as c:
            return {
                path: (await c.get(path)).status_code
                for path in (
                    "/dashboard",
                    "/dashboard/dashboard.js",
                    "/dashboard/data",
                    "/metrics",
                    "/version",
                )
            }

    data = 200 if metrics_public else 401
    assert asyncio.run(statuses()) == {
        "/dashboard": 200,
        "/dashboard/dashboard.js": 200,
        "/dashboard/data": data,
        "/metrics": data,
        "/version": 401,
    }


def test_data_describe_the_server(server, model_name):
    d = dashboard_data(server)
    assert d["model"] == model_name and d["speculative"] is False
    assert (
        d["interval_s"] > 0 and d["window_s"] >= d["interval_s"] and d["history_s"] > d["window_s"]
    )
    assert SERIES_KEYS <= set(d["series"])
    lengths = {len(v) for v in d["series"].values()}
    assert len(lengths) == 1 and lengths.pop() >= 1
    assert d["totals"]["kv_blocks_total"] > 0


def test_data_follow_a_load(server, client, model_name, idle):
    """Four clients keep streaming requests until a snapshot (one a second) has seen them running:
    on a fast machine one round of requests can finish between two snapshots."""
    idle(0.5)
    before = dashboard_data(server)
    n = 4
    errors, done = [], [0] * n
    stop = threading.Event()

    def one(i: int):
        while not stop.is_set():
            try:
                stream = client.completions.create(
                    model=model_name,
                    prompt=f"Count to one hundred, request {i}:",
                    max_tokens=48,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                for _ in stream:
                    pass
                done[i] += 1
            except Exception as e:  # surfaced below
                errors.append(e)
                return

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    seen_running = 0
    for t in threads:
        t.start()
    load_deadline = time.monotonic() + 60
    while any(t.is_alive() for t in threads):
        d = dashboard_data(server)
        seen_running = max(seen_running, d["series"]["running"][-1])
        if (seen_running >= 1 and min(done) >= 1) or time.monotonic() > load_deadline:
            stop.set()
        time.sleep(0.3)
    for t in threads:
        t.join()
    assert not errors, errors
    finished = sum(done)
    # a snapshot is taken every interval_s: wait for one taken after the last request finished
    deadline = time.monotonic() + 10 * before["interval_s"] + 5
    while True:
        after = dashboard_data(server)
        if after["totals"]["finished_requests"] >= before["totals"]["finished_requests"] + finished:
            break
        assert time.monotonic() < deadline, (
            "the dashboard's totals never counted the finished requests"
        )
        time.sleep(0.2)
    assert seen_running >= 1, "no snapshot in 60 s of load saw a running request"
    assert (
        after["totals"]["generation_tokens"]
        >= before["totals"]["generation_tokens"] + finished * 48
    )
    assert after["series"]["time"][-1] > before["series"]["time"][-1]

    def recent(key):
        return [v for v in after["series"][key][-5:] if v is not None]

    assert max(recent("output_tokens_per_s")) > 0
    assert max(recent("prompt_tokens_per_s")) > 0
    ttft, tpot = recent("ttft_p50_s"), recent("tpot_p50_s")
    assert ttft and tpot and all(0 < v < 60 for v in ttft + tpot)
    assert all(
        p99 >= p50
        for p50, p99 in zip(after["series"]["ttft_p50_s"], after["series"]["ttft_p99_s"])
        if p50 is not None
    )
    assert all(v is None for v in after["series"]["spec_acceptance_pct"])  # speculation is off
