"""`kvserve bench start`: how long a server takes from exec to answering, and the memory it
holds, against llama.cpp's llama-server on the same GGUF.

Each round starts `kvserve serve` (then each --peer) as a subprocess, polls /v1/models every
20 ms until it answers 200 (ready: the weights are loaded and the engine can take requests),
sends one completion of 8 tokens (first reply: the first request's latency added, which a lazy
start would move there), then reads the peak resident memory of the server's process tree
(VmHWM of each process, summed) and stops it. The GGUF is read once first, so every start finds
it in the page cache (a cold disk measures the disk), and one untimed kvserve start comes
before the rounds (recorded apart as `first_start`): a large model's first start writes the
packed-weight cache (model/packed_cache.py), which the timed starts then map. Figures are medians
over --repeat rounds, the engines alternating within each round; the report gives each against
the file's size.
"""

from __future__ import annotations

import os
import shlex
import sys
import time

import httpx

from kvserve.bench import common
from kvserve.bench.latency import summarize_list
from kvserve.bench.throughput import add_output_args, add_peer_args, llamacpp_config, threads

FIGURES = ("ready_s", "first_reply_s", "peak_rss_bytes")
POLL_S = 0.02  # the ready poll: well under the differences measured
PROMPT = "Hello, my name is"


def add_args(p) -> None:
    g = p.add_argument_group("servers")
    g.add_argument("--model", default=None, help="GGUF both servers load (default: SmolLM2-135M)")
    g.add_argument("--server-args", default="", help="extra `kvserve serve` flags, one string")
    g.add_argument(
        "--threads", type=int, default=None, help="threads of every server (default: all cores)"
    )
    g.add_argument("--repeat", type=int, default=3, help="rounds (default: %(default)s)")
    g.add_argument(
        "--ready-timeout", type=float, default=600, help="seconds a start may take (default: 600)"
    )
    add_peer_args(p, "start")
    add_output_args(p)


def warm_page_cache(path: str) -> None:
    """Read the file once, so that every start finds it in the page cache."""
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 24):
            pass


def tree_peak_rss(pid: int) -> int:
    """Sum of VmHWM (peak resident bytes) over the process `pid` and its descendants."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                hwm = next((ln for ln in f if ln.startswith("VmHWM:")), None)
            total += int(hwm.split()[1]) * 1024 if hwm else 0
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def one_start(server) -> dict:
    """Start `server` (servers.ServerProcess), time it to ready and to its first reply, read its
    peak RSS, stop it."""
    t0 = time.monotonic()
    with server as url:
        ready = time.monotonic() - t0
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        r = httpx.post(
            f"{url}/v1/completions",
            json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
            timeout=server.ready_timeout,
        )
        r.raise_for_status()
        first = time.monotonic() - t0
        peak = tree_peak_rss(server.proc.pid)
    return {"ready_s": ready, "first_reply_s": first, "peak_rss_bytes": peak}


def summarize(samples: list[dict]) -> dict:
    return {k: summarize_list([s[k] for s in samples]) for k in FIGURES}


def main(args, argv: list[str]) -> int:
    from kvserve.bench.servers import (
        LLAMACPP_INSTALL,
        kvserve_server,
        llamacpp_available,
        llamacpp_server,
    )

    if "hf" in args.peer:
        return common.die("the hf peer has no server: compare its load time with `bench latency`")
    if "llamacpp" in args.peer and not llamacpp_available(args.llamacpp_bin):
        return common.die(LLAMACPP_INSTALL)
    if args.repeat < 1:
        return common.die("--repeat must be at least 1")
    gguf = common.model_path(args.model)
    warm_page_cache(gguf)
    n = threads(args)
    result = common.new_result("start", argv, args)
    result["workload"] = {"model_bytes": os.path.getsize(gguf), "prompt": PROMPT, "max_tokens": 8}
    engines = [] if args.only_peers else ["kvserve"]
    engines += [p for p in args.peer if p == "llamacpp"]
    samples: dict[str, list[dict]] = {e: [] for e in engines}
    server_args = shlex.split(args.server_args)
    if not any(a.startswith("--threads") for a in server_args):
        server_args += ["--threads", str(n)]

    def start(engine: str, label: str, untimed: bool = False) -> dict:
        if engine == "kvserve":
            server = kvserve_server(args.model, server_args)
        else:
            server = llamacpp_server(
                gguf, n, 1, args.llamacpp_ctx, args.llamacpp_bin,
                shlex.split(args.llamacpp_args),
            )  # fmt: skip
        server.ready_timeout, server.poll_s = args.ready_timeout, POLL_S
        if untimed:  # a first start writes the packed-weight cache before it exits: wait for it
            server.stop_timeout = args.ready_timeout
        s = one_start(server)
        print(
            f"{label} {engine}: ready {s['ready_s']:.2f} s, first reply "
            f"{s['first_reply_s']:.2f} s, peak RSS {s['peak_rss_bytes'] / 1e9:.2f} GB",
            file=sys.stderr,
        )
        return s

    # Untimed: a large model's first start writes the packed-weight cache the rounds then map.
    first = start("kvserve", "first start", untimed=True) if "kvserve" in engines else None
    for i in range(args.repeat):
        for engine in engines:
            samples[engine].append(start(engine, f"round {i + 1}"))
    for engine in engines:
        run = {"engine": engine, "samples": samples[engine], "summary": summarize(samples[engine])}
        if engine == "kvserve":
            run["first_start"] = first
        run["config"] = (
            {"server_args": shlex.join(server_args)}
            if engine == "kvserve"
            else llamacpp_config(args) | {"slots": 1}
        )
        result["runs"].append(run)
    print(table(result))
    name = "start" + (
        f"-{os.path.basename(args.model).removesuffix('.gguf')}" if args.model else ""
    )
    common.save_result(result, args.output, args.save, name)
    return 0


def table(result: dict) -> str:
    size = result["workload"]["model_bytes"]
    rows = []
    for run in result["runs"]:
        s = run["summary"]
        peak = s["peak_rss_bytes"]["median"]
        rows.append(
            [
                run["engine"],
                f"{s['ready_s']['median']:.2f} "
                f"({s['ready_s']['min']:.2f}-{s['ready_s']['max']:.2f})",
                f"{s['first_reply_s']['median']:.2f}",
                f"{peak / 1e9:.2f} (+{(peak - size) / 1e9:.2f})",
            ]
        )
    headers = ["engine", "ready s", "first reply s", f"peak RSS GB (over the {size / 1e9:.2f} GB)"]
    return common.table(headers, rows)
