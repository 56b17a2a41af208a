"""`kvserve bench throughput | serve | latency | roofline | soak | structured | spec | host |
start | report`."""

from __future__ import annotations

import argparse

from kvserve.bench import (
    host,
    latency,
    report,
    roofline,
    serve,
    soak,
    spec,
    start,
    structured,
    throughput,
)

COMMANDS = {
    "throughput": (throughput, "offline throughput through kvserve.LLM, every request at once"),
    "serve": (
        serve,
        "load an OpenAI-compatible server: Poisson arrivals, TTFT/TPOT/ITL, goodput, sweeps",
    ),
    "latency": (latency, "one request at a time: prefill time, TTFT, decode tokens/s, N repeats"),
    "roofline": (
        roofline,
        "this machine's peak FLOP/s and memory bandwidth; a model's MBU and MFU",
    ),
    "soak": (
        soak,
        "many requests, some dropped, some hostile: the server must stay whole (no 5xx, no leak)",
    ),
    "structured": (
        structured,
        "structured output: JSON schemas end to end (compile, validity, truncation), "
        "and the cost of a constraint in TPOT",
    ),
    "spec": (
        spec,
        "speculative decoding against plain decoding, side by side: decode tokens/s, acceptance",
    ),
    "host": (
        host,
        "host time per decode step by phase, with a null forward (batch 1 to 1024)",
    ),
    "start": (
        start,
        "server start: seconds from exec to ready and to a first reply, peak RSS, against "
        "llama-server",
    ),
    "report": (report, "regenerate docs/benchmarks.md from docs/bench-results/*.json"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvserve bench",
        description="kvserve benchmarks, against peers "
        "(--peer hf, --peer llamacpp) and against this machine's limits.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        sp = sub.add_parser(
            name,
            help=help_text,
            description=(module.__doc__ or help_text).strip(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_args(sp)
        sp.set_defaults(func=module.main)
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args, argv)
