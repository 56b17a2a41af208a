"""How often the default model's first L layers predict its next token, for every L, and what a
draft from them costs: the figure behind the self-speculative proposer (docs/benchmarks.md,
docs/self-speculative-acceptance.png).

For each workload of `kvserve bench spec` (the copy-heavy prompts and W1), the full model decodes
greedily; at every position the self-speculative draft of L layers proposes one token from the
same context (kvserve.spec.draft_model, its cache following the context), and the acceptance is
the share of positions where it equals the full model's token (at temperature 0 the verifier
accepts exactly those). The cost is a one-token draft round timed against a one-token decode step
of the full model, both through the C layer stack, median of 50.

A one-token draft pays when acceptance > (draft round + verified row) / step; the verified row's
share is the engine's fitted row_share, printed by `kvserve bench spec`.

    python3 scripts/self_spec_acceptance.py [--tokens 64] \\
        [--png docs/self-speculative-acceptance.png]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from tqdm import tqdm

from kvserve import LLM, SamplingParams
from kvserve.bench.spec import workload_chats, workloads
from kvserve.config import EngineConfig
from kvserve.core.scheduler import ScheduledChunk, SchedulerOutput
from kvserve.core.sequence import Sequence
from kvserve.model.early_exit import first_layers
from kvserve.model.loader import LoadedModel
from kvserve.spec.draft_model import DraftModelProposer


def one_token_seconds(
    runner, token: int, request: Sequence, block_table: list[int], pos: int, n: int = 50
) -> float:
    chunk = ScheduledChunk(
        seq=request, token_ids=[token], start_pos=pos, block_tables=[block_table], sample=True
    )
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        runner.greedy_tokens(SchedulerOutput([chunk], [], [], 1))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--layers", default="2,4,6,8,10,12,14,16,18,20,22,24,26,28,29")
    p.add_argument("--png", default=None)
    args = p.parse_args(argv)
    llm = LLM(num_threads=1, max_model_len=2048)
    e = llm.engine
    target = LoadedModel(
        model=e.runner.model, arch=e.arch, tokenizer=e.tokenizer, path=e.model_path
    )
    prompts = workloads(workload_chats(["copy-text", "edit-code", "rag-quote", "w1"]), llm)
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    outputs = {
        name: llm.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)[0]
        .outputs[0]
        .token_ids
        for name, ids in prompts.items()
    }
    cfg = EngineConfig(num_threads=1)
    layers = [int(x) for x in args.layers.split(",")]
    acceptance: dict[str, list[float]] = {name: [] for name in prompts}
    cost: list[float] = []
    full = DraftModelProposer(target, cfg, 256)
    probe = Sequence(
        "probe", prompts["w1"][:-1], greedy
    )  # its last token at a decode position (GEMV)
    probe.append_output_token(prompts["w1"][-1])
    full.propose_batch([(probe, 1)])
    table = [b.block_id for b in full._seqs["probe"].blocks]
    step = one_token_seconds(full.runner, prompts["w1"][-1], probe, table, len(prompts["w1"]) - 1)
    for n in tqdm(layers, desc="draft layers"):
        draft = DraftModelProposer(first_layers(target, n), cfg, 256)
        for name, ids in prompts.items():
            out = outputs[name]
            req = Sequence(f"{name}-{n}", ids, greedy)
            hits = 0
            for tok in out:
                hits += draft.propose_batch([(req, 1)])[0] == [tok]
                req.append_output_token(tok)
            acceptance[name].append(hits / len(out))
            draft.free(req.seq_id)
        draft.propose_batch([(probe, 1)])
        cost.append(
            one_token_seconds(
                draft.runner,
                prompts["w1"][-1],
                probe,
                [b.block_id for b in draft._seqs["probe"].blocks],
                len(prompts["w1"]) - 1,
            )
            / step
        )
    print(
        f"full decode step: {step * 1e3:.2f} ms "
        f"({e.runner.layer_stack.isa if e.runner.layer_stack else 'torch'})"
    )
    print("| draft layers | " + " | ".join(prompts) + " | draft round / step |")
    print("|---" * (len(prompts) + 2) + "|")
    for i, n in enumerate(layers):
        print(
            f"| {n} | "
            + " | ".join(f"{acceptance[name][i]:.0%}" for name in prompts)
            + f" | {cost[i]:.2f} |"
        )
    if args.png:
        from kvserve.bench.common import pyplot

        plt = pyplot()

        fig, ax = plt.subplots(figsize=(7, 4.2))
        for name in prompts:
            ax.plot(
                layers, [100 * a for a in acceptance[name]], marker="o", label=f"acceptance, {name}"
            )
        ax.plot(layers, [100 * c for c in cost], "k--", label="draft round / decode step")
        ax.set_xlabel(f"draft layers (of {e.arch.num_layers})")
        ax.set_ylabel("%")
        ax.set_ylim(0, 105)
        ax.set_title("Self-speculative draft of SmolLM2-135M: acceptance at temperature 0 vs cost")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
