"""`kvserve bench spec`: speculative decoding against plain decoding, side by side in one run.

Two engines in one process, the same model and flags, one with --speculative-config (default: the
n-gram proposer, up to 8 drafts from lookups of 6 down to 3 tokens; the other engine never
speculates). Per workload, a single greedy request (batch 1, prefix caching off) alternates
between them --repeat times; the figure is decode tokens/s (output tokens after the
first / time from the first token to the last), median of the repeats, and their ratio. A request
runs to its end of sequence, as the answer a user gets does, up to --output-len tokens;
`--ignore-eos` counts exactly --output-len tokens, past the end of the answer too (what the model
writes after its answer is a new, made-up conversation: no copy to draft from). w1 keeps its
standard definition whatever the flags: exactly its 128 tokens (kvserve/bench/data/w1-w2.json).
Each pair of runs must give the same tokens (greedy speculation is exact), else the command fails.
Acceptance (accepted / drafted tokens) and the mean accepted length (accepted drafts per
verification) come from the engine's spec_decode counters.

Workloads: the copy-heavy prompts in kvserve/bench/data/spec-prompts.json (repeat a notice, rename
a function in code, answer by quoting documents) and w1, the standard open chat request.

`--peer llamacpp --llamacpp-bin llama-server`: in the same command, llama.cpp's server on the same
GGUF and the same prompt token ids (1 slot, prompt cache off, greedy, --ignore-eos alike), started
once plain and once with --llamacpp-spec-args (default: its prompt-lookup mode, `--spec-type
ngram-simple`), each workload streamed --repeat times; decode tok/s as above, from the stream.
"""

from __future__ import annotations

import gc
import json
import shlex
import statistics
import sys
from pathlib import Path

from kvserve.bench import common
from kvserve.bench.datasets import standard_requests
from kvserve.bench.throughput import add_output_args, add_peer_args, threads

PROMPTS = Path(__file__).parent / "data" / "spec-prompts.json"
DEFAULT_SPEC = (
    '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 6, '
    '"prompt_lookup_min": 3}'
)
DEFAULT_LLAMACPP_SPEC = "--spec-type ngram-simple"


def add_args(p) -> None:
    from kvserve.config import add_engine_args

    g = p.add_argument_group("workload")
    g.add_argument(
        "--workloads",
        default="copy-text,edit-code,rag-quote,w1",
        help="comma-separated: names in spec-prompts.json and/or w1 (default: %(default)s)",
    )
    g.add_argument(
        "--output-len",
        type=int,
        default=512,
        help="most tokens per request; it stops at its end of sequence (default: %(default)s)",
    )
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate exactly --output-len tokens, past the end of the answer "
        "(default: stop there)",
    )
    g.add_argument(
        "--repeat",
        type=int,
        default=5,
        help="timed pairs of runs per workload (default: %(default)s)",
    )
    add_engine_args(p)
    add_peer_args(p, "run")
    p.add_argument(
        "--llamacpp-spec-args",
        default=DEFAULT_LLAMACPP_SPEC,
        help="llama-server flags of its speculative run (default: %(default)s)",
    )
    add_output_args(p)


def workload_chats(names: list[str]) -> dict[str, list[dict] | None]:
    """Each named workload's chat messages (None: w1, already token ids); ValueError names the
    unknown ones before any model is loaded."""
    chats = json.loads(PROMPTS.read_text())["workloads"]
    unknown = [n for n in names if n != "w1" and n not in chats]
    if unknown:
        raise ValueError(f"unknown workload(s) {unknown}: choose from {sorted(chats) + ['w1']}")
    return {n: None if n == "w1" else chats[n] for n in names}


def workloads(chats: dict[str, list[dict] | None], llm) -> dict[str, list[int]]:
    """Prompt token ids per workload: w1's from the standard file, the others through the chat
    template."""
    return {
        name: standard_requests("w1", None, llm.engine.model_path)[0].prompt_ids
        if msgs is None
        else llm.chat_prompt(msgs)
        for name, msgs in chats.items()
    }


def output_budget(name: str, args) -> tuple[int, bool]:
    """(max_tokens, ignore_eos) of a workload's request: w1's are the standard request's."""
    if name == "w1":
        return standard_requests("w1", None, None)[0].max_tokens, True
    return args.output_len, args.ignore_eos


def _decode_run(llm, ids: list[int], n: int, ignore_eos: bool = True) -> tuple[float, list[int]]:
    from kvserve import SamplingParams

    out = llm.generate(
        [{"prompt_token_ids": ids}],
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=ignore_eos),
        use_tqdm=False,
    )[0]
    m = out.metrics
    tokens = list(out.outputs[0].token_ids)
    return (len(tokens) - 1) / (m.last_token_time - m.first_token_time), tokens


def _counters(llm) -> dict:
    s = llm.engine.stats()
    return {
        k: s.get(f"spec_decode_{k}", 0)
        for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    }


def engine_configs(args, spec_json: str):
    """The plain and the speculative engine's configurations: the same flags, prefix caching off,
    speculation only in the second."""
    from dataclasses import replace

    from kvserve.config import engine_config_from_args

    args.no_prefix_caching = True
    args.speculative_config = spec_json
    spec = engine_config_from_args(args)
    return replace(spec, speculative=None), spec


def run(args, spec_json: str, chats: dict[str, list[dict] | None]) -> list[dict]:
    from kvserve import LLM

    plain_config, spec_config = engine_configs(args, spec_json)
    plain = LLM(config=plain_config)
    spec = LLM(config=spec_config)
    print(spec.engine.describe(), file=sys.stderr)
    rows = []
    prompts = workloads(chats, plain)
    for name, ids in prompts.items():
        _decode_run(plain, ids, 8), _decode_run(spec, ids, 8)  # warm-up
        before = _counters(spec)
        tp, ts = [], []
        n, ignore_eos = output_budget(name, args)
        for _ in range(args.repeat):
            a, tok_a = _decode_run(plain, ids, n, ignore_eos)
            b, tok_b = _decode_run(spec, ids, n, ignore_eos)
            if tok_a != tok_b:
                raise RuntimeError(f"{name}: speculative decoding changed the greedy tokens")
            tp.append(a)
            ts.append(b)
        after = _counters(spec)
        d = {k: after[k] - before[k] for k in after}
        rows.append(
            {
                "workload": name,
                "prompt_tokens": len(ids),
                "output_tokens": len(tok_a),
                "plain_decode_tok_s": statistics.median(tp),
                "spec_decode_tok_s": statistics.median(ts),
                "plain_samples": tp,
                "spec_samples": ts,
                "speedup": statistics.median(ts) / statistics.median(tp),
                "acceptance": d["num_accepted_tokens"] / d["num_draft_tokens"]
                if d["num_draft_tokens"]
                else None,
                "mean_accepted_length": d["num_accepted_tokens"] / d["num_drafts"]
                if d["num_drafts"]
                else None,
                **d,
            }
        )
        print(table_line(rows[-1]), file=sys.stderr)
    share = spec.engine.drafter.step_cost.row_share(1)
    config = {
        "steps": spec.engine.step_path,
        "speculative_config": json.loads(spec_json),
        "row_share_at_batch_1": share,
        "max_output_tokens": args.output_len,
        "ignore_eos": args.ignore_eos,
    }
    del plain, spec
    gc.collect()
    return [
        {
            "engine": "kvserve",
            "mode": "offline",
            "config": config,
            "workloads": rows,
            "prompt_ids": prompts,
        }
    ]


def run_llamacpp(args, prompts: dict[str, list[int]], gguf: str) -> dict:
    """llama-server plain, then with --llamacpp-spec-args, on the same prompt token ids."""
    from kvserve.bench.datasets import BenchRequest
    from kvserve.bench.latency import server_samples
    from kvserve.bench.servers import llamacpp_server

    tok_s: dict[str, dict[str, list[float]]] = {name: {} for name in prompts}
    for label, extra in (("plain", []), ("spec", shlex.split(args.llamacpp_spec_args))):
        server = llamacpp_server(
            gguf,
            threads(args),
            1,
            args.llamacpp_ctx,
            args.llamacpp_bin,
            shlex.split(args.llamacpp_args) + extra,
        )
        with server as url:
            for name, ids in prompts.items():
                n, ignore_eos = output_budget(name, args)
                samples = server_samples(
                    url,
                    BenchRequest(ids, n),
                    args.repeat,
                    {"extra": {"cache_prompt": False, "ignore_eos": ignore_eos}},
                    flush=False,
                )
                tok_s[name][label] = [s["decode_tok_s"] for s in samples]
                tok_s[name]["output_tokens"] = [s["output_tokens"] for s in samples]
                print(
                    f"llama.cpp {label} {name}: "
                    f"decode {statistics.median(tok_s[name][label]):.1f} tok/s",
                    file=sys.stderr,
                )
    rows = [
        {
            "workload": name,
            "prompt_tokens": len(ids),
            "output_tokens": statistics.median(tok_s[name]["output_tokens"]),
            "plain_decode_tok_s": statistics.median(tok_s[name]["plain"]),
            "spec_decode_tok_s": statistics.median(tok_s[name]["spec"]),
            "plain_samples": tok_s[name]["plain"],
            "spec_samples": tok_s[name]["spec"],
            "speedup": statistics.median(tok_s[name]["spec"])
            / statistics.median(tok_s[name]["plain"]),
            "acceptance": None,
            "mean_accepted_length": None,
        }
        for name, ids in prompts.items()
    ]
    return {
        "engine": "llamacpp",
        "mode": "server",
        "config": {
            "binary": args.llamacpp_bin,
            "threads": threads(args),
            "spec_args": args.llamacpp_spec_args,
            "extra_args": args.llamacpp_args,
        },
        "workloads": rows,
    }


def peer_table(runs: list[dict]) -> list[list]:
    """Per workload: speculative decode tok/s of kvserve and llama.cpp, each engine's speed-up, and
    the ratio of the two speculative figures."""
    ours, peer = runs[0]["workloads"], runs[1]["workloads"]
    return [
        [
            a["workload"],
            f"{a['spec_decode_tok_s']:.1f}",
            f"x{a['speedup']:.2f}",
            f"{b['spec_decode_tok_s']:.1f}",
            f"x{b['speedup']:.2f}",
            f"x{a['spec_decode_tok_s'] / b['spec_decode_tok_s']:.2f}",
        ]
        for a, b in zip(ours, peer)
    ]


PEER_HEADERS = [
    "workload",
    "kvserve speculative tok/s",
    "kvserve speed-up",
    "llama.cpp speculative tok/s",
    "llama.cpp speed-up",
    "kvserve / llama.cpp",
]


def table_rows(rows: list[dict]) -> list[list]:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    return [
        [
            r["workload"],
            r["prompt_tokens"],
            r["output_tokens"],
            f(r["plain_decode_tok_s"], ".1f"),
            f(r["spec_decode_tok_s"], ".1f"),
            f"x{r['speedup']:.2f}",
            "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%",
            f(r["mean_accepted_length"], ".2f"),
        ]
        for r in rows
    ]


TABLE_HEADERS = [
    "workload",
    "prompt tokens",
    "output tokens",
    "plain decode tok/s",
    "speculative decode tok/s",
    "speed-up",
    "acceptance",
    "mean accepted / verification",
]


def table_line(r: dict) -> str:
    return "  ".join(f"{h}: {v}" for h, v in zip(TABLE_HEADERS, table_rows([r])[0]))


def main(args, argv: list[str]) -> int:
    from kvserve.config import SpeculativeConfig

    spec_json = args.speculative_config or DEFAULT_SPEC
    try:
        method = SpeculativeConfig.parse(spec_json).method
        chats = workload_chats(args.workloads.split(","))
    except ValueError as e:
        return common.die(str(e))
    if set(args.peer) - {"llamacpp"}:
        return common.die(
            "bench spec compares with llama.cpp only: --peer llamacpp --llamacpp-bin PATH"
        )
    from kvserve.bench.servers import llamacpp_available

    if args.peer and not (args.llamacpp_bin and llamacpp_available(args.llamacpp_bin)):
        return common.die(
            "--peer llamacpp needs --llamacpp-bin PATH: llama.cpp's own llama-server "
            "(llama-cpp-python's server has no speculative modes)"
        )
    result = common.new_result("spec", argv, args)
    result["runs"] = run(args, spec_json, chats)
    from kvserve.bench.report import md_table

    print(md_table(TABLE_HEADERS, table_rows(result["runs"][0]["workloads"])))
    if args.peer:
        result["runs"].append(
            run_llamacpp(args, result["runs"][0]["prompt_ids"], common.model_path(args.model))
        )
        print(md_table(PEER_HEADERS, peer_table(result["runs"])))
    common.save_result(result, args.output, args.save, f"spec-{method}")
    return 0
