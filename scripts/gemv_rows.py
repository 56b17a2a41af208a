"""Kernel time of every linear of the default model (30 layers + the LM head) against the number of
activation rows: kvserve's C GEMV per ISA build vs fbgemm's fp16 GEMM and MKL's fp32 GEMM on the
same values. Prints a table and writes JSON (--output).

    python3 scripts/gemv_rows.py --threads 2 --rows 1,2,4,8,16,32,64,128,256,512
    python3 scripts/gemv_rows.py --one-part --isas avx2 --rows 1,2,3,5,9    # gguf-a8's GEMV
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch
import torch.nn.functional as F

from kvserve.bench.common import machine_info
from kvserve.config import ModelConfig
from kvserve.model.layers import Linear
from kvserve.model.loader import default_model_path, load_model
from kvserve.ops import cpu_kernels


def best_of(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--isas",
        default=None,
        help="comma-separated builds (default: every one this CPU runs but portable)",
    )
    p.add_argument(
        "--one-part",
        action="store_true",
        help="activations as one 8-bit part per block (the gguf-a8 format) instead of two",
    )
    p.add_argument("--output", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(ModelConfig(model=default_model_path(), quantization="gguf"))
    lins = [
        m
        for m in lm.model.modules()
        if isinstance(m, Linear) and getattr(m, "gguf_packed", None) is not None
    ]
    isas = (
        args.isas.split(",")
        if args.isas
        else [i for i in cpu_kernels.host_isas() if i != "portable"]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp16 = (
            [
                torch.ops.quantized.linear_prepack_fp16(m.quant_method.dequantized(m), None)
                for m in lins
            ]
            if "fbgemm" in torch.backends.quantized.supported_engines
            else None
        )
    dense = [m.quant_method.dequantized(m) for m in lins]
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    print(
        f"{'rows':>5} "
        + " ".join(f"{'C ' + i:>16}" for i in isas)
        + f" {'fbgemm fp16':>12} {'fp32':>10}   (ms, all linears)"
    )
    for M in rows:
        xs = {k: torch.randn(M, k) for k in {m.in_features for m in lins}}
        r = {"rows": M}
        for isa in isas:
            r[f"c_{isa}"] = best_of(
                lambda: [
                    cpu_kernels.gguf_gemv(
                        m.gguf_packed,
                        m.gguf_kind,
                        m.out_features,
                        xs[m.in_features],
                        isa=isa,
                        parts="one" if args.one_part else "two",
                    )
                    for m in lins
                ],
                args.reps,
            )
        if fp16 is not None:
            r["fbgemm_fp16"] = best_of(
                lambda: [
                    torch.ops.quantized.linear_dynamic_fp16(xs[m.in_features], w)
                    for m, w in zip(lins, fp16)
                ],
                args.reps,
            )
        r["fp32"] = best_of(
            lambda: [F.linear(xs[m.in_features], w) for m, w in zip(lins, dense)], args.reps
        )
        results.append(r)
        print(
            f"{M:>5} "
            + " ".join(f"{r['c_' + i] * 1e3:>16.2f}" for i in isas)
            + f" {r.get('fbgemm_fp16', float('nan')) * 1e3:>12.2f} {r['fp32'] * 1e3:>10.2f}"
        )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(
                {
                    "threads": args.threads,
                    "one_part": args.one_part,
                    "machine": machine_info(),
                    "results": results,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
