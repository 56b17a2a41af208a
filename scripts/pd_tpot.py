"""Prefill/decode disaggregation against one mixed instance, on the same cores, under a load where
long prompts hurt decode latency.

mixed: one `kvserve serve` with --threads 2, behind `kvserve router`.
disaggregated: a prefill instance and a decode instance with --threads 1 each, behind
`kvserve router --prefill-replica`.

Load, the same for both: `--streams` chat streams, each decoding `--decode-tokens` tokens
from a short prompt, one after another for `--seconds`; meanwhile a long-prompt request
(`--long-chars` characters of text, 16 output tokens) every `--long-every` seconds. Reported per
setup: the decode streams' time per output token (the gaps between streamed tokens) p50 and
p99, and the long requests' time to first token, p50 and p99.

    python3 scripts/pd_tpot.py [--seconds 40] [--streams 3] [--long-every 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import sys
import time

import httpx
import openai

from kvserve.bench.report import md_table
from kvserve.router.launcher import running_router, start_replicas, stop_replicas

LONG = (
    "The log of the lighthouse keeper records the tide, the wind and the ships that passed, "
    "day by day, in the same careful hand; "
)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] if xs else float("nan")


async def run_load(url: str, args) -> dict:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    model = (await client.models.list()).data[0].id
    gaps: list[float] = []
    ttfts: list[float] = []
    deadline = time.monotonic() + args.seconds

    async def stream(i: int):
        n = 0
        while time.monotonic() < deadline:
            s = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"Story {i}-{n}: tell me about the sea."}],
                max_tokens=args.decode_tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            last = None
            async for chunk in s:
                if chunk.choices and chunk.choices[0].delta.content:
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
            n += 1

    async def longs():
        k = 0
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            text = f"Copy {k}. " + LONG * (args.long_chars // len(LONG))
            s = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": text + "\nSummarize the log."}],
                max_tokens=16,
                temperature=0,
                stream=True,
            )
            first = None
            async for chunk in s:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - t0
            ttfts.append(first if first is not None else time.perf_counter() - t0)
            k += 1
            await asyncio.sleep(max(0.0, args.long_every - (time.perf_counter() - t0)))

    await asyncio.gather(*(stream(i) for i in range(args.streams)), longs())
    await client.close()
    return {
        "tpot_p50_ms": 1e3 * pct(gaps, 0.5),
        "tpot_p99_ms": 1e3 * pct(gaps, 0.99),
        "tpot_mean_ms": 1e3 * statistics.mean(gaps),
        "tokens": len(gaps),
        "long_ttft_p50_s": pct(ttfts, 0.5),
        "long_ttft_p99_s": pct(ttfts, 0.99),
        "long_requests": len(ttfts),
    }


def setup(kind: str, args) -> dict:
    engine = ["--max-model-len", "4096", "--no-access-log", "--log-level", "warning"]
    if kind == "mixed":
        urls, procs = start_replicas(1, engine + ["--threads", "2"], None)
        extra = [a for u in urls for a in ("--replica", u)]
    else:
        key = secrets.token_urlsafe(16)  # the handover's own secret, shared by the three
        urls, procs = start_replicas(
            2,
            engine + ["--threads", "1", "--kv-transfer-role", "both", "--kv-transfer-key", key],
            None,
        )
        extra = ["--prefill-replica", urls[0], "--replica", urls[1], "--kv-transfer-key", key]
    try:
        with running_router(["--log-level", "warning", *extra]) as url:
            result = asyncio.run(run_load(url, args))
            if kind != "mixed":
                result["handed_over_tokens"] = httpx.get(f"{url}/router/stats", timeout=10).json()[
                    "handed_over_tokens"
                ]
    finally:
        stop_replicas(procs)
    return {"setup": kind, **result}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=40)
    p.add_argument("--streams", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--long-chars", type=int, default=6000)
    p.add_argument("--long-every", type=float, default=3.0)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    rows = [setup(kind, args) for kind in ("mixed", "disaggregated")]
    print(
        md_table(
            [
                "setup",
                "decode TPOT p50 ms",
                "decode TPOT p99 ms",
                "decode tokens",
                "long-prompt TTFT p50 s",
                "long-prompt TTFT p99 s",
                "long requests",
            ],
            [
                [
                    r["setup"],
                    f"{r['tpot_p50_ms']:.1f}",
                    f"{r['tpot_p99_ms']:.1f}",
                    r["tokens"],
                    f"{r['long_ttft_p50_s']:.2f}",
                    f"{r['long_ttft_p99_s']:.2f}",
                    r["long_requests"],
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
