"""`kvserve serve`: parse the flags, load the engine, serve the OpenAI-compatible API with uvicorn.

SIGTERM (or Ctrl-C) drains: new requests get 503 and /health turns 503, running requests finish
(for up to --shutdown-timeout seconds; the rest are aborted), then the process exits 0.
A second signal exits at once with code 1 (FORCED_EXIT_CODE), cutting running requests off.

Connections are limited below the app (kvserve/server/connections.py: header read timeout, idle
keep-alive timeout, --max-connections, accept() at the fd limit) and in the guard (body timeout).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import socket
import sys

import uvicorn

from kvserve.config import add_engine_args, engine_config_from_args, parse_size
from kvserve.config_file import add_config_arg, parse_args_with_config
from kvserve.engine.kv_payload import KEY_ENV, KEY_HEADER, ROLES, check_transfer_args
from kvserve.server.connections import (
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_KEEP_ALIVE_TIMEOUT,
    AcceptErrorHandler,
    ConnectionLimits,
    default_max_connections,
    protocol_class,
    raise_open_files_limit,
)
from kvserve.server.guard import DEFAULT_BODY_TIMEOUT

log = logging.getLogger("kvserve")

FORCED_EXIT_CODE = 1  # a second SIGTERM / Ctrl-C while draining


SWITCH_INTERVAL_S = 0.0005


def freeze_startup_objects() -> None:
    """Move every object alive once the engine and the app are built (modules, the model, the
    app's routes: hundreds of thousands) out of the cyclic collector's reach. Serving allocates
    fast (outputs, HTTP, JSON), so collections run often, and each full one would walk all of
    them again; they live as long as the process anyway."""
    gc.collect()
    gc.freeze()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvserve serve",
        description="Serve a model over an OpenAI-compatible HTTP API "
        "(/v1/completions, /v1/chat/completions, /metrics, /dashboard, ...).",
    )
    g = p.add_argument_group("server")
    g.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind; 0.0.0.0 exposes the server to the network (default: %(default)s)",
    )
    g.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send and see (default: the model file's name)",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health "
        "(and /metrics, /dashboard/data with --metrics-public) "
        "(default: $KVSERVE_API_KEY when set, else no key)",
    )
    g.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve GET /tokenizer_info (the tokenizer's special tokens and chat template, as "
        "vLLM's; lm-eval's tokenizer_backend=remote reads it) (default: off)",
    )
    g.add_argument(
        "--metrics-public",
        action="store_true",
        help="serve /metrics and /dashboard/data without the API key "
        "(default: they need the key when one is set)",
    )
    g.add_argument(
        "--max-body-bytes",
        default="2MiB",
        help="largest request body accepted; larger ones get 413 (default: %(default)s)",
    )
    add_kv_transfer_args(g)
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let running requests finish before aborting them "
        "(default: %(default)s)",
    )
    add_connection_args(g)
    g.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="server log verbosity (default: %(default)s)",
    )
    g.add_argument(
        "--no-access-log", action="store_true", help="do not log every HTTP request (default: log)"
    )
    add_engine_args(p)
    add_config_arg(p)
    return p


def add_kv_transfer_args(g) -> None:
    """Prefill/decode disaggregation (docs/scale-out.md): off unless a role is given."""
    g.add_argument(
        "--kv-transfer-role",
        default=None,
        choices=ROLES,
        help="take part in the KV handover of `kvserve router --prefill-replica`: "
        "prefill serves POST /v1/kv/prefill, decode POST /v1/kv/import, both both "
        "(default: neither route exists)",
    )
    g.add_argument(
        "--kv-transfer-key",
        default=None,
        metavar="KEY",
        help=f"the secret the handover's calls carry in the header {KEY_HEADER}, the "
        f"same on the router and every replica; required with --kv-transfer-role "
        f"(default: ${KEY_ENV})",
    )
    g.add_argument(
        "--kv-transfer-shared-prefix",
        action="store_true",
        help="register handed-over blocks in the prefix cache every unsalted request "
        "shares (default: a namespace of their own, read only by requests the "
        "router forwards with the key)",
    )
    g.add_argument(
        "--max-kv-transfer-bytes",
        default=None,
        help="largest KV payload POST /v1/kv/import accepts (default: the payload of a "
        "whole --max-model-len context)",
    )


def add_connection_args(g) -> None:
    g.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT,
        help="close a connection whose request line and headers are not complete this many "
        "seconds after it opened or after its previous response (default: %(default)s)",
    )
    g.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT,
        help="answer 408 and close when a request body has not arrived completely this many "
        "seconds after its headers (default: %(default)s)",
    )
    g.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=DEFAULT_KEEP_ALIVE_TIMEOUT,
        help="close a connection idle this many seconds after a response (default: %(default)s)",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open connections at most; one more gets 503 + Retry-After and is closed "
        "(default: min(2048, the open-files limit minus 64))",
    )


def check_connection_args(args) -> None:
    """Raise the open-files limit, fill in --max-connections, and refuse values that make no
    sense."""
    for flag in ("header_timeout", "body_timeout", "keep_alive_timeout"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be a positive number of seconds")
    open_files = raise_open_files_limit()
    if args.max_connections is None:
        args.max_connections = default_max_connections(open_files)
    elif args.max_connections < 1:
        raise ValueError("--max-connections must be at least 1")
    elif args.max_connections > open_files:
        log.warning(
            "--max-connections %d is above the open-files limit %d: past it, new connections "
            "are refused as they arrive",
            args.max_connections,
            open_files,
        )


class Server(uvicorn.Server):
    """uvicorn, with a draining shutdown instead of its immediate one."""

    def __init__(self, config: uvicorn.Config, engine, shutdown_timeout: float, banner: str):
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.banner = banner
        self.drain_requested = False
        self.drain_task: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        asyncio.get_running_loop().set_exception_handler(AcceptErrorHandler())
        await super().startup(sockets=sockets)
        if self.started:
            print(self.banner, file=sys.stderr, flush=True)

    def handle_exit(self, sig, frame) -> None:  # a signal handler: set flags, or exit outright
        if self.drain_requested:
            self.exit_now()
        self.drain_requested = True
        self.engine.accepting = False  # from now on new requests get 503

    def exit_now(self) -> None:
        """The second signal: leave at once. Not through interpreter shutdown, which can abort the
        process while the engine thread is inside native code."""
        log.warning(
            "second signal: exiting now with code %d, cutting off %d running request(s)",
            FORCED_EXIT_CODE,
            self.engine.num_in_flight,
        )
        logging.shutdown()  # flushes every handler
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(FORCED_EXIT_CODE)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_requested and self.drain_task is None:
            log.info(
                "draining: admitting no new request; waiting up to %.0fs for %d running",
                self.shutdown_timeout,
                self.engine.num_in_flight,
            )
            self.drain_task = asyncio.create_task(self.engine.shutdown(self.shutdown_timeout))
        if self.drain_task is not None and self.drain_task.done():
            self.should_exit = True
        return await super().on_tick(counter)


def banner(core, host: str, port: int, model_name: str, api_key: str | None) -> str:
    block = core.config.cache.block_size
    url = f"http://{host}:{port}"
    auth = " -H 'Authorization: Bearer $KVSERVE_API_KEY'" if api_key else ""
    return (
        f"kvserve listening on {url}\n"
        f"  model {model_name} ({core.model_path}), dtype {core.config.model.dtype}, "
        f"context {core.max_model_len} tokens\n"
        f"  KV cache capacity {core.kv_token_capacity} tokens ({core.num_blocks} blocks x {block}"
        f"{'' if len(core.kv_groups) == 1 else f' in {len(core.kv_groups)} window groups'})\n"
        f"  try: curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
        f'-d \'{{"model": "{model_name}", "messages": [{{"role": "user", "content": "Hello!"}}], '
        f'"max_tokens": 32}}\''
    )


# From this many cores on, a server leaves one to HTTP, tokenizing and local clients.
KEEP_A_CORE_FROM = 8


def serving_threads(local_ranks: int = 1) -> int:
    """torch threads of each rank on this machine when serving and --threads is not given, shared
    by the ranks: one core less than the process may use from KEEP_A_CORE_FROM cores on, so HTTP
    and local clients keep a core; every core below that, where one core is a seventh or more of
    the compute and the server's own work takes a small part of one (docs/server.md)."""
    cores = len(os.sched_getaffinity(0))
    return max(1, (cores - (cores >= KEEP_A_CORE_FROM)) // local_ranks)


def bind_error(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on (in use, no such address), or None: checked before
    the model loads, so a taken port fails in a second, not after the load."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            s.bind(addr)
    except OSError as e:
        return e.strerror or str(e)
    return None


def main(argv: list[str]) -> int:
    args = parse_args_with_config(build_parser(), argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args.api_key = args.api_key or os.environ.get("KVSERVE_API_KEY") or None
    args.kv_transfer_key = args.kv_transfer_key or os.environ.get(KEY_ENV) or None
    try:
        parse_size(args.max_body_bytes)
        if args.max_kv_transfer_bytes is not None:
            parse_size(args.max_kv_transfer_bytes)
        check_transfer_args(args.kv_transfer_role, args.kv_transfer_key)
        check_connection_args(args)
        config = engine_config_from_args(args)
    except ValueError as e:
        print(f"kvserve serve: {e}", file=sys.stderr)
        return 2
    if config.distributed.rank != 0:  # another node's ranks (or torchrun's): no server here
        from kvserve.engine.engine_core import run_rank

        return run_rank(config)
    if args.threads is None:
        config.num_threads = serving_threads(config.distributed.local_ranks)
    problem = bind_error(args.host, args.port)
    if problem is not None:
        print(
            f"kvserve serve: cannot listen on {args.host}:{args.port}: {problem} "
            "(choose another --port, or stop what is using it)",
            file=sys.stderr,
        )
        return 2

    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.engine.engine_core import EngineCore
    from kvserve.server.app import build_app

    try:
        core = EngineCore(config)
    except ValueError as e:  # refused at start (the device, the KV budget): the fix
        print(f"kvserve serve: {e}", file=sys.stderr)
        return 2
    print(core.describe(), file=sys.stderr, flush=True)
    # The engine thread's Python work (scheduling, sampling, detokenizing) holds the GIL between
    # kernel calls; at the default 5 ms switch interval the event loop waits up to that long for
    # each turn, which is what a fast 429 or a /health answer would cost under load.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    engine = AsyncEngine(core)
    try:
        app = build_app(engine, args)
    except ValueError as e:  # a --kv-transfer-role this engine cannot serve
        print(f"kvserve serve: {e}", file=sys.stderr)
        return 2
    freeze_startup_objects()
    name = args.served_model_name or core.model_name
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=not args.no_access_log,
        timeout_graceful_shutdown=max(5, int(args.shutdown_timeout) + 5),
        http=protocol_class(
            ConnectionLimits(args.header_timeout, args.max_connections, app.state.early_rejection)
        ),
        timeout_keep_alive=args.keep_alive_timeout,
    )
    server = Server(
        uv_config,
        engine,
        args.shutdown_timeout,
        banner(core, args.host, args.port, name, args.api_key),
    )
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
