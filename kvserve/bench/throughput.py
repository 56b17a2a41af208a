"""`kvserve bench throughput`: offline throughput, every request submitted at once.

kvserve runs through the offline LLM API; --peer hf runs transformers static batches;
--peer llamacpp sends the same token ids to a llama.cpp server, all at once.
--dataset multiturn runs kvserve in rounds: round t sends every conversation's
system + q1 + a1 + ... + q_t at once, a_i being what kvserve answered in round i.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time

from kvserve.bench import common
from kvserve.bench.datasets import (
    MULTITURN,
    BenchRequest,
    Conversation,
    add_dataset_args,
    load_conversations,
    load_requests,
    multiturn_output_len,
    multiturn_prompt,
)
from kvserve.bench.metrics import percentile, throughput_report


def add_peer_args(p, what: str, vllm: bool = False) -> None:
    g = p.add_argument_group("peers")
    g.add_argument(
        "--peer",
        action="append",
        choices=["hf", "llamacpp", *(["vllm", "server"] if vllm else [])],
        default=[],
        help=f"also {what} a peer on the same workload and print ratios (repeatable)"
        + ("; server: kvserve's own server with the same engine flags" if vllm else ""),
    )
    g.add_argument(
        "--only-peers", action="store_true", help="skip kvserve, run only the --peer engines"
    )
    g.add_argument(
        "--hf-batch-size", type=int, default=32, help="hf: static batch size (default: %(default)s)"
    )
    g.add_argument(
        "--llamacpp-bin",
        default=None,
        help="llama.cpp's llama-server binary (parallel slots); default: llama-cpp-python's server",
    )
    g.add_argument(
        "--llamacpp-slots",
        type=int,
        default=16,
        help="llama-server parallel slots (default: %(default)s)",
    )
    g.add_argument(
        "--llamacpp-ctx",
        type=int,
        default=2048,
        help="llama.cpp context tokens per slot (default: %(default)s)",
    )
    g.add_argument("--llamacpp-args", default="", help="extra llama.cpp server flags, one string")
    if vllm:
        g.add_argument(
            "--vllm-python",
            default=None,
            help="vllm: the Python that has vLLM's CPU build (default: this one); "
            "see kvserve/bench/vllm_peer.py",
        )
        g.add_argument(
            "--vllm-kv-cache-gib",
            type=int,
            default=4,
            help="vllm: VLLM_CPU_KVCACHE_SPACE (default: %(default)s)",
        )


def add_output_args(p) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--output", "-o", default=None, help="write the result JSON here")
    g.add_argument(
        "--save", action="store_true", help="write the result JSON under docs/bench-results/"
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


MAX_REPEAT = 50


def add_args(p) -> None:
    from kvserve.config import add_engine_args

    add_dataset_args(p, multiturn=True)
    add_engine_args(p)
    add_peer_args(p, "run", vllm=True)
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds, each running kvserve then every peer: the figures are each engine's median "
        "round, and every round's ratio is printed (a shared machine drifts between the "
        f"engines' runs; 1..{MAX_REPEAT}, default: %(default)s)",
    )
    add_output_args(p)


def median_runs(rounds: list[list[dict]]) -> list[dict]:
    """One run per engine from `rounds` (each a list of runs, one per engine, in the same order):
    the engine's median round by useful output tokens/s (the lower middle one for an even count),
    with every round's metrics under "rounds"."""
    runs = []
    for j in range(len(rounds[0])):
        mine = [rnd[j] for rnd in rounds]
        ranked = sorted(mine, key=lambda r: r["metrics"]["useful_output_tokens_per_s"])
        run = dict(ranked[(len(ranked) - 1) // 2])
        if len(mine) > 1:
            run["rounds"] = [r["metrics"] for r in mine]
        runs.append(run)
    return runs


def round_ratios(rounds: list[list[dict]]) -> dict[str, list[float]]:
    """Per peer, kvserve's useful output tokens/s over the peer's, round by round."""
    out: dict[str, list[float]] = {}
    for rnd in rounds:
        base = next((r for r in rnd if r["engine"] == "kvserve"), None)
        for r in rnd:
            if base is not None and r is not base:
                out.setdefault(r["engine"], []).append(
                    common.ratio(
                        base["metrics"]["useful_output_tokens_per_s"],
                        r["metrics"]["useful_output_tokens_per_s"],
                    )
                )
    return out


def check_peers(args) -> str | None:
    """None when every requested peer can run, else how to install the missing one."""
    from kvserve.bench.hf_peer import HF_INSTALL, hf_available
    from kvserve.bench.servers import LLAMACPP_INSTALL, llamacpp_available

    if "hf" in args.peer and not hf_available():
        return HF_INSTALL
    if "llamacpp" in args.peer and not llamacpp_available(args.llamacpp_bin):
        return LLAMACPP_INSTALL
    if "vllm" in args.peer:
        from kvserve.bench.vllm_peer import VLLM_INSTALL, vllm_available, vllm_python

        if not hf_available():
            return (
                HF_INSTALL
                + " (the vllm peer's float32 copy of the GGUF is written by transformers)"
            )
        if not vllm_available(vllm_python(args.vllm_python)):
            return VLLM_INSTALL
    return None


def threads(args) -> int:
    import os

    return args.threads or len(os.sched_getaffinity(0))


def _counts(reqs: list[BenchRequest]) -> tuple[int, int]:
    return sum(len(r.prompt_ids) for r in reqs), sum(r.max_tokens for r in reqs)


def ttfts(outs) -> list[float]:
    """Each output's time to first token from the engine's timestamps (first token - arrival)."""
    return [
        o.metrics.first_token_time - o.metrics.arrival_time
        for o in outs
        if o.metrics is not None and o.metrics.first_token_time is not None
    ]


def cache_figures(times: list[float], prompt_tokens: int, cached_tokens: int) -> dict:
    """TTFT median / mean and the prefix cache hit rate (cached prompt tokens / prompt tokens)."""
    return {
        "ttft_median_s": percentile(times, 50) if times else None,
        "ttft_mean_s": sum(times) / len(times) if times else None,
        "cached_prompt_tokens": cached_tokens,
        "hit_rate": cached_tokens / prompt_tokens if prompt_tokens else None,
    }


def _kvserve_config(args, llm) -> dict:
    return {
        "dtype": llm.engine.config.model.dtype,
        "device": llm.engine.config.device,
        "steps": llm.engine.step_path,
        "quantization": llm.engine.quantization,
        "prefix_caching": not args.no_prefix_caching,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }


def _load_kvserve(args, warm_ids: list[int]):
    from kvserve import LLM, SamplingParams
    from kvserve.config import engine_config_from_args

    t0 = time.perf_counter()
    llm = LLM(config=engine_config_from_args(args))
    load_s = time.perf_counter() - t0
    print(llm.engine.describe(), file=sys.stderr)
    # Warm up on a prompt shorter than one KV block, so nothing it leaves in the prefix cache helps.
    llm.generate(
        [{"prompt_token_ids": warm_ids[:8]}],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    return llm, load_s


def run_kvserve(args, reqs: list[BenchRequest]) -> dict:
    from kvserve import SamplingParams

    llm, load_s = _load_kvserve(args, reqs[0].prompt_ids)
    prompts = [{"prompt_token_ids": r.prompt_ids} for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    elapsed = time.perf_counter() - start
    lens = [len(o.outputs[0].token_ids) for o in outs]
    inp, _ = _counts(reqs)
    useful = sum(min(n, r.max_tokens) for n, r in zip(lens, reqs))
    run = {
        "engine": "kvserve",
        "load_s": load_s,
        "model": llm.engine.model_path,
        "steps": llm.engine.step_path,
        "config": _kvserve_config(args, llm),
        **cache_figures(ttfts(outs), inp, sum(o.num_cached_tokens for o in outs)),
        "metrics": throughput_report(len(reqs), inp, sum(lens), useful, elapsed),
    }
    print(
        f"kvserve: prefix cache served {run['cached_prompt_tokens']} of {inp} prompt tokens",
        file=sys.stderr,
    )
    del llm, outs
    gc.collect()
    return run


def multiturn_asked(convs: list[Conversation], output_len: int) -> tuple[int, int]:
    """Prompt tokens over all rounds (every answer exactly output_len long) and output tokens
    asked."""
    prompt = sum(
        len(c.system_ids) + sum(len(q) for q in c.questions[: t + 1]) + t * output_len
        for c in convs
        for t in range(len(c.questions))
    )
    return prompt, sum(len(c.questions) for c in convs) * output_len


def run_multiturn(args, convs: list[Conversation], output_len: int) -> dict:
    """kvserve in rounds: round t submits every conversation's system + q1 + a1 + ... + q_t at once,
    a_i being the ids kvserve generated in round i, as a chat client sends its history back."""
    from kvserve import SamplingParams

    llm, load_s = _load_kvserve(args, convs[0].system_ids)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    answers: list[list[list[int]]] = [[] for _ in convs]
    per_turn = []
    all_ttfts: list[float] = []
    inp = out_tokens = useful = cached = 0
    start = time.perf_counter()
    for t in range(args.turns):
        prompts = [
            multiturn_prompt(c.system_ids, c.questions, answers[i]) for i, c in enumerate(convs)
        ]
        t0 = time.perf_counter()
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=not args.no_progress
        )
        round_s = time.perf_counter() - t0
        failed = [o for o in outs if o.error]
        if failed:
            raise RuntimeError(
                f"kvserve: {len(failed)} requests failed in turn {t + 1}, first: {failed[0].error}"
            )
        for i, o in enumerate(outs):
            answers[i].append(list(o.outputs[0].token_ids))
        lens = [len(o.outputs[0].token_ids) for o in outs]
        times = ttfts(outs)
        p_tok, c_tok = sum(len(p) for p in prompts), sum(o.num_cached_tokens for o in outs)
        per_turn.append(
            {
                "turn": t + 1,
                "requests": len(outs),
                "prompt_tokens": p_tok,
                "output_tokens": sum(lens),
                "elapsed_s": round_s,
                **cache_figures(times, p_tok, c_tok),
            }
        )
        all_ttfts += times
        inp, cached, out_tokens = inp + p_tok, cached + c_tok, out_tokens + sum(lens)
        useful += sum(min(n, output_len) for n in lens)
    elapsed = time.perf_counter() - start
    run = {
        "engine": "kvserve",
        "load_s": load_s,
        "model": llm.engine.model_path,
        "config": _kvserve_config(args, llm),
        **cache_figures(all_ttfts, inp, cached),
        "per_turn": per_turn,
        "metrics": throughput_report(len(convs) * args.turns, inp, out_tokens, useful, elapsed),
    }
    print(
        f"kvserve: prefix cache served {cached} of {inp} prompt tokens over {args.turns} turns",
        file=sys.stderr,
    )
    del llm
    gc.collect()
    return run


def run_hf(args, reqs: list[BenchRequest], gguf: str) -> dict:
    from kvserve.bench.hf_peer import generate_batch, load_hf, peer_device, run_static

    t0 = time.perf_counter()
    device, dtype = peer_device(args)
    model = load_hf(gguf, threads(args), device, dtype)
    load_s = time.perf_counter() - t0
    generate_batch(model, [BenchRequest(reqs[0].prompt_ids[:8], 4)])  # warm-up
    r = run_static(model, reqs, args.hf_batch_size, progress=not args.no_progress)
    inp, useful = _counts(reqs)
    del model
    gc.collect()
    return {
        "engine": "hf",
        "load_s": load_s,
        "config": {
            "dtype": dtype,
            "device": device,
            "batch_size": args.hf_batch_size,
            "padding": "left",
            "batching": "static",
        },
        "metrics": throughput_report(len(reqs), inp, r["generated_tokens"], useful, r["elapsed"]),
    }


def llamacpp_config(args) -> dict:
    if args.llamacpp_bin:
        from kvserve.bench.servers import llamacpp_build

        return {
            "server": "llama-server",
            "build": llamacpp_build(args.llamacpp_bin),
            "slots": args.llamacpp_slots,
            "ctx_per_slot": args.llamacpp_ctx,
        }
    return {
        "server": "llama-cpp-python",
        "slots": 1,
        "ctx": args.llamacpp_ctx,
        "note": "llama-cpp-python's server runs one request at a time",
    }


def run_llamacpp(args, reqs: list[BenchRequest], gguf: str) -> dict:
    import shlex

    from kvserve.bench.loadgen import run_load
    from kvserve.bench.servers import llamacpp_request_kwargs, llamacpp_server

    server = llamacpp_server(
        gguf,
        threads(args),
        args.llamacpp_slots,
        args.llamacpp_ctx,
        args.llamacpp_bin,
        shlex.split(args.llamacpp_args),
    )
    warm = [BenchRequest(reqs[0].prompt_ids[:8], 4)]
    with server as url:
        asyncio.run(
            run_load(
                url,
                warm,
                "default",
                progress=False,
                **llamacpp_request_kwargs(gguf, args.llamacpp_bin, warm),
            )
        )
        timings, elapsed = asyncio.run(
            run_load(
                url,
                reqs,
                "default",
                progress=not args.no_progress,
                **llamacpp_request_kwargs(gguf, args.llamacpp_bin, reqs),
            )
        )
    return served_run("llamacpp", llamacpp_config(args), reqs, timings, elapsed)


def served_run(engine: str, config: dict, reqs: list[BenchRequest], timings, elapsed) -> dict:
    """The run of a server peer from its requests' timings; any failed request fails the run."""
    failed = [t for t in timings if not t.ok]
    if failed:
        raise RuntimeError(f"{engine}: {len(failed)} requests failed, first: {failed[0].error}")
    inp, _ = _counts(reqs)
    useful = sum(min(t.output_tokens, r.max_tokens) for t, r in zip(timings, reqs))
    return {
        "engine": engine,
        "config": config,
        "metrics": throughput_report(
            len(reqs), inp, sum(t.output_tokens for t in timings), useful, elapsed
        ),
    }


def run_vllm(args, reqs: list[BenchRequest], gguf: str) -> dict:
    from kvserve.bench.vllm_peer import run_vllm as vllm_offline
    from kvserve.bench.vllm_peer import vllm_python

    r = vllm_offline(
        reqs,
        gguf,
        vllm_python(args.vllm_python),
        threads(args),
        args.max_num_seqs,
        args.vllm_kv_cache_gib,
    )
    inp, _ = _counts(reqs)
    useful = sum(min(n, q.max_tokens) for n, q in zip(r["output_tokens"], reqs))
    return {
        "engine": "vllm",
        "load_s": r["load_s"],
        "config": {
            "version": r["version"],
            "dtype": "float32 (a copy of the GGUF, dequantized)",
            "max_num_seqs": args.max_num_seqs,
            "threads": threads(args),
        },
        "metrics": throughput_report(
            len(reqs), inp, sum(r["output_tokens"]), useful, r["elapsed_s"]
        ),
    }


def run_server(args, reqs: list[BenchRequest], gguf: str) -> dict:
    """kvserve's own server, started here with this command's engine flags, sent the same
    requests all at once and streamed: what the HTTP server costs over the offline run."""
    from kvserve.bench.loadgen import run_load, served_model
    from kvserve.bench.servers import kvserve_server

    flags = list(args.engine_flags)
    if not any(f.split("=")[0] == "--threads" for f in flags):  # serve's default keeps a core
        flags += ["--threads", str(threads(args))]
    warm = [BenchRequest(reqs[0].prompt_ids[:8], 4)]
    with kvserve_server(None, flags) as url:
        model = served_model(url)
        asyncio.run(run_load(url, warm, model, progress=False))
        timings, elapsed = asyncio.run(run_load(url, reqs, model, progress=not args.no_progress))
    return served_run("server", {"server_args": flags, "streamed": True}, reqs, timings, elapsed)


PEERS = {"hf": run_hf, "llamacpp": run_llamacpp, "vllm": run_vllm, "server": run_server}


def _pct(rate: float | None) -> str:
    return "-" if rate is None else f"{rate * 100:.1f}%"


def print_table(runs: list[dict]) -> None:
    base = next((r for r in runs if r["engine"] == "kvserve"), None)
    rows = []
    for r in runs:
        m = r["metrics"]
        rows.append(
            [
                r["engine"],
                m["requests_per_s"],
                m["input_tokens_per_s"],
                m["output_tokens_per_s"],
                m["useful_output_tokens_per_s"],
                m["elapsed_s"],
                r.get("ttft_median_s"),
                r.get("ttft_mean_s"),
                _pct(r.get("hit_rate")),
                common.ratio(
                    base["metrics"]["useful_output_tokens_per_s"], m["useful_output_tokens_per_s"]
                )
                if base
                else None,
            ]
        )
    print(
        common.table(
            [
                "engine",
                "req/s",
                "in tok/s",
                "out tok/s",
                "useful tok/s",
                "wall s",
                "TTFT p50 s",
                "TTFT mean s",
                "hit rate",
                "kvserve x",
            ],
            rows,
        )
    )
    for r in runs:
        if r.get("per_turn"):
            print(
                common.table(
                    [
                        "turn",
                        "requests",
                        "prompt tok",
                        "cached tok",
                        "hit rate",
                        "TTFT p50 s",
                        "TTFT mean s",
                        "wall s",
                    ],
                    [
                        [
                            t["turn"],
                            t["requests"],
                            t["prompt_tokens"],
                            t["cached_prompt_tokens"],
                            _pct(t["hit_rate"]),
                            t["ttft_median_s"],
                            t["ttft_mean_s"],
                            t["elapsed_s"],
                        ]
                        for t in r["per_turn"]
                    ],
                )
            )


def main_multiturn(args, argv: list[str]) -> int:
    if args.peer or args.only_peers:
        return common.die(
            "--dataset multiturn runs kvserve only: each round's prompts hold the answers kvserve "
            "generated in the rounds before, so a peer would not get the same token ids "
            "(drop --peer / --only-peers)"
        )
    if args.turns < 1:
        return common.die("--turns must be >= 1")
    if args.repeat != 1:
        return common.die(
            "--repeat is for workloads whose every round is the same: a multiturn round's prompts "
            "hold kvserve's own answers (drop --repeat)"
        )
    output_len = multiturn_output_len(args)
    convs = load_conversations(args)
    inp, asked = multiturn_asked(convs, output_len)
    print(
        f"workload multiturn: {len(convs)} conversations x {args.turns} turns, "
        f"system prompt {args.prefix_len}, question {args.question_len}, answer {output_len} "
        f"tokens; {inp} prompt tokens over all turns, {asked} output tokens asked",
        file=sys.stderr,
    )
    result = common.new_result("throughput", argv, args)
    result["workload"] = {
        "dataset": MULTITURN,
        "num_requests": len(convs) * args.turns,
        "prompt_tokens": inp,
        "max_tokens_total": asked,
        "conversations": len(convs),
        "turns": args.turns,
        "system_len": args.prefix_len,
        "question_len": args.question_len,
        "output_len": output_len,
    }
    result["runs"].append(run_multiturn(args, convs, output_len))
    print_table(result["runs"])
    common.save_result(result, args.output, args.save, f"throughput-{MULTITURN}")
    return 0


def main(args, argv: list[str]) -> int:
    from kvserve.config import engine_flags

    if args.dataset == MULTITURN:
        return main_multiturn(args, argv)
    msg = check_peers(args)
    if msg:
        return common.die(msg)
    if not 1 <= args.repeat <= MAX_REPEAT:
        return common.die(f"--repeat must be between 1 and {MAX_REPEAT}, got {args.repeat}")
    gguf = common.model_path(args.model)
    encode = None
    if args.dataset == "sharegpt":
        from kvserve.bench.tokenize import encoder

        encode = encoder(gguf)
    reqs = load_requests(args, gguf, encode)
    args.engine_flags = engine_flags(argv)  # what --peer server starts the server with
    inp, useful = _counts(reqs)
    print(
        f"workload {args.dataset}: {len(reqs)} requests, {inp} prompt tokens, "
        f"{useful} output tokens asked",
        file=sys.stderr,
    )
    result = common.new_result("throughput", argv, args)
    result["workload"] = {
        "dataset": args.dataset,
        "num_requests": len(reqs),
        "prompt_tokens": inp,
        "max_tokens_total": useful,
    }
    rounds = []
    for i in range(args.repeat):
        if args.repeat > 1:
            print(f"round {i + 1} of {args.repeat}", file=sys.stderr)
        rnd = [run_kvserve(args, reqs)] if not args.only_peers else []
        rnd += [PEERS[peer](args, reqs, gguf) for peer in args.peer]
        rounds.append(rnd)
    result["runs"] = median_runs(rounds)
    print_table(result["runs"])
    if args.repeat > 1:
        result["round_ratios"] = round_ratios(rounds)
        for peer, ratios in result["round_ratios"].items():
            print(f"kvserve / {peer}, round by round: " + ", ".join(f"x{r:.2f}" for r in ratios))
    common.save_result(result, args.output, args.save, f"throughput-{args.dataset}")
    return 0
