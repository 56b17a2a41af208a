"""Time of the C paged attention for R query rows of one sequence (a verification step's rows, or a
prompt chunk's), over every layer of a model shaped like the default one (9 query / 3 KV heads,
head_dim 64, fp16 KV, 30 layers, each its own pool, evicted from cache before each step), per ISA
build. Prints a table (ms per step, best of --reps).

    python3 scripts/attention_rows.py --context 500 --rows 1,9

With --sequences S, a decode step instead: one row for each of S sequences, contexts uniform in
--context-range, every layer its own pool with the sequences' blocks scattered over it (what a
batched decode reads from memory, not from cache).

    python3 scripts/attention_rows.py --sequences 64 --context-range 50:400

With --base, an A/B in one process: the kernels built from another tree's kvserve/ops/csrc (e.g.
`git archive <rev> kvserve/ops/csrc | tar -x -C /tmp/base`) and from this checkout, alternated over
--rounds (medians and their ratio), for R query rows of one sequence, or with --sequences for that
decode step.

    python3 scripts/attention_rows.py --base /tmp/base/kvserve/ops/csrc --context 2048 --rows 1,9,64
    python3 scripts/attention_rows.py --base /tmp/base/kvserve/ops/csrc --sequences 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from kvserve.ops import cpu_kernels


def step_seconds(
    rows: int, context: int, layers: int, reps: int, heads=(9, 3), head_dim=64, block_size=16
) -> float:
    """Every layer its own pool with the sequence's blocks scattered over it (a step reads them from
    memory, as the engine's does, not from cache)."""
    g = torch.Generator().manual_seed(0)
    hq, hkv = heads
    nb = (context + rows) // block_size + 1
    pools = []
    for _ in range(layers):
        k = torch.randn(nb * 2, block_size, hkv, head_dim, generator=g).half()
        v = torch.randn(nb * 2, block_size, hkv, head_dim, generator=g).half()
        pools.append((k, v, torch.randperm(nb * 2, generator=g)[:nb].unsqueeze(0).contiguous()))
    q = torch.randn(rows, hq, head_dim, generator=g)
    out = torch.empty_like(q)
    qrow, qseq = torch.arange(rows), torch.zeros(rows, dtype=torch.long)
    lens = torch.arange(context - rows + 1, context + 1)  # row i attends to its own position too
    flush = torch.empty(64 << 20, dtype=torch.uint8)  # evicts the pools between repetitions
    best = float("inf")
    for _ in range(reps):
        flush.fill_(1)
        t0 = time.perf_counter()
        for k, v, table in pools:
            cpu_kernels.paged_attention(q, k, v, out, qrow, table, lens, head_dim**-0.5, None, qseq)
        best = min(best, time.perf_counter() - t0)
    return best


def decode_step_seconds(
    sequences: int,
    lo: int,
    hi: int,
    layers: int,
    reps: int,
    heads=(9, 3),
    head_dim=64,
    block_size=16,
) -> float:
    g = torch.Generator().manual_seed(0)
    hq, hkv = heads
    lens = torch.randint(lo, hi + 1, (sequences,), generator=g)
    blocks = [int(n) // block_size + 1 for n in lens]
    pools = []
    for _ in range(layers):
        k = torch.randn(2 * sum(blocks), block_size, hkv, head_dim, generator=g).half()
        v = torch.randn(2 * sum(blocks), block_size, hkv, head_dim, generator=g).half()
        free = torch.randperm(2 * sum(blocks), generator=g).tolist()
        table = torch.zeros(sequences, max(blocks), dtype=torch.long)
        for s, n in enumerate(blocks):
            table[s, :n] = torch.tensor([free.pop() for _ in range(n)])
        pools.append((k, v, table))
    q = torch.randn(sequences, hq, head_dim, generator=g)
    out = torch.empty_like(q)
    rows = torch.arange(sequences)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for k, v, table in pools:
            cpu_kernels.paged_attention(q, k, v, out, rows, table, lens, head_dim**-0.5, None, None)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,9")
    p.add_argument("--context", type=int, default=500)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument(
        "--isas",
        default=None,
        help="comma-separated builds (default: every one this CPU runs but portable)",
    )
    p.add_argument(
        "--sequences", type=int, default=0, help="a decode step of this many sequences instead"
    )
    p.add_argument(
        "--context-range", default="50:400", help="with --sequences: contexts uniform in LO:HI"
    )
    p.add_argument(
        "--base", default=None, help="A/B against the kernels of this kvserve/ops/csrc directory"
    )
    p.add_argument("--rounds", type=int, default=6, help="with --base: alternated rounds")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    isas = (
        args.isas.split(",")
        if args.isas
        else [i for i in cpu_kernels.host_isas() if i != "portable"]
    )
    if args.base:
        compare(args, isas)
        return
    if args.sequences:
        lo, hi = (int(v) for v in args.context_range.split(":"))
        for isa in isas:
            os.environ["KVSERVE_ISA"] = isa
            t = decode_step_seconds(args.sequences, lo, hi, args.layers, min(args.reps, 5))
            print(
                f"{isa:>12}: {t * 1e3:.2f} ms per decode step ({args.sequences} sequences, "
                f"contexts {lo}..{hi}, {args.layers} layers)"
            )
        return
    print(
        f"{'rows':>5} "
        + " ".join(f"{i:>12}" for i in isas)
        + f"   (ms per step, {args.layers} layers, "
        f"{args.context} context tokens)"
    )
    for rows in [int(r) for r in args.rows.split(",")]:
        times = []
        for isa in isas:
            os.environ["KVSERVE_ISA"] = isa  # the build cpu_kernels.paged_attention loads
            times.append(step_seconds(rows, args.context, args.layers, args.reps))
        print(f"{rows:>5} " + " ".join(f"{t * 1e3:>12.2f}" for t in times))


def compare(args, isas: list[str]) -> None:
    """Median ms per step of the base tree's kernels and this checkout's, alternated round by
    round."""
    from kernel_ab import kernel_libraries  # scripts/ is the script's own directory

    load, current = cpu_kernels.library, {}
    cpu_kernels.library = lambda isa=None: current["lib"]
    try:
        for isa in isas:
            libs = kernel_libraries(args.base, isa)
            if args.sequences:
                lo, hi = (int(v) for v in args.context_range.split(":"))
                shapes = [
                    (
                        f"{args.sequences} sequences, contexts {lo}..{hi}",
                        lambda: decode_step_seconds(
                            args.sequences, lo, hi, args.layers, max(1, args.reps // 6)
                        ),
                    )
                ]
            else:
                shapes = [
                    (
                        f"{rows:>4} rows, {args.context} context",
                        lambda rows=rows: step_seconds(
                            rows, args.context, args.layers, max(1, args.reps // 3)
                        ),
                    )
                    for rows in [int(r) for r in args.rows.split(",")]
                ]
            for label, seconds in shapes:
                times = {"base": [], "new": []}
                for r in range(args.rounds):
                    for name in ("base", "new") if r % 2 == 0 else ("new", "base"):
                        current["lib"] = libs[name]
                        times[name].append(seconds())
                b, n = statistics.median(times["base"]), statistics.median(times["new"])
                print(
                    f"{isa:>12} {label}: base {b * 1e3:.2f} ms, new {n * 1e3:.2f} ms, "
                    f"new / base {n / b:.3f}"
                )
    finally:
        cpu_kernels.library = load


if __name__ == "__main__":
    main()
