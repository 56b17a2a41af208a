"""How fast n-gram speculation can make a workload, against what one verified row costs.

Runs each `kvserve bench spec` workload's request once without speculation (greedy: the tokens
speculation must reproduce), then replays the engine's n-gram proposer and adaptive draft length
(kvserve/spec) over those tokens for a range of row costs: a step with k drafts costs
1 + share * k one-row steps, `share` being what `StepCostModel.row_share` measures on a machine
(its `bench spec` JSON records it as row_share_at_batch_1). Prints the speed-up over plain
decoding per workload and share, and with --png plots it.

    KVSERVE_ISA=avx2 python3 scripts/spec_row_cost.py --quantization gguf-a8 \\
        --png docs/spec-row-cost.png

`--workloads all` takes every prompt of kvserve/bench/data/spec-prompts.json: the bench's three and
a second set of edits, quotes and rewrites, for checking a draft rule beyond the prompts it was
tuned on (the geometric mean of each set is printed too).

The replay is exact for the tokens (greedy verification accepts a draft's longest prefix that
matches them); the time is the linear cost model, without the per-step work outside the model.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

from kvserve import LLM, SamplingParams
from kvserve.bench.spec import DEFAULT_SPEC, PROMPTS, workload_chats
from kvserve.config import SpeculativeConfig
from kvserve.spec.adaptive import AdaptiveDraftLength
from kvserve.spec.ngram import NgramIndex

WORKLOADS = ("copy-text", "edit-code", "rag-quote")


def replay(prompt: list[int], output: list[int], spec: SpeculativeConfig, share: float) -> dict:
    """Speculative decoding of `output` after `prompt` with drafts from the n-gram proposer and the
    adaptive length: steps, drafted and accepted tokens, and the time in one-row steps."""
    index = NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max)
    length = AdaptiveDraftLength(spec.num_speculative_tokens)
    pos, time, steps, drafted, accepted = 1, 0.0, 0, 0, 0  # output[0] comes with the prefill
    while pos < len(output):
        context = prompt + output[:pos]
        k = length.next_length(share)
        draft = index.propose(context, k) if k > 0 else []
        a = 0
        while a < len(draft) and pos + a < len(output) and draft[a] == output[pos + a]:
            a += 1
        if draft:
            length.record(len(draft), a)
        time += 1 + share * len(draft)
        steps, drafted, accepted, pos = steps + 1, drafted + len(draft), accepted + a, pos + a + 1
    return {
        "steps": steps,
        "drafted": drafted,
        "accepted": accepted,
        "speedup": (len(output) - 1) / time,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quantization", default=None)
    p.add_argument("--shares", default="0.1,0.15,0.2,0.25,0.3,0.35,0.4")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--png", default=None)
    p.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help="comma-separated names in spec-prompts.json, or all (default: %(default)s)",
    )
    args = p.parse_args()
    spec = SpeculativeConfig.parse(DEFAULT_SPEC)
    names = (
        list(json.loads(PROMPTS.read_text())["workloads"])
        if args.workloads == "all"
        else args.workloads.split(",")
    )
    chats = workload_chats(names)
    llm = LLM(
        enable_prefix_caching=False,
        **({"quantization": args.quantization} if args.quantization else {}),
    )
    shares = [float(s) for s in args.shares.split(",")]
    results = {}
    print(
        f"{'workload':>12} " + " ".join(f"{s:>7.2f}" for s in shares) + "   (speed-up at row share)"
    )
    for name in names:
        prompt = llm.chat_prompt(chats[name])
        out = llm.generate(
            [{"prompt_token_ids": prompt}],
            SamplingParams(temperature=0, max_tokens=args.max_tokens),
            use_tqdm=False,
        )[0]
        tokens = list(out.outputs[0].token_ids)
        results[name] = [replay(prompt, tokens, spec, s)["speedup"] for s in shares]
        print(f"{name:>12} " + " ".join(f"{x:>7.3f}" for x in results[name]))
    sets = {
        "bench's": [n for n in names if n in WORKLOADS],
        "others": [n for n in names if n not in WORKLOADS],
    }
    for label, members in sets.items():
        if len(members) > 1:
            means = [
                math.exp(statistics.fmean(math.log(results[n][i]) for n in members))
                for i in range(len(shares))
            ]
            print(f"{'gm ' + label:>12} " + " ".join(f"{x:>7.3f}" for x in means))
    if args.png:
        from kvserve.bench.common import pyplot

        plt = pyplot()

        fig, ax = plt.subplots(figsize=(6, 4))
        for name, ys in results.items():
            ax.plot(shares, ys, marker="o", label=name)
        ax.axhline(1.5, color="gray", linestyle="--", linewidth=1, label="1.5x target")
        ax.set_xlabel("cost of one verified row / cost of a one-row step (row share)")
        ax.set_ylabel("decode speed-up over plain")
        ax.set_title("n-gram speculation, replayed on the greedy outputs")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
        print(f"plot written to {args.png}")


if __name__ == "__main__":
    main()
