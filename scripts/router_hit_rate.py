"""Prefix-cache hit rate behind `kvserve router` per routing policy, on a multi-turn chat workload.

For each policy (prefix, least_loaded, random): start N fresh `kvserve serve` replicas (empty
caches; the cores split between them), start the router over them, and run C conversations of T
turns through it, K conversations at a time. Each turn sends the whole conversation so far (a
shared system prompt, the earlier turns with the model's answers, a new question), greedy, 32
tokens. Reported: the replicas' prefix-cache hit rate over the run (prompt tokens served from
cache / prompt tokens, summed from their /metrics), mean and p90 time to first token, wall time.

    python3 scripts/router_hit_rate.py [--replicas 2] [--conversations 16] [--turns 4] \\
        [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from kvserve.bench.report import md_table
from kvserve.router.launcher import running_router, start_replicas, stop_replicas

SYSTEM = (
    "You are the support assistant of a hardware shop. Policies: returns within 30 days with the "
    "receipt; repairs under warranty for two years; shipping is free above 50 euros; "
    "store hours are 9 to 18 "
    "on weekdays and 10 to 16 on Saturdays. Answer briefly and politely. "
)
TOPICS = [
    "a broken drill",
    "a late delivery",
    "a missing screw set",
    "a return without receipt",
    "store hours",
    "a warranty repair",
    "shipping costs",
    "a gift card",
    "a wrong colour of paint",
    "a ladder recall",
    "a damaged parcel",
    "an invoice",
    "a loyalty card",
    "opening on holidays",
    "a price match",
    "a discount code",
]


def counters(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    got = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            got[s.name] = got.get(s.name, 0.0) + s.value
    return got.get("kvserve:prefix_cache_hits_total", 0.0), got.get(
        "kvserve:prefix_cache_queries_total", 0.0
    )


async def conversation(
    client: openai.AsyncOpenAI, model: str, i: int, turns: int, ttfts: list[float]
) -> None:
    messages = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        messages.append(
            {
                "role": "user",
                "content": f"Customer {i}, turn {t}: "
                f"a question about {TOPICS[(i + t) % len(TOPICS)]}.",
            }
        )
        t0 = time.perf_counter()
        first, parts = None, []
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=32, temperature=0, stream=True
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if first is None:
                    first = time.perf_counter() - t0
                parts.append(chunk.choices[0].delta.content)
        ttfts.append(first if first is not None else time.perf_counter() - t0)
        messages.append({"role": "assistant", "content": "".join(parts)})


async def drive(url: str, args) -> tuple[list[float], float]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    model = (await client.models.list()).data[0].id
    ttfts: list[float] = []
    sem = asyncio.Semaphore(args.concurrency)

    async def one(i):
        async with sem:
            await conversation(client, model, i, args.turns, ttfts)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(args.conversations)))
    wall = time.perf_counter() - t0
    await client.close()
    return ttfts, wall


def run_policy(policy: str, args) -> dict:
    """`policy`: a --policy name, for prefix optionally with its balance slack: prefix:2."""
    policy, _, slack = policy.partition(":")
    urls, procs = start_replicas(
        args.replicas,
        ["--max-model-len", "2048", "--no-access-log", "--log-level", "warning"],
        None,
    )
    try:
        with running_router(
            ["--policy", policy, "--log-level", "warning"]
            + (["--balance-slack", slack] if slack else [])
            + [a for u in urls for a in ("--replica", u)]
        ) as url:
            before = [counters(u) for u in urls]
            ttfts, wall = asyncio.run(drive(url, args))
            after = [counters(u) for u in urls]
            stats = httpx.get(f"{url}/router/stats", timeout=10).json()
    finally:
        stop_replicas(procs)
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    ttfts.sort()
    return {
        "policy": policy + (f" (slack {slack})" if slack else ""),
        "hit_rate": hits / queries if queries else 0.0,
        "prompt_tokens": queries,
        "ttft_mean_s": statistics.mean(ttfts),
        "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
        "wall_s": wall,
        "routed": [r["routed"] for r in stats["replicas"]],
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--policies", default="prefix,least_loaded,random")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    rows = [run_policy(policy, args) for policy in args.policies.split(",")]
    print(
        md_table(
            [
                "policy",
                "prefix-cache hit rate",
                "prompt tokens",
                "TTFT mean s",
                "TTFT p90 s",
                "wall s",
                "requests per replica",
            ],
            [
                [
                    r["policy"],
                    f"{100 * r['hit_rate']:.1f}%",
                    f"{r['prompt_tokens']:.0f}",
                    f"{r['ttft_mean_s']:.3f}",
                    f"{r['ttft_p90_s']:.3f}",
                    f"{r['wall_s']:.1f}",
                    r["routed"],
                ]
                for r in rows
            ],
        )
    )
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
