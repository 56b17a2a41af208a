"""`kvserve bench latency`: one request at a time, prompt length P, output length O (or
--workload w1).

Each repeat measures the prefill time (a max_tokens=1 request, end to end), then a full request:
its TTFT and its decode tokens/s = (O - 1) / (last token - first token). Figures are the median
of --repeat runs with min..max. kvserve runs offline through kvserve.LLM (or, with --base-url,
through a running server); prefix caching is turned off so every repeat recomputes the prompt.
Peers: hf (transformers generate, TTFT = prefill time), llamacpp (its server, streamed).
Each engine's run records the bytes a decode step reads (weights, and the KV of the mean
context) and the result the machine's read bandwidth (`bench roofline`'s probe, measured first),
so the report gives each engine's MBU: decode tok/s x bytes per step / read bandwidth.

With --lora-mix N (and --enable-lora --lora-modules naming at least N adapters) each repeat
sends N + 1 requests together instead of one: first all on the base model, then the base and the
first N adapters round-robin, one request each, so every decode step holds N adapters beside the
base. The two batches are reported as two rows (kvserve, kvserve+lora) and their decode step
times (per request, (last token - first token) / (O - 1), the median over the batch) compared.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import shlex
import statistics
import sys
import time

from kvserve.bench import common
from kvserve.bench.datasets import BenchRequest, gguf_vocab_size, standard_requests
from kvserve.bench.throughput import (
    add_output_args,
    add_peer_args,
    check_peers,
    llamacpp_config,
    threads,
)

FIGURES = ("prefill_s", "ttft_s", "decode_tok_s", "e2e_s", "e2e_tok_s")


def add_args(p) -> None:
    from kvserve.config import add_engine_args

    g = p.add_argument_group("workload")
    g.add_argument(
        "--input-len", type=int, default=128, help="prompt tokens P (default: %(default)s)"
    )
    g.add_argument(
        "--output-len", type=int, default=128, help="output tokens O (default: %(default)s)"
    )
    g.add_argument(
        "--workload", choices=["w1"], default=None, help="the standard W1 request instead of P/O"
    )
    g.add_argument(
        "--dataset-path",
        default=None,
        help="w1-w2.json (default: the copy in the package, kvserve/bench/data/w1-w2.json)",
    )
    g.add_argument("--repeat", type=int, default=3, help="timed repeats (default: %(default)s)")
    g.add_argument(
        "--base-url", default=None, help="measure kvserve through this running server instead"
    )
    g.add_argument(
        "--lora-mix",
        type=int,
        default=0,
        metavar="N",
        help="send N + 1 requests at once, round-robin over the base and the first N of "
        "--lora-modules, against the same batch on the base alone (needs --enable-lora; "
        "default: %(default)s, one request on the base)",
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get("KVSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="bearer key for --base-url (default: $KVSERVE_API_KEY or $OPENAI_API_KEY)",
    )
    add_engine_args(p)
    add_peer_args(p, "measure")
    add_output_args(p)


def the_request(args, gguf: str) -> BenchRequest:
    if args.workload:
        return standard_requests(args.workload, args.dataset_path, gguf)[0]
    vocab = gguf_vocab_size(gguf)
    rng = random.Random(args.seed)
    return BenchRequest(
        [rng.randrange(vocab // 100, vocab) for _ in range(args.input_len)], args.output_len
    )


def summarize_runs(samples: list[dict]) -> dict:
    return {k: summarize_list([s[k] for s in samples]) for k in FIGURES}


def summarize_list(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def engine_config(llm) -> dict:
    """What a kvserve run records of the engine it measured."""
    return {
        "dtype": llm.engine.config.model.dtype,
        "device": llm.engine.config.device,
        "quantization": llm.engine.quantization,
        "steps": llm.engine.step_path,
    }


def mean_context(req: BenchRequest) -> float:
    """The mean number of context tokens a decode step of `req` attends over."""
    return len(req.prompt_ids) + req.max_tokens / 2


def kvserve_step_bytes(llm, req: BenchRequest) -> int:
    """Bytes one batch-1 decode step of kvserve reads: the weights as the step holds them (packed
    blocks, the head, not the embedding table) and the KV of the mean context."""
    from kvserve.bench.roofline import model_facts

    f = model_facts(llm)
    return int(f["weight_bytes_per_step"] + f["kv_bytes_per_token"] * mean_context(req))


def gguf_step_bytes(gguf: str, req: BenchRequest) -> int | None:
    """Bytes one batch-1 decode step of llama.cpp reads from a GGUF file: every tensor but the
    token embedding (gathered a row at a time) unless it is also the output matrix (tied), and
    its float16 KV cache of the mean context. None for a file the reader cannot take."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(gguf)
    except Exception:  # noqa: BLE001 - a peer's file kvserve may not read; MBU is then left out
        return None
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    weights = sum(sizes.values())
    if "output.weight" in sizes:
        weights -= sizes.get("token_embd.weight", 0)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def meta(key: str) -> int | None:
        field = reader.fields.get(f"{arch}.{key}")
        return None if field is None else int(field.parts[-1][0])

    layers, heads, kv_heads = meta("block_count"), meta("attention.head_count"), None
    kv_heads = meta("attention.head_count_kv") or heads
    width = meta("embedding_length")
    head_dim = meta("attention.key_length") or (width // heads if width and heads else None)
    if not (layers and kv_heads and head_dim):
        return weights
    return int(weights + layers * kv_heads * head_dim * 2 * 2 * mean_context(req))


def _sample(prefill: float, ttft: float, decode_time: float, e2e: float, out_tokens: int) -> dict:
    return {
        "prefill_s": prefill,
        "ttft_s": ttft,
        "decode_tok_s": (out_tokens - 1) / decode_time,
        "e2e_s": e2e,
        "e2e_tok_s": out_tokens / e2e,
        "output_tokens": out_tokens,
    }


def lora_mix_names(args) -> list[str] | str:
    """The adapters --lora-mix sends requests to (the first N of --lora-modules), or the reason
    the flags do not allow it."""
    from kvserve.config import engine_config_from_args

    n = args.lora_mix
    if n < 0:
        return f"--lora-mix must be >= 0, got {n}"
    if n == 0:
        return []
    if args.base_url:
        return "--lora-mix measures the offline engine: drop --base-url"
    try:
        config = engine_config_from_args(args)
    except ValueError as e:
        return str(e)
    names = list(config.lora_modules or {})
    if not config.enable_lora or len(names) < n:
        return (
            f"--lora-mix {n} needs --enable-lora and at least {n} adapters in --lora-modules "
            f"(got {len(names)})"
        )
    return names[:n]


def run_kvserve(args, req: BenchRequest) -> dict | list[dict]:
    from kvserve import LLM, SamplingParams
    from kvserve.config import engine_config_from_args

    args.no_prefix_caching = True
    llm = LLM(config=engine_config_from_args(args))
    print(llm.engine.describe(), file=sys.stderr)
    if args.lora_mix:
        runs = run_lora_mix(llm, args, req)
        llm = None
        gc.collect()
        return runs
    prompt = [{"prompt_token_ids": req.prompt_ids}]

    def gen(n: int):
        t0 = time.perf_counter()
        out = llm.generate(
            prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False
        )[0]
        return out, time.perf_counter() - t0

    gen(4)  # warm-up
    samples = []
    for _ in range(args.repeat):
        _, prefill = gen(1)
        out, e2e = gen(req.max_tokens)
        m = out.metrics
        samples.append(
            _sample(
                prefill,
                m.first_token_time - m.arrival_time,
                m.last_token_time - m.first_token_time,
                e2e,
                len(out.outputs[0].token_ids),
            )
        )
    config = engine_config(llm)
    config["bytes_per_step"] = kvserve_step_bytes(llm, req)
    llm = None  # free the model before the peer runs
    gc.collect()
    return {
        "engine": "kvserve",
        "mode": "offline",
        "config": config,
        "samples": samples,
        "summary": summarize_runs(samples),
    }


def run_lora_mix(llm, args, req: BenchRequest) -> list[dict]:
    """Per repeat, N + 1 requests on the base, then the same batch spread over the base and N
    adapters: two runs (kvserve, kvserve+lora) whose figures are per request (medians over the
    batch) and whose decode_step_s are compared by print_lora_mix."""
    from kvserve import SamplingParams

    names = lora_mix_names(args)
    mixes = {"kvserve": [None] * (len(names) + 1), "kvserve+lora": [None, *names]}
    prompts = [{"prompt_token_ids": req.prompt_ids}] * (len(names) + 1)

    def gen(loras, n: int):
        t0 = time.perf_counter()
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=list(loras))
        return outs, time.perf_counter() - t0

    for loras in mixes.values():
        gen(loras, 4)  # warm-up
    samples: dict[str, list[dict]] = {k: [] for k in mixes}
    for _ in range(args.repeat):
        for label, loras in mixes.items():
            _, prefill = gen(loras, 1)
            outs, e2e = gen(loras, req.max_tokens)
            ms = [o.metrics for o in outs]
            decode = statistics.median(m.last_token_time - m.first_token_time for m in ms)
            ttft = statistics.median(m.first_token_time - m.arrival_time for m in ms)
            n_out = len(outs[0].outputs[0].token_ids)
            sample = _sample(prefill, ttft, decode, e2e, n_out)
            sample["decode_step_s"] = decode / (n_out - 1)
            samples[label].append(sample)
    config = {**engine_config(llm), "batch": len(names) + 1}
    return [
        {
            "engine": label,
            "mode": "offline",
            "config": {**config, "loras": [n or "base" for n in loras]},
            "samples": samples[label],
            "summary": {
                **summarize_runs(samples[label]),
                "decode_step_s": summarize_list([s["decode_step_s"] for s in samples[label]]),
            },
        }
        for label, loras in mixes.items()
    ]


def print_lora_mix(runs: list[dict]) -> None:
    """The decode step of the batch with adapters against the same batch on the base."""
    by = {r["engine"]: r for r in runs}
    if "kvserve+lora" not in by:
        return
    base = by["kvserve"]["summary"]["decode_step_s"]
    mixed = by["kvserve+lora"]["summary"]["decode_step_s"]
    adapters = len([n for n in by["kvserve+lora"]["config"]["loras"] if n != "base"])
    print(
        f"decode step, batch of {by['kvserve']['config']['batch']}: base "
        f"{base['median'] * 1e3:.2f} ms ({base['min'] * 1e3:.2f}-{base['max'] * 1e3:.2f}), "
        f"with {adapters} adapters {mixed['median'] * 1e3:.2f} ms "
        f"({mixed['min'] * 1e3:.2f}-{mixed['max'] * 1e3:.2f}): "
        f"x{common.ratio(mixed['median'], base['median']):.2f}"
    )


def run_hf(args, req: BenchRequest, gguf: str) -> dict:
    from kvserve.bench.hf_peer import load_hf, peer_device, time_single

    device, dtype = peer_device(args)
    model = load_hf(gguf, threads(args), device, dtype)
    time_single(model, BenchRequest(req.prompt_ids, 4), 4)  # warm-up
    samples = []
    for _ in range(args.repeat):
        prefill = time_single(model, req, 1)
        e2e = time_single(model, req, req.max_tokens)
        samples.append(_sample(prefill, prefill, e2e - prefill, e2e, req.max_tokens))
    del model
    gc.collect()
    return {
        "engine": "hf",
        "mode": "offline",
        "config": {"dtype": dtype, "device": device},
        "samples": samples,
        "summary": summarize_runs(samples),
    }


def server_samples(
    url: str, req: BenchRequest, repeat: int, kwargs: dict, flush: bool, api_key: str | None = None
) -> list[dict]:
    """Streamed single requests. `flush` sends a short unrelated prompt before each timed one, so a
    server that reuses its last context's common prefix (llama-cpp-python) recomputes the prompt."""
    from kvserve.bench.loadgen import run_load, served_model
    from kvserve.bench.serve import reset_prefix_cache

    model = served_model(url, api_key)
    kwargs = {**kwargs, "api_key": api_key}

    def one(r: BenchRequest):
        if flush:
            asyncio.run(
                run_load(
                    url,
                    [BenchRequest([], 1)],
                    model,
                    progress=False,
                    **{**kwargs, "prompt_texts": ["Hello"]},
                )
            )
        reset_prefix_cache(url, api_key)
        (t,), _ = asyncio.run(run_load(url, [r], model, progress=False, **kwargs))
        if not t.ok:
            raise RuntimeError(f"request failed: {t.error}")
        return t

    one(BenchRequest(req.prompt_ids, 4))  # warm-up
    samples = []
    for _ in range(repeat):
        prefill = one(BenchRequest(req.prompt_ids, 1)).e2e
        t = one(req)
        samples.append(_sample(prefill, t.ttft, t.e2e - t.ttft, t.e2e, t.output_tokens))
    return samples


def run_server_kvserve(args, req: BenchRequest) -> dict:
    samples = server_samples(args.base_url, req, args.repeat, {}, flush=False, api_key=args.api_key)
    return {
        "engine": "kvserve",
        "mode": f"server {args.base_url}",
        "samples": samples,
        "summary": summarize_runs(samples),
    }


def run_llamacpp(args, req: BenchRequest, gguf: str) -> dict:
    from kvserve.bench.servers import llamacpp_request_kwargs, llamacpp_server

    server = llamacpp_server(
        gguf,
        threads(args),
        1,
        args.llamacpp_ctx,
        args.llamacpp_bin,
        shlex.split(args.llamacpp_args),
    )
    kw = llamacpp_request_kwargs(gguf, args.llamacpp_bin, [req])
    kw["extra"] = {"cache_prompt": False}
    with server as url:
        samples = server_samples(url, req, args.repeat, kw, flush="prompt_texts" in kw)
    cfg = llamacpp_config(args)
    cfg["slots"] = 1
    cfg["bytes_per_step"] = gguf_step_bytes(gguf, req)
    return {
        "engine": "llamacpp",
        "mode": "server",
        "config": cfg,
        "samples": samples,
        "summary": summarize_runs(samples),
    }


def print_table(runs: list[dict]) -> None:
    rows = []
    for r in runs:
        s = r["summary"]
        rows.append(
            [r["engine"]]
            + [
                f"{s[k]['median']:.3f} ({s[k]['min']:.3f}-{s[k]['max']:.3f})"
                if k.endswith("_s")
                else f"{s[k]['median']:.1f} ({s[k]['min']:.1f}-{s[k]['max']:.1f})"
                for k in FIGURES
            ]
        )
    print(
        common.table(["engine", "prefill s", "TTFT s", "decode tok/s", "e2e s", "e2e tok/s"], rows)
    )
    base = next((r for r in runs if r["engine"] == "kvserve"), None)
    if base:
        for r in runs:
            if r is not base:
                b, p = base["summary"], r["summary"]
                decode = common.ratio(b["decode_tok_s"]["median"], p["decode_tok_s"]["median"])
                e2e = common.ratio(b["e2e_tok_s"]["median"], p["e2e_tok_s"]["median"])
                prefill = common.ratio(p["prefill_s"]["median"], b["prefill_s"]["median"])
                print(
                    f"kvserve / {r['engine']}: decode tok/s x{decode:.2f}, "
                    f"e2e tok/s x{e2e:.2f}, prefill faster x{prefill:.2f}"
                )


def main(args, argv: list[str]) -> int:
    msg = check_peers(args)
    if msg:
        return common.die(msg)
    names = lora_mix_names(args)
    if isinstance(names, str):
        return common.die(names)
    gguf = common.model_path(args.model)
    req = the_request(args, gguf)
    print(
        f"latency: prompt {len(req.prompt_ids)} tokens, output {req.max_tokens} tokens, "
        f"{args.repeat} repeats",
        file=sys.stderr,
    )
    result = common.new_result("latency", argv, args)
    result["workload"] = {
        "name": args.workload or f"P{len(req.prompt_ids)}-O{req.max_tokens}",
        "prompt_tokens": len(req.prompt_ids),
        "output_tokens": req.max_tokens,
    }
    if names:
        result["workload"]["lora_mix"] = names
    from kvserve.bench.roofline import memory_bandwidth

    result["read_gbs"] = memory_bandwidth(2.0)["read_gbs"]
    if not args.only_peers:
        run = run_server_kvserve(args, req) if args.base_url else run_kvserve(args, req)
        result["runs"].extend(run if isinstance(run, list) else [run])
    for peer in args.peer:
        result["runs"].append(
            run_hf(args, req, gguf) if peer == "hf" else run_llamacpp(args, req, gguf)
        )
    print_table(result["runs"])
    print_lora_mix(result["runs"])
    common.save_result(result, args.output, args.save, f"latency-{result['workload']['name']}")
    return 0
