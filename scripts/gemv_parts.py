"""Time of the C GEMV per activation format (two parts: gguf; one: gguf-a8; mixed: gguf-mixed) on
one weight shaped like the default model's gate/up projection (3072 x 576, Q4_1), for M rows of
Gaussian activations, optionally with an outlier in every --outlier-every-th block of every row
(what makes a mixed block keep its second part). Prints the best of --rounds, in microseconds.

    KVSERVE_ISA=avx2 python3 scripts/gemv_parts.py --rows 2,8,64 [--outlier-every 4]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import quantize

from kvserve.model.quant import BlockTensor, pack_gguf_rows
from kvserve.ops import cpu_kernels


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", default="2,8,64")
    p.add_argument(
        "--outlier-every", type=int, default=0, help="an outlier in every N-th block (0: none)"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    n, k = 3072, 576
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32) * 0.05
    packed, kind = pack_gguf_rows(BlockTensor(quantize(w, Q.Q4_1), Q.Q4_1, (n, k)))
    print(
        f"{cpu_kernels.selected_isa()}, {n} x {k} Q4_1, {args.threads} threads, "
        f"us per call (best of {args.rounds})"
    )
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        if args.outlier_every:
            x[:, 3 :: 32 * args.outlier_every] = 20.0
        best = {}
        for _ in range(args.rounds):
            for parts in cpu_kernels.ACT_PARTS:
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    cpu_kernels.gguf_gemv(packed, kind, n, x, parts=parts)
                t = (time.perf_counter() - t0) / args.calls * 1e6
                best[parts] = min(best.get(parts, t), t)
        print(f"M={m:>3}: " + "  ".join(f"{parts} {t:.1f}" for parts, t in best.items()))


if __name__ == "__main__":
    main()
