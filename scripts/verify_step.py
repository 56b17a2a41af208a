"""Time of one speculative verification step on the default model, split into the C layer stack
(every layer: linears, attention, norms) and the LM head: R token rows of one sequence whose
context already holds --context tokens, as the engine runs them (the runner's layer stack on the
real KV pool, the model's head). Prints ms per step (best of --reps) for each R.

    KVSERVE_ISA=avx2 python3 scripts/verify_step.py --quantization gguf-a8 --context 450 \\
        --rows 1,5,9
"""

from __future__ import annotations

import argparse

import torch
from gemv_rows import best_of  # scripts/ is the script's own directory

from kvserve.engine.llm import LLM
from kvserve.ops.attention import AttentionMetadata


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quantization", default="gguf")
    p.add_argument("--context", type=int, default=450)
    p.add_argument("--rows", default="1,2,3,5,9")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    llm = LLM(
        quantization=args.quantization,
        enable_prefix_caching=False,
        **({"num_threads": args.threads} if args.threads else {}),
    )
    runner = llm.engine.runner
    if runner.layer_stack is None:
        raise SystemExit("this build runs no C layer stack")
    model, caches = runner.model, runner.kv_caches
    block_size = caches[0][0].shape[1]
    rows = [int(r) for r in args.rows.split(",")]
    n_blocks = (args.context + max(rows)) // block_size + 1
    g = torch.Generator().manual_seed(0)
    table = torch.randperm(caches[0][0].shape[0] - 1, generator=g)[:n_blocks] + 1
    # A context of random tokens written through the same stack (a prompt's prefill).
    ctx_ids = torch.randint(0, model.arch.vocab_size, (args.context,), generator=g)

    def meta_for(start: int, n: int) -> AttentionMetadata:
        pos = torch.arange(start, start + n)
        slots = table[pos // block_size] * block_size + pos % block_size
        return AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=[0, n],
            seq_lens=[start + n],
            block_tables=table.unsqueeze(0).clone(),
            block_size=block_size,
        )

    with torch.inference_mode():
        runner.layer_stack(
            ctx_ids,
            torch.arange(args.context),
            meta_for(0, args.context),
            caches,
            torch.tensor([args.context - 1]),
            [args.context],
        )
        print(
            f"{'rows':>5} {'layer stack ms':>15} {'head ms':>9} {'step ms':>9} "
            f"{'per extra row':>14}"
        )
        base = None
        for R in rows:
            ids = torch.randint(0, model.arch.vocab_size, (R,), generator=g)
            pos = torch.arange(args.context, args.context + R)
            meta, out_rows = meta_for(args.context, R), torch.arange(R)
            hidden = runner.layer_stack(ids, pos, meta, caches, out_rows, [args.context])
            t_stack = best_of(
                lambda: runner.layer_stack(ids, pos, meta, caches, out_rows, [args.context]),
                args.reps,
            )
            t_head = best_of(lambda: model.compute_logits(hidden), args.reps)
            step = t_stack + t_head
            base = step if base is None and R == 1 else base
            extra = f"{(step - base) / (R - 1) / base:>13.1%}" if base and R > 1 else f"{'':>14}"
            print(f"{R:>5} {t_stack * 1e3:>15.2f} {t_head * 1e3:>9.2f} {step * 1e3:>9.2f} {extra}")


if __name__ == "__main__":
    main()
