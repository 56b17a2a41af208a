"""How fast the server answers when it is overloaded or busy tokenizing (issue 15).

1. Burst: N connections opened first, then one completion request written on each at once,
   against a server whose waiting queue is small: how many got 200 / 429, and how long the
   429s took (p50, p99, max).
2. Big prompts: 4 concurrent /tokenize requests of ~2 MB of text while /health is polled:
   /health's latency (p50, max).

    PYTHONPATH=. python3 scripts/overload_latency.py [--burst 200] [--max-waiting 16]

Starts its own `kvserve serve` (default model, --threads 1). The client is raw asyncio sockets
(an HTTP client library would add its own milliseconds per request to every figure); the burst's
times are stamped in the transport callbacks: from a request's write to its status line's
arrival.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from kvserve.bench.common import machine_info
from kvserve.bench.servers import kvserve_server


def http_request(method: str, path: str, body: dict | None = None) -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


async def timed(reader, writer, request: bytes) -> tuple[int, float]:
    """Send one request on an open connection; (status, seconds until the status line)."""
    t0 = time.perf_counter()
    writer.write(request)
    await writer.drain()
    status_line = await reader.readline()
    seconds = time.perf_counter() - t0
    writer.close()
    return int(status_line.split()[1]), seconds


class _FirstLine(asyncio.Protocol):
    """One connection of the burst: when its request went out and when its status line came
    back, stamped in the transport callbacks (no coroutine resumption in between, whose delay
    with 200 of them in one client process would be counted as server latency)."""

    def __init__(self) -> None:
        self.sent = self.received = 0.0
        self.data = b""
        self.done = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        if not self.received:
            self.received = time.perf_counter()
        self.data += data
        if b"\r\n" in self.data and not self.done.done():
            self.done.set_result(int(self.data.split(b"\r\n", 1)[0].split()[1]))

    def connection_lost(self, exc) -> None:
        if not self.done.done():
            self.done.set_exception(ConnectionError("closed before a status line"))


async def burst(port: int, n: int, body: dict) -> list[tuple[int, float]]:
    """n connections opened first, then the request written on every one in one loop turn."""
    loop = asyncio.get_running_loop()
    conns = [(await loop.create_connection(_FirstLine, "127.0.0.1", port)) for _ in range(n)]
    request = http_request("POST", "/v1/completions", body)
    for transport, proto in conns:
        transport.write(request)
        proto.sent = time.perf_counter()
    statuses = await asyncio.gather(*(proto.done for _, proto in conns))
    for transport, _ in conns:
        transport.close()
    return [(status, proto.received - proto.sent) for status, (_, proto) in zip(statuses, conns)]


async def health_during_tokenize(port: int, num_big: int, chars: int) -> tuple[list[float], float]:
    """/health latencies (seconds) while `num_big` /tokenize requests of `chars` characters run."""
    text = ("The quick brown fox jumps over the lazy dog. " * (chars // 45 + 1))[:chars]
    big = http_request("POST", "/tokenize", {"prompt": text})

    async def tokenize() -> None:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        await timed(r, w, big)

    tasks = [asyncio.create_task(tokenize()) for _ in range(num_big)]
    t0 = time.perf_counter()
    latencies = []
    while not all(t.done() for t in tasks):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        latencies.append((await timed(r, w, http_request("GET", "/health")))[1])
        await asyncio.sleep(0.01)
    await asyncio.gather(*tasks)
    return latencies, time.perf_counter() - t0


def summary(ms: list[float]) -> str:
    ms = sorted(ms)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return f"p50 {statistics.median(ms):7.1f} ms  p99 {p99:7.1f} ms  max {ms[-1]:7.1f} ms"


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--burst", type=int, default=200)
    p.add_argument("--max-waiting", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--tokenize-chars", type=int, default=2_000_000)
    args = p.parse_args()
    flags = [
        "--threads",
        "1",
        "--max-waiting",
        str(args.max_waiting),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "128MiB",
        "--max-body-bytes",
        "4MiB",
    ]
    body = {
        "prompt": "Write a long story about a lighthouse keeper.",
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
    }
    with kvserve_server(None, flags) as url:
        port = int(url.rsplit(":", 1)[1])
        results = asyncio.run(burst(port, args.burst, body))
        health, seconds = asyncio.run(health_during_tokenize(port, 4, args.tokenize_chars))
    print(f"CPU: {machine_info().get('cpu')}")
    print(
        f"burst of {args.burst} completions (max_tokens {args.max_tokens}), "
        f"--max-waiting {args.max_waiting}, "
        f"--max-num-seqs {args.max_num_seqs}:"
    )
    by_status: dict[int, list[float]] = {}
    for status, s in results:
        by_status.setdefault(status, []).append(1000 * s)
    for status, ms in sorted(by_status.items()):
        print(f"  {status}: {len(ms):4d}  {summary(ms)}")
    print(
        f"/health while 4 x /tokenize of {args.tokenize_chars:,} characters ran ({seconds:.1f} s): "
        f"{len(health)} polls, {summary([1000 * s for s in health])}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
