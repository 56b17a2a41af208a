"""Peak RSS (VmHWM) of `kvserve serve` and of llama.cpp's llama-server serving the same requests.

    python3 scripts/peak_rss.py --llamacpp-bin PATH/llama-server [--num 16]

Each server is started on a free 127.0.0.1 port (llama-server with 16 slots x 2,048 tokens, as
`kvserve bench` runs it), sent the first --num W2 requests --num at a time, and its VmHWM read
from /proc before and after. Linux only.
"""
from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import httpx

from kvserve.bench import common
from kvserve.bench.datasets import standard_requests
from kvserve.bench.loadgen import run_load
from kvserve.bench.servers import llamacpp_request_kwargs


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc status")


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("server did not become healthy")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llamacpp-bin", required=True, help="llama.cpp's llama-server binary")
    p.add_argument("--num", type=int, default=16, help="W2 requests, all in flight at once (default: %(default)s)")
    args = p.parse_args()
    reqs = standard_requests("w2")[:args.num]
    gguf = common.model_path(None)
    servers = [
        ("kvserve", "SmolLM2-135M-Instruct", [sys.executable, "-m", "kvserve", "serve", "--no-access-log"], {}),
        ("llama-server", "default", [args.llamacpp_bin, "-m", gguf, "-t", "2", "-tb", "2", "-np", "16",
                                     "-c", str(16 * 2048), "-cb"],
         llamacpp_request_kwargs(gguf, args.llamacpp_bin, reqs)),
    ]
    for name, model, cmd, kwargs in servers:
        port = common.free_port()
        proc = subprocess.Popen(cmd + ["--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_healthy(port, proc)
            idle = peak_rss_mib(proc.pid)
            timings, _ = asyncio.run(run_load(f"http://127.0.0.1:{port}", reqs, model,
                                              max_concurrency=args.num, progress=False, **kwargs))
            ok = sum(t.ok for t in timings)
            print(f"{name}: peak RSS {peak_rss_mib(proc.pid):.0f} MiB after {args.num} requests "
                  f"({ok} ok; loaded and idle: {idle:.0f} MiB)")
        finally:
            proc.terminate()
            proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
