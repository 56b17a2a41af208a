"""`kvserve serve | generate | chat | bench | kv-calc | eval-quality`."""

from __future__ import annotations

import argparse
import signal
import sys
import time

from kvserve.config_file import add_config_arg, parse_args_with_config

USAGE = """kvserve <command> [options]

commands:
  serve      start the OpenAI-compatible HTTP server (default model, 127.0.0.1:8000)
  router     one endpoint over data-parallel replicas, routing by prompt prefix \
(--data-parallel-size N)
  generate   generate text for a prompt and print it
  chat       interactive chat in the terminal, streaming tokens as they come
  bench      benchmarks: throughput | serve | latency | roofline | report
  tune       search the engine's knobs for the best goodput under an SLO; writes --config YAML
  kv-calc    KV cache memory calculator for a model or config
  eval-quality  perplexity / top-1 agreement / KL of weight formats against fp32

`kvserve <command> --help` explains every option with its default."""


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument(
        "--max-tokens",
        type=int,
        default=max_tokens,
        help="tokens to generate (default: %(default)s)",
    )
    g.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)"
    )
    g.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)"
    )
    g.add_argument("--top-k", type=int, default=0, help="0 = off (default: %(default)s)")
    g.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="drop tokens less likely than min-p times the most likely one; 0 = off "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="divide the logits of tokens already in the prompt or output by this "
        "(negative ones: multiply); 1 = off, 1.1-1.3 curbs loops (default: %(default)s)",
    )
    g.add_argument(
        "--sample-seed", type=int, default=None, help="per-request sampling seed (default: none)"
    )
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def _params(args):
    from kvserve.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.sample_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def _load(args):
    from kvserve.config import engine_config_from_args
    from kvserve.engine.llm import LLM

    try:
        config = engine_config_from_args(args)
    except ValueError as e:  # a flag's value (e.g. --speculative-config): say which, exit 2
        print(f"kvserve: {e}", file=sys.stderr)
        sys.exit(2)
    if config.distributed.rank != 0:  # another node's ranks (or torchrun's): execute rank 0's steps
        from kvserve.engine.engine_core import run_rank

        sys.exit(run_rank(config))
    try:
        llm = LLM(config=config)
    except ValueError as e:  # refused at start (the device, the KV budget): the fix, exit 2
        print(f"kvserve: {e}", file=sys.stderr)
        sys.exit(2)
    print(llm.engine.describe(), file=sys.stderr)
    return llm


def cmd_generate(argv: list[str]) -> int:
    from kvserve.config import add_engine_args

    p = argparse.ArgumentParser(
        prog="kvserve generate", description="Generate a completion for a prompt."
    )
    p.add_argument("prompt", help="the prompt text")
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the chat template"
    )
    _sampling_args(p, max_tokens=64)
    add_engine_args(p)
    add_config_arg(p)
    args = parse_args_with_config(p, argv)
    t0 = time.perf_counter()
    llm = _load(args)
    params = _params(args)
    prompt = (
        {"prompt_token_ids": llm.chat_prompt([{"role": "user", "content": args.prompt}])}
        if args.chat
        else args.prompt
    )
    first = None
    n = 0
    for delta in llm.stream(prompt, params):
        if first is None:
            first = time.perf_counter()
        n += 1
        sys.stdout.write(delta)
        sys.stdout.flush()
    end = time.perf_counter()
    sys.stdout.write("\n")
    if first is not None:
        print(
            f"[start to first token {first - t0:.2f}s; {n} chunks in {end - first:.2f}s after it]",
            file=sys.stderr,
        )
    return 0


QUIT_COMMANDS = ("/exit", "/quit")


def cmd_chat(argv: list[str]) -> int:
    from kvserve.config import add_engine_args

    p = argparse.ArgumentParser(
        prog="kvserve chat",
        description="Chat with the model in the terminal "
        "(an empty line, /exit, /quit or Ctrl-D quits; /reset clears the history; "
        "Ctrl-C stops a reply).",
    )
    p.add_argument("--system", default=None, help="system prompt (default: none)")
    _sampling_args(p, max_tokens=256)
    add_engine_args(p)
    add_config_arg(p)
    args = parse_args_with_config(p, argv)
    llm = _load(args)
    params = _params(args)
    # Ctrl-C stops a reply even when this process started with SIGINT ignored (as everything
    # a non-interactive shell starts in the background does: Python then installs no handler).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line or line in QUIT_COMMANDS:
            return 0
        if line == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        sys.stdout.write("bot> ")
        try:
            reply, note = _stream_reply(llm, history, params)
        except ValueError as e:
            print(f"\n[error: {e}]")
            history.pop()
            continue
        print(f" [{note}]" if note else "")
        history.append({"role": "assistant", "content": reply})


def _stream_reply(llm, history: list[dict], params) -> tuple[str, str | None]:
    """Print the reply as it comes; (its text, a note for the user: stopped by Ctrl-C, or cut at
    --max-tokens). Ctrl-C aborts the request and keeps what was shown."""
    chunks: list[str] = []
    deltas = llm.stream({"prompt_token_ids": llm.chat_prompt(history)}, params)
    try:
        while True:
            try:
                delta = next(deltas)
            except StopIteration as done:
                note = (
                    f"cut at --max-tokens {params.max_tokens}" if done.value == "length" else None
                )
                return "".join(chunks), note
            chunks.append(delta)
            sys.stdout.write(delta)
            sys.stdout.flush()
    except KeyboardInterrupt:
        deltas.close()  # aborts the request in the engine
        return "".join(chunks), "stopped"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "generate":
        return cmd_generate(rest)
    if cmd == "chat":
        return cmd_chat(rest)
    if cmd == "serve":
        from kvserve.server.launcher import main as serve_main

        return serve_main(rest)
    if cmd == "router":
        from kvserve.router.launcher import main as router_main

        return router_main(rest)
    if cmd == "bench":
        from kvserve.bench.cli import main as bench_main

        return bench_main(rest)
    if cmd == "tune":
        from kvserve.bench.tune import main as tune_main

        return tune_main(rest)
    if cmd == "kv-calc":
        from kvserve.kv_calc import main as kv_main

        return kv_main(rest)
    if cmd == "eval-quality":
        from kvserve.eval_quality import main as eval_main

        return eval_main(rest)
    print(f"unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
