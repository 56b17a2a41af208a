"""A/B of two kernel source trees in one process: the engine's greedy requests run with the C
library built from a base tree and from this checkout, alternated run by run (the shared host's
drift hits both alike), prefix caching off. Prints each side's median seconds and whether the two
gave identical tokens. The base tree is any checkout's kvserve/ops/csrc, e.g.

    git archive 1bc4579 kvserve/ops/csrc | tar -x -C /tmp/base
    KVSERVE_ISA=avx2 python3 scripts/kernel_ab.py --base /tmp/base/kvserve/ops/csrc \\
        --workload w2 --rounds 4

A speculative workload of `kvserve bench spec` (copy-text, edit-code, rag-quote) runs its one
request with the bench's default n-gram speculation, to its end of sequence, and reports decode
time (first to last token):

    KVSERVE_ISA=avx2 python3 scripts/kernel_ab.py --base ... --workload edit-code \\
        --quantization gguf-a8 --rounds 6
    python3 scripts/kernel_ab.py --base ... --workload prefill --prompt-len 2048 --rounds 6
    python3 scripts/kernel_ab.py --base ... --model /tmp/1b-q4_k_m.gguf --workload w1 --rounds 6
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

from kvserve import LLM, SamplingParams
from kvserve.bench.datasets import standard_requests
from kvserve.bench.spec import DEFAULT_SPEC, workload_chats
from kvserve.ops import cpu_kernels


def kernel_libraries(base: str, isa: str) -> dict[str, ctypes.CDLL]:
    """{"base": the C library of `isa` built from the base tree's csrc, "new": from this
    checkout's}."""
    own, cc = cpu_kernels._CSRC, cpu_kernels._compiler()
    libs = {}
    try:
        for name, src in (("base", Path(base)), ("new", own)):
            cpu_kernels._CSRC = src
            libs[name] = ctypes.CDLL(str(cpu_kernels.build(cc, isa)))
            cpu_kernels._signatures(libs[name])
    finally:
        cpu_kernels._CSRC = own
    return libs


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base", required=True, help="the base tree's kvserve/ops/csrc directory")
    p.add_argument(
        "--workload",
        choices=["w1", "w2", "prefill", "copy-text", "edit-code", "rag-quote"],
        default="w2",
        help="prefill: one prompt of --prompt-len tokens and one output token (wall time)",
    )
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument(
        "--quantization", default=None, help="the engine's --quantization (default: its own)"
    )
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--model", default=None, help="a model path (default: the default model)")
    args = p.parse_args()
    isa = cpu_kernels.selected_isa()
    libs = kernel_libraries(args.base, isa)
    current = {"lib": libs["new"]}
    cpu_kernels.library = lambda isa=None: current["lib"]
    spec = args.workload not in ("w1", "w2", "prefill")
    llm = LLM(
        args.model,
        enable_prefix_caching=False,
        **({"quantization": args.quantization} if args.quantization else {}),
        **({"speculative_config": DEFAULT_SPEC} if spec else {}),
    )
    if spec:
        prompts = [
            {"prompt_token_ids": llm.chat_prompt(workload_chats([args.workload])[args.workload])}
        ]
        params = [SamplingParams(temperature=0, max_tokens=512)]
    elif args.workload == "prefill":
        prompts = [
            {"prompt_token_ids": [(i * 104729) % 48000 + 500 for i in range(args.prompt_len)]}
        ]
        params = [SamplingParams(temperature=0, max_tokens=1)]
    else:
        reqs = standard_requests(args.workload, None, llm.engine.model_path)
        prompts = [{"prompt_token_ids": r.prompt_ids} for r in reqs]
        params = [
            SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs
        ]
    llm.generate(
        prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    times: dict[str, list[float]] = {"base": [], "new": []}
    tokens = {}
    for r in range(args.rounds):
        for name in ("base", "new") if r % 2 == 0 else ("new", "base"):
            current["lib"] = libs[name]
            t0 = time.perf_counter()
            out = llm.generate(prompts, params, use_tqdm=False)
            m = out[0].metrics
            times[name].append(
                m.last_token_time - m.first_token_time if spec else time.perf_counter() - t0
            )
            tokens[name] = [list(o.outputs[0].token_ids) for o in out]
    for name, ts in times.items():
        n = sum(len(t) for t in tokens[name]) - (1 if spec else 0)  # spec: tokens after the first
        print(
            f"{name} ({isa}, {args.workload}): median {statistics.median(ts):.3f} s, {n} tokens, "
            f"{n / statistics.median(ts):.1f} tok/s;",
            " ".join(f"{t:.3f}" for t in ts),
        )
    print("identical tokens:", tokens["base"] == tokens["new"])


if __name__ == "__main__":
    main()
