"""Peak RSS (VmHWM) of `kvserve serve` and of llama.cpp's llama-server serving the same requests.

    python3 scripts/peak_rss.py --llamacpp-bin PATH/llama-server [--num 16]

Each server is started on a free 127.0.0.1 port (llama-server with 16 slots x 2,048 tokens, as
`kvserve bench` runs it), sent the first --num W2 requests --num at a time, and its VmHWM read
from /proc before and after. Linux only.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from kvserve.bench import common
from kvserve.bench.datasets import standard_requests
from kvserve.bench.loadgen import run_load
from kvserve.bench.servers import kvserve_server, llamacpp_request_kwargs, llamacpp_server
from kvserve.bench.start import tree_peak_rss


def peak_rss_mib(pid: int) -> float:
    peak = tree_peak_rss(pid)
    if not peak:
        raise RuntimeError("no VmHWM in /proc status")
    return peak / 2**20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llamacpp-bin", required=True, help="llama.cpp's llama-server binary")
    p.add_argument(
        "--num",
        type=int,
        default=16,
        help="W2 requests, all in flight at once (default: %(default)s)",
    )
    args = p.parse_args()
    reqs = standard_requests("w2")[: args.num]
    gguf = common.model_path(None)
    servers = [
        ("kvserve", kvserve_server(None, []), "SmolLM2-135M-Instruct", {}),
        (
            "llama-server",
            llamacpp_server(gguf, 2, 16, 2048, args.llamacpp_bin),
            "default",
            llamacpp_request_kwargs(gguf, args.llamacpp_bin, reqs),
        ),
    ]
    for name, server, model, kwargs in servers:
        with server as url:
            idle = peak_rss_mib(server.proc.pid)
            timings, _ = asyncio.run(
                run_load(url, reqs, model, max_concurrency=args.num, progress=False, **kwargs)
            )
            print(
                f"{name}: peak RSS {peak_rss_mib(server.proc.pid):.0f} MiB "
                f"after {args.num} requests "
                f"({sum(t.ok for t in timings)} ok; loaded and idle: {idle:.0f} MiB)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
