"""`kvserve router`: one OpenAI-compatible endpoint in front of data-parallel replicas.

Either point it at running servers (`--replica URL`, repeatable: `kvserve serve` on this machine
or others), or let it start them: `--data-parallel-size N` runs N `kvserve serve` processes on
127.0.0.1, each with the engine flags given after the router's own (default: the cores this
process may use, split evenly: `--threads` each), stops them when the router stops, and routes
over them. Routing and health checks: kvserve/router/app.py and policy.py.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import subprocess
import sys
import time

import httpx
import uvicorn

from kvserve.router.app import build_router_app
from kvserve.router.forwarding import DEFAULT_MAX_BODY_BYTES
from kvserve.router.policy import POLICIES, Router

log = logging.getLogger("kvserve.router")


def build_parser() -> argparse.ArgumentParser:
    """The router's own flags; what it does not know goes to the replicas it starts (main)."""
    p = argparse.ArgumentParser(
        prog="kvserve router",
        description="Route OpenAI API requests over data-parallel kvserve replicas: each request "
        "goes to the replica most likely to hold its prompt's prefix in its KV cache, else the "
        "least loaded. "
        "Flags after the router's own go to every replica started by --data-parallel-size "
        "(e.g. --max-model-len 4096).",
    )
    _add_replica_args(p)
    _add_routing_args(p)
    _add_access_args(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def _add_replica_args(p: argparse.ArgumentParser) -> None:
    """Which replicas to route over: running ones, started ones, and prefill ones."""
    p.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="URL",
        help="a running replica, e.g. http://10.0.0.2:8000 (repeatable)",
    )
    p.add_argument(
        "--prefill-replica",
        action="append",
        default=[],
        metavar="URL",
        help="prefill/decode disaggregation: a replica that computes prompts and hands their KV "
        "blocks to the --replica (decode) replicas (repeatable; default: none, every replica "
        "does both)",
    )
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=0,
        metavar="N",
        help="start N `kvserve serve` replicas on 127.0.0.1 "
        "(default: none; give --replica instead)",
    )


def _add_routing_args(p: argparse.ArgumentParser) -> None:
    """Where the router listens, how it picks a replica and how often it checks them."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default="prefix",
        help="prefix: the replica holding the longest prefix, within a load slack; least_loaded; "
        "random (default: %(default)s)",
    )
    p.add_argument(
        "--balance-slack",
        type=int,
        default=1,
        help="prefix policy: requests in flight a replica may have above the least loaded one "
        "(L) and still get a prefix it holds: max(this, --balance-ratio x L) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--balance-ratio",
        type=float,
        default=0.25,
        help="prefix policy: the slack as a share of L under load (default: %(default)s)",
    )
    p.add_argument(
        "--health-interval",
        type=float,
        default=2.0,
        help="seconds between health checks of every replica (default: %(default)s)",
    )


def _add_access_args(p: argparse.ArgumentParser) -> None:
    """The keys and limits requests meet: API key, body size, KV handover key."""
    p.add_argument(
        "--api-key",
        default=os.environ.get("KVSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health, and pass it to the "
        "replicas started here (default: $KVSERVE_API_KEY when set)",
    )
    p.add_argument(
        "--router-max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="N",
        help="a request body of more bytes gets 413 from the router, counted as it arrives "
        "(default: %(default)s; --max-body-bytes goes to the replicas)",
    )
    p.add_argument(
        "--kv-transfer-key",
        default=os.environ.get("KVSERVE_KV_TRANSFER_KEY"),
        metavar="KEY",
        help="with --prefill-replica: the replicas' --kv-transfer-key, sent with "
        "every KV handover call and decode request (default: "
        "$KVSERVE_KV_TRANSFER_KEY when set)",
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_replicas(n: int, engine_args: list[str], api_key: str | None, timeout: float = 300.0):
    """N `kvserve serve` subprocesses, ready; returns (urls, processes)."""
    cores = len(os.sched_getaffinity(0))
    extra = list(engine_args)
    if "--threads" not in extra:
        extra += ["--threads", str(max(1, cores // n))]
    if api_key and "--api-key" not in extra:
        extra += ["--api-key", api_key]
    procs, urls = [], []
    for i in range(n):
        port = _free_port()
        cmd = [
            sys.executable,
            "-m",
            "kvserve",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *extra,
        ]
        log.info("starting replica %d: %s", i, " ".join(cmd))
        procs.append(subprocess.Popen(cmd))
        urls.append(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + timeout
    for url, proc in zip(urls, procs):
        try:
            wait_ready(url, proc, deadline)
        except RuntimeError:
            stop_replicas(procs)
            raise
    return urls, procs


def wait_ready(url: str, proc: subprocess.Popen, deadline: float) -> None:
    """Until `url`/health answers 200; RuntimeError when `proc` exits first or time.monotonic()
    passes `deadline`."""
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready in time")
        time.sleep(0.25)


@contextlib.contextmanager
def running_router(args: list[str], timeout: float = 60.0):
    """`kvserve router ARGS` on a free 127.0.0.1 port, ready; yields its URL and stops it after
    (scripts that measure routing set ups)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvserve", "router", "--port", str(port), *args])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, time.monotonic() + timeout)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def stop_replicas(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


def main(argv: list[str]) -> int:
    args, engine_args = build_parser().parse_known_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if args.data_parallel_size < 0:
        print("kvserve router: --data-parallel-size must be >= 1", file=sys.stderr)
        return 2
    if args.router_max_body_bytes < 1:
        print("kvserve router: --router-max-body-bytes must be >= 1", file=sys.stderr)
        return 2
    if args.prefill_replica and not args.kv_transfer_key:
        print(
            "kvserve router: --prefill-replica needs --kv-transfer-key KEY (or "
            "$KVSERVE_KV_TRANSFER_KEY): the key the prefill and decode replicas were started "
            "with",
            file=sys.stderr,
        )
        return 2
    if engine_args and not args.data_parallel_size:
        print(
            f"kvserve router: unknown flags {engine_args} (engine flags go to replicas started by "
            f"--data-parallel-size)",
            file=sys.stderr,
        )
        return 2
    procs = []
    urls = [u.rstrip("/") for u in args.replica]
    try:
        if args.data_parallel_size:
            started, procs = start_replicas(args.data_parallel_size, engine_args, args.api_key)
            urls += started
        try:
            router = Router(
                urls,
                args.policy,
                balance_slack=args.balance_slack,
                balance_ratio=args.balance_ratio,
            )
        except ValueError as e:
            print(f"kvserve router: {e}", file=sys.stderr)
            return 2
        print(
            f"kvserve router: {len(urls)} replica(s) {urls}, policy {args.policy}, "
            f"on http://{args.host}:{args.port}",
            file=sys.stderr,
            flush=True,
        )
        prefill = None
        if args.prefill_replica:
            try:
                prefill = Router([u.rstrip("/") for u in args.prefill_replica], "least_loaded")
            except ValueError as e:
                print(f"kvserve router: --prefill-replica: {e}", file=sys.stderr)
                return 2
        app = build_router_app(
            router,
            health_interval=args.health_interval,
            api_key=args.api_key,
            prefill=prefill,
            max_body_bytes=args.router_max_body_bytes,
            kv_transfer_key=args.kv_transfer_key,
        )
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
        return 0
    finally:
        stop_replicas(procs)
