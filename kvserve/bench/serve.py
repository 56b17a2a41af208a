"""`kvserve bench serve`: serving load against an OpenAI-compatible server.

Sends the workload to /v1/completions (token-id prompts, greedy, exactly max_tokens) with
Poisson arrivals at --request-rate and at most --max-concurrency in flight; reports TTFT, TPOT,
ITL and end-to-end latency (mean / median / p90 / p99), request and token throughput, and goodput
under --slo. Without --base-url it starts `kvserve serve` itself. --sweep-rates /
--sweep-concurrency run one point per value and plot latency percentiles and goodput against it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shlex
import sys
from pathlib import Path

import httpx

from kvserve.bench import common
from kvserve.bench.datasets import BenchRequest, add_dataset_args, load_requests
from kvserve.bench.metrics import parse_slo, serve_report
from kvserve.bench.throughput import add_output_args, add_peer_args, llamacpp_config, threads


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def add_args(p) -> None:
    add_dataset_args(p)
    g = p.add_argument_group("server and load")
    g.add_argument(
        "--base-url",
        default=None,
        help="server to load, e.g. http://127.0.0.1:8000 (default: start `kvserve serve` here)",
    )
    g.add_argument(
        "--model",
        default=None,
        help="GGUF for the servers this command starts (default: SmolLM2-135M)",
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get("KVSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="bearer key for --base-url (default: $KVSERVE_API_KEY or $OPENAI_API_KEY)",
    )
    g.add_argument(
        "--model-name", default=None, help="`model` field of requests (default: the server's first)"
    )
    g.add_argument(
        "--server-args", default="", help="extra `kvserve serve` flags when it is started here"
    )
    g.add_argument(
        "--threads", type=int, default=None, help="peer server threads (default: all cores)"
    )
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrival rate, requests/s (default: inf = all at once)",
    )
    g.add_argument(
        "--max-concurrency", type=int, default=None, help="max requests in flight (default: no cap)"
    )
    g.add_argument(
        "--sweep-rates", default=None, help="comma list of request rates, one run each: 1,2,4,8"
    )
    g.add_argument(
        "--sweep-concurrency", default=None, help="comma list of max concurrencies: 1,4,16,64"
    )
    g.add_argument(
        "--slo",
        default="ttft=2s,tpot=100ms",
        help="goodput bounds, any of ttft/tpot/itl/e2e (default: %(default)s)",
    )
    g.add_argument(
        "--text-prompts", action="store_true", help="send prompts as text instead of token ids"
    )
    g.add_argument(
        "--seed", type=int, default=0, help="workload and arrival seed (default: %(default)s)"
    )
    g.add_argument(
        "--warmup", type=int, default=1, help="untimed warm-up requests (default: %(default)s)"
    )
    g.add_argument(
        "--plot",
        default=None,
        help="sweep plot PNG (default: docs/bench-results/serve-<...>.png with --save, "
        "else beside the -o JSON)",
    )
    add_peer_args(p, "start and load")
    add_output_args(p)


def sweep_points(args) -> tuple[str | None, list[tuple[float, int | None]]]:
    """(the swept knob, [(request_rate, max_concurrency), ...])."""
    if args.sweep_rates and args.sweep_concurrency:
        raise SystemExit("give --sweep-rates or --sweep-concurrency, not both")
    if args.sweep_rates:
        return "request_rate", [(r, args.max_concurrency) for r in _floats(args.sweep_rates)]
    if args.sweep_concurrency:
        return "max_concurrency", [
            (args.request_rate, int(c)) for c in _floats(args.sweep_concurrency)
        ]
    return None, [(args.request_rate, args.max_concurrency)]


def reset_prefix_cache(url: str, key: str | None = None) -> None:
    """Best effort: servers with vLLM's /reset_prefix_cache forget earlier points' prompts."""
    from kvserve.bench.loadgen import auth_headers

    with contextlib.suppress(httpx.HTTPError):
        httpx.post(url.rstrip("/") + "/reset_prefix_cache", timeout=10, headers=auth_headers(key))


def load_engine(
    args,
    url: str,
    reqs: list[BenchRequest],
    points,
    slo,
    request_kwargs: dict,
    key: str | None = None,
) -> list[dict]:
    from kvserve.bench.loadgen import run_load, served_model

    model = args.model_name or served_model(url, key)
    if args.warmup:
        warm = [BenchRequest(r.prompt_ids[:8], 4) for r in reqs[: args.warmup]]
        wk = dict(request_kwargs)
        if wk.get("prompt_texts"):
            wk["prompt_texts"] = [t[:32] for t in wk["prompt_texts"][: args.warmup]]
        asyncio.run(run_load(url, warm, model, progress=False, api_key=key, **wk))
    out = []
    for rate, conc in points:
        reset_prefix_cache(url, key)
        timings, duration = asyncio.run(
            run_load(
                url,
                reqs,
                model,
                rate=rate,
                max_concurrency=conc,
                seed=args.seed,
                progress=not args.no_progress,
                api_key=key,
                **request_kwargs,
            )
        )
        rep = serve_report(timings, duration, slo)
        out.append({"request_rate": rate, "max_concurrency": conc, "metrics": rep})
        print_point(rep, rate, conc)
    return out


def print_point(m: dict, rate: float, conc: int | None) -> None:
    g = m.get("goodput", {})
    print(
        f"rate {rate:g} conc {conc or '-'}: {m['completed']}/{m['num_requests']} ok "
        f"in {m['duration_s']:.1f}s, "
        f"{m['output_token_throughput']:.1f} out tok/s, TTFT p50 {m['ttft_s']['median']:.3f}s "
        f"p99 {m['ttft_s']['p99']:.3f}s, TPOT p50 {m['tpot_s']['median'] * 1e3:.1f}ms, "
        f"goodput {g.get('share', math.nan) * 100:.0f}%",
        file=sys.stderr,
    )


def print_tables(runs: list[dict]) -> None:
    rows = []
    for r in runs:
        for pt in r["points"]:
            m = pt["metrics"]
            rows.append(
                [
                    r["engine"],
                    f"{pt['request_rate']:g}",
                    pt["max_concurrency"] or "-",
                    f"{m['completed']}/{m['num_requests']}",
                    m["request_throughput"],
                    m["output_token_throughput"],
                    m["ttft_s"]["median"],
                    m["ttft_s"]["p99"],
                    m["tpot_s"]["median"] * 1e3,
                    m["tpot_s"]["p99"] * 1e3,
                    m["itl_s"]["p99"] * 1e3,
                    m["e2e_s"]["median"],
                    m.get("goodput", {}).get("rate"),
                    m.get("goodput", {}).get("share", math.nan) * 100,
                ]
            )
    print(
        common.table(
            [
                "engine",
                "rate",
                "conc",
                "ok",
                "req/s",
                "out tok/s",
                "TTFT p50 s",
                "TTFT p99 s",
                "TPOT p50 ms",
                "TPOT p99 ms",
                "ITL p99 ms",
                "e2e p50 s",
                "good req/s",
                "good %",
            ],
            rows,
        )
    )
    base = next((r for r in runs if r["engine"] == "kvserve"), None)
    for peer in (r for r in runs if r["engine"] != "kvserve"):
        if base is None:
            break
        print(f"\nkvserve / {peer['engine']}:")
        ratio_rows = []
        for a, b in zip(base["points"], peer["points"]):
            ma, mb = a["metrics"], b["metrics"]
            ratio_rows.append(
                [
                    f"{a['request_rate']:g}",
                    a["max_concurrency"] or "-",
                    common.ratio(ma["output_token_throughput"], mb["output_token_throughput"]),
                    common.ratio(mb["ttft_s"]["median"], ma["ttft_s"]["median"]),
                    common.ratio(mb["tpot_s"]["median"], ma["tpot_s"]["median"]),
                    common.ratio(
                        ma.get("goodput", {}).get("rate"), mb.get("goodput", {}).get("rate")
                    ),
                ]
            )
        print(
            common.table(
                [
                    "rate",
                    "conc",
                    "out tok/s x",
                    "TTFT p50 faster x",
                    "TPOT p50 faster x",
                    "goodput x",
                ],
                ratio_rows,
            )
        )


def plot_sweep(runs: list[dict], knob: str, path: Path, title: str) -> None:
    plt = common.pyplot()

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    panels = [("ttft_s", "TTFT (s)", 1), ("tpot_s", "TPOT (ms)", 1e3)]
    for ax, (key, label, scale) in zip(axes[0], panels):
        for r in runs:
            xs = [p[knob] for p in r["points"]]
            for q, style in (("median", "-o"), ("p99", "--x")):
                ax.plot(
                    xs,
                    [p["metrics"][key][q] * scale for p in r["points"]],
                    style,
                    label=f"{r['engine']} {q}",
                )
        ax.set_ylabel(label)
    for r in runs:
        xs = [p[knob] for p in r["points"]]
        axes[1][0].plot(
            xs,
            [p["metrics"]["output_token_throughput"] for p in r["points"]],
            "-o",
            label=r["engine"],
        )
        axes[1][1].plot(
            xs,
            [p["metrics"].get("goodput", {}).get("rate", math.nan) for p in r["points"]],
            "-o",
            label=r["engine"],
        )
    axes[1][0].set_ylabel("output tokens/s")
    axes[1][1].set_ylabel("goodput (requests/s meeting the SLO)")
    ticks = sorted({p[knob] for r in runs for p in r["points"]})
    for ax in axes.flat:
        ax.set_xlabel("request rate (req/s)" if knob == "request_rate" else "max concurrency")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot written to {path}")


def kvserve_run(args, reqs, points, slo, text_kwargs) -> dict:
    """kvserve's run: the server at --base-url, or one started here."""
    from kvserve.bench.servers import kvserve_server

    server = (
        contextlib.nullcontext(args.base_url)
        if args.base_url
        else kvserve_server(args.model, shlex.split(args.server_args), args.api_key)
    )
    with server as url:
        return {
            "engine": "kvserve",
            "base_url": args.base_url,
            "config": {"server_args": args.server_args},
            "points": load_engine(args, url, reqs, points, slo, text_kwargs, args.api_key),
        }


def llamacpp_run(args, gguf, reqs, points, slo) -> dict:
    """llama.cpp's run: llama-server started here on the same GGUF."""
    from kvserve.bench.servers import llamacpp_request_kwargs, llamacpp_server

    server = llamacpp_server(
        gguf,
        threads(args),
        args.llamacpp_slots,
        args.llamacpp_ctx,
        args.llamacpp_bin,
        shlex.split(args.llamacpp_args),
    )
    with server as url:
        kw = llamacpp_request_kwargs(gguf, args.llamacpp_bin, reqs)
        return {
            "engine": "llamacpp",
            "config": llamacpp_config(args),
            "points": load_engine(args, url, reqs, points, slo, kw),
        }


def main(args, argv: list[str]) -> int:
    from kvserve.bench.servers import LLAMACPP_INSTALL, llamacpp_available

    if "hf" in args.peer:
        return common.die(
            "the hf peer has no server: use it with `kvserve bench throughput` or `latency`"
        )
    if "llamacpp" in args.peer and not llamacpp_available(args.llamacpp_bin):
        return common.die(LLAMACPP_INSTALL)
    try:
        slo = parse_slo(args.slo) if args.slo else None
        knob, points = sweep_points(args)
    except ValueError as e:
        return common.die(str(e))
    if knob is not None and not common.have_matplotlib():  # a sweep ends in a plot
        return common.die(common.PLOTS_NEED_MATPLOTLIB)
    gguf = common.model_path(args.model)
    encode = None
    if args.dataset == "sharegpt":
        from kvserve.bench.tokenize import encoder

        encode = encoder(gguf)
    reqs = load_requests(args, gguf, encode)
    result = common.new_result("serve", argv, args)
    result["workload"] = {
        "dataset": args.dataset,
        "num_requests": len(reqs),
        "prompt_tokens": sum(len(r.prompt_ids) for r in reqs),
        "max_tokens_total": sum(r.max_tokens for r in reqs),
    }
    result["sweep"] = knob
    text_kwargs = {}
    if args.text_prompts:
        from kvserve.bench.tokenize import decoder

        decode = decoder(gguf)
        text_kwargs = {"prompt_texts": [decode(r.prompt_ids) for r in reqs]}

    if not args.only_peers:
        result["runs"].append(kvserve_run(args, reqs, points, slo, text_kwargs))
    if "llamacpp" in args.peer:
        result["runs"].append(llamacpp_run(args, gguf, reqs, points, slo))
    print_tables(result["runs"])
    name = f"serve-{args.dataset}" + (f"-{knob.replace('_', '-')}-sweep" if knob else "")
    if knob:
        # docs/bench-results only for a saved result; otherwise beside the output JSON (or here)
        plot = (
            Path(args.plot)
            if args.plot
            else common.RESULTS_DIR / f"{name}.png"
            if args.save
            else Path(args.output or f"{name}.json").with_suffix(".png")
        )
        plot_sweep(
            result["runs"], knob, plot, f"{args.dataset}: {len(reqs)} requests, SLO {args.slo}"
        )
        result["plot"] = str(plot)
    common.save_result(result, args.output, args.save, name)
    return 0
