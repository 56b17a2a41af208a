"""A 4-bit AWQ checkpoint (HF directory, AutoAWQ's GEMM layout with zero points) of a float model,
with AWQ's activation-aware scale search and weight clipping (Lin et al. 2023), or
round-to-nearest.

    python3 scripts/awq_checkpoint.py --out DIR [--model GGUF] [--group 128] [--method awq]

Each set of linears that reads one input is searched once per decoder layer: q/k/v (after the
attention norm), gate/up (after the MLP norm), down (after up's rows) and o_proj where v's rows
line up with its columns (no grouped-query attention). Input channel j is multiplied by
s_j = mean|x_j|^a, normalized so that max(s) min(s) = 1, for a = 0, 1/20, ..., 19/20; W diag(s)
is rounded to nearest per group and the a with the least output error
sum ||X (W - Q(W diag s) diag(1/s))^T||^2 is kept. The op before takes 1/s (the norm's weight,
up's rows), so the float model computes the same function. Then every linear but q and k clips
each (row, group) of its weights to the ratio of max|w| in 1, 0.975, ..., 0.525 with the least
error of that group's share of the outputs. Errors come from the inputs' second moments X^T X
(one float pass over the calibration tokens, as scripts/gptq_checkpoint.py takes them), so no
forward pass runs during the search; AutoAWQ measures the q/k/v and gate/up scales on the
attention block's and the MLP's outputs instead of each linear's. Group parameters and packing
are the tests' reference (tests/unit/test_gptq_awq.py): run from the repository's root.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gptq_checkpoint import (  # noqa: E402
    calibration_ids,
    checkpoint_tensors,
    input_stats,
    load_float,
    save_checkpoint,
)

from tests.unit.test_gptq_awq import pack_awq, quantize, reference  # noqa: E402

GRID = 20  # scale exponents a = i / GRID; clip ratios 1 - i / (2 GRID)


def fake_quant(w: torch.Tensor, group: int) -> torch.Tensor:
    """w [out, in] rounded to nearest per group of columns and dequantized: the tests' reference
    quantizer and dequantization (float64)."""
    groups = torch.arange(w.shape[1]) // group
    return reference(*quantize(w, groups, int(groups[-1]) + 1, sym=False), groups)


def output_error(d: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """Each row's sum over the inputs X of (x . d)^2, from H ~ X^T X: d [out, in] -> [out]."""
    return (d * (d @ H)).sum(1)


def search_scale(ws: list[torch.Tensor], H: torch.Tensor, absmean: torch.Tensor, group: int):
    """(s [in], its exponent a): the input scaling that rounds the linears `ws` (one input,
    second moments H, mean |x| per channel `absmean`) with the least output error."""
    best, best_s, best_a = None, torch.ones_like(absmean), 0.0
    for i in range(GRID):
        a = i / GRID
        s = absmean.clamp_min(1e-4) ** a
        s = s / (s.max() * s.min()).sqrt()
        err = sum(output_error(w - fake_quant(w * s, group) / s, H).sum() for w in ws)
        if best is None or err < best:
            best, best_s, best_a = err, s, a
    return best_s, best_a


def search_clip(w: torch.Tensor, H: torch.Tensor, group: int) -> torch.Tensor:
    """w with each (row, group) clipped to +-r max|w| for the r in 1, 0.975, ..., 0.525 whose
    rounding costs that group's share of the outputs least (H: second moments of w's inputs)."""
    out = w.clone()
    for a in range(0, w.shape[1], group):
        wg, Hg = w[:, a : a + group], H[a : a + group, a : a + group]
        top = wg.abs().amax(1, keepdim=True)
        best_err = torch.full((w.shape[0],), float("inf"), dtype=w.dtype)
        for i in range(GRID):
            limit = top * (1 - i / (2 * GRID))
            cw = torch.clamp(wg, -limit, limit)
            err = output_error(wg - fake_quant(cw, group), Hg)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            out[better, a : a + group] = cw[better]
    return out


# Each linear that is clipped, and the linear whose input it shares (whose scales it took).
CLIPPED = {
    "self_attn.v_proj": "self_attn.q_proj",
    "self_attn.o_proj": "self_attn.o_proj",
    "mlp.gate_proj": "mlp.gate_proj",
    "mlp.up_proj": "mlp.gate_proj",
    "mlp.down_proj": "mlp.down_proj",
}


def awq_layer(layer, H: dict, absmean: dict, prefix: str, group: int, log) -> None:
    """Scale and clip one decoder layer's float weights in place (the module docstring)."""
    attn, mlp = layer.self_attn, layer.mlp
    s_in = {}

    def scaled(names: list[str], before) -> None:
        """Search the scales of the linears `names` (one input: the first one's), multiply
        their columns by s and give 1/s to the op before (`before(s)`)."""
        lins = [layer.get_submodule(n) for n in names]
        key = prefix + names[0]
        s, a = search_scale([lin.weight.double() for lin in lins], H[key], absmean[key], group)
        for lin in lins:
            lin.weight.mul_(s.to(lin.weight.dtype))
        before(s)
        log(f"{key}: a = {a:.2f}")
        s_in[names[0]] = s

    def into_norm(norm):
        return lambda s: norm.weight.div_(s.to(norm.weight.dtype))

    def into_rows(lin):
        def f(s):
            lin.weight.div_(s.to(lin.weight.dtype)[:, None])
            if lin.bias is not None:
                lin.bias.div_(s.to(lin.bias.dtype))

        return f

    qkv = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    scaled(qkv, into_norm(layer.input_layernorm))
    if attn.v_proj.weight.shape[0] == attn.o_proj.weight.shape[1]:
        scaled(["self_attn.o_proj"], into_rows(attn.v_proj))
    scaled(["mlp.gate_proj", "mlp.up_proj"], into_norm(layer.post_attention_layernorm))
    scaled(["mlp.down_proj"], into_rows(mlp.up_proj))
    for name, src in CLIPPED.items():
        h = H[prefix + src]
        if src in s_in:  # the inputs the scaled weights now see are x / s
            s = s_in[src]
            h = h / (s[:, None] * s[None, :])
        lin = layer.get_submodule(name)
        lin.weight.copy_(search_clip(lin.weight.double(), h, group).to(lin.weight.dtype))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the checkpoint directory to write")
    p.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    p.add_argument("--method", choices=("awq", "rtn"), default="awq")
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--calib-tokens", type=int, default=8192)
    p.add_argument("--calib-offset", type=int, default=16384)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--verbose", action="store_true", help="print each search's exponent")
    args = p.parse_args(argv)

    model, tok = load_float(args.model)
    t0 = time.perf_counter()
    if args.method == "awq":
        ids = calibration_ids(tok, args.calib_offset, args.calib_tokens)
        H, absmean = input_stats(model, ids, args.window)
        print(f"calibration: {time.perf_counter() - t0:.1f} s", file=sys.stderr)

        def log(line):
            if args.verbose:
                print(line, file=sys.stderr)

        with torch.no_grad():
            for i, layer in enumerate(model.model.layers):
                awq_layer(layer, H, absmean, f"model.layers.{i}.", args.group, log)
        print(f"searched in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    def pack(name: str, w: torch.Tensor) -> dict:
        groups = torch.arange(w.shape[1]) // args.group
        return pack_awq(*quantize(w, groups, int(groups[-1]) + 1, sym=False))

    tensors = checkpoint_tensors(model, pack)
    print(f"quantized in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    quantization_config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": args.group,
        "zero_point": True,
        "version": "gemm",
    }
    save_checkpoint(args.out, model, tok, tensors, quantization_config)
    print(f"wrote {args.out}: {args.method}, group {args.group}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
