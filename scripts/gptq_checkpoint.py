"""A 4-bit GPTQ checkpoint (HF directory, GPTQ v1 layout) of a float model, quantized with the
GPTQ algorithm (Frantar et al. 2022: each column rounded in turn, its error spread over the
columns not yet rounded through the inverse Hessian of the layer's inputs), or round-to-nearest.

    python3 scripts/gptq_checkpoint.py --out DIR [--model GGUF] [--group 128] [--method gptq]

The float model is the GGUF as transformers loads it (float32), the default model unless --model.
Calibration: --calib-tokens tokens of eval-quality's docstring text taken from --calib-offset on
(the default skips the first 16,384, which `kvserve eval-quality --max-tokens 8192` measures), in
windows of --window tokens. Every linear's Hessian 2 X^T X comes from one pass of the float model
(inputs not re-run through the quantized layers before it). Groups are fixed by column (g_idx =
column // group, the layout kvserve packs onto its 4-bit blocks); --act-order rounds the columns
in decreasing Hessian diagonal order within those fixed groups (gptqmodel's static groups).
Group parameters and packing are the tests' reference (tests/unit/test_gptq_awq.py): run from
the repository's root.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())

from tests.unit.test_gptq_awq import group_params, pack_gptq  # noqa: E402

PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_linear(w, H, group: int, bits: int, sym: bool, damp: float, act_order: bool, rtn):
    """(q [out, in], z [groups, out], s fp16 [groups, out]) of w [out, in] (float64 math)."""
    W = w.double().clone()
    out, cols = W.shape
    ngroups = -(-cols // group)  # the last group may be shorter
    z = torch.zeros(ngroups, out, dtype=torch.int64)
    s = torch.zeros(ngroups, out, dtype=torch.float16)
    for g in range(ngroups):  # static groups: the parameters of the float weight's group
        z[g], s[g] = group_params(W[:, g * group : (g + 1) * group], bits, sym)
    top = (1 << bits) - 1

    def rnd(col: torch.Tensor, i: int) -> torch.Tensor:
        g = i // group
        return torch.clamp(torch.round(col / s[g].double()) + z[g], 0, top)

    q = torch.zeros(out, cols, dtype=torch.int64)
    if rtn:
        for i in range(cols):
            q[:, i] = rnd(W[:, i], i).long()
        return q, z, s
    H = H.double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    order = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(cols)
    W, H = W[:, order], H[order][:, order]
    H += damp * torch.mean(torch.diag(H)) * torch.eye(cols, dtype=H.dtype)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    for i in range(cols):
        c = int(order[i])
        qi = rnd(W[:, i], c)
        q[:, c] = qi.long()
        deq = (qi - z[c // group]) * s[c // group].double()
        err = (W[:, i] - deq) / U[i, i]
        W[:, i + 1 :] -= err[:, None] * U[i, i + 1 :][None, :]
    return q, z, s


def calibration_ids(tokenizer, offset: int, n: int) -> list[int]:
    from kvserve.eval_quality import corpus_text

    ids = tokenizer.encode(corpus_text())
    if len(ids) < offset + n:
        raise SystemExit(f"the docstring text has {len(ids)} tokens: lower --calib-offset")
    return ids[offset : offset + n]


def input_stats(model, ids: list[int], window: int):
    """({linear: 2 X^T X / n}, {linear: mean |x| per input channel}) of every targeted linear's
    inputs X over the windows (one float pass, float64 sums)."""
    H, absum, count, hooks = {}, {}, {}, []

    def hook(name):
        def f(mod, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            H[name] = H.get(name, 0) + 2 * x.t() @ x
            absum[name] = absum.get(name, 0) + x.abs().sum(0)
            count[name] = count.get(name, 0) + x.shape[0]

        return f

    for name, mod in model.named_modules():
        if name.rpartition(".")[2] in PROJS:
            hooks.append(mod.register_forward_pre_hook(hook(name)))
    with torch.no_grad():
        for at in range(0, len(ids) - window + 1, window):
            model(torch.tensor([ids[at : at + window]]))
    for h in hooks:
        h.remove()
    return {k: v / count[k] for k, v in H.items()}, {k: v / count[k] for k, v in absum.items()}


def load_float(path):
    """(transformers model in float32, its tokenizer) of a GGUF file (the default model if None)."""
    import transformers

    from kvserve.bench.common import model_path

    gguf = model_path(path)
    folder, name = os.path.dirname(gguf), os.path.basename(gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    ).eval()
    return model, transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


def checkpoint_tensors(model, pack) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: each targeted linear as `pack(name, float32 weight)` gives its
    packed tensors (under the linear's name), every other tensor of the model as it is."""
    tensors, done = {}, set()
    with torch.no_grad():
        for name, mod in model.named_modules():
            if name.rpartition(".")[2] in PROJS:
                packed = pack(name, mod.weight.float())
                tensors.update({f"{name}.{k}": v.contiguous() for k, v in packed.items()})
                done.add(name)
        for name, t in model.state_dict().items():
            if name.rpartition(".")[0] not in done:
                tensors[name] = t.contiguous()
    return tensors


def save_checkpoint(out: str, model, tok, tensors: dict, quantization_config: dict) -> None:
    """The HF directory: config (with its quantization_config), tokenizer, model.safetensors."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.save_pretrained(out)
    tok.save_pretrained(out)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg_path = os.path.join(out, "config.json")
    cfg = json.loads(open(cfg_path).read())
    cfg["quantization_config"] = quantization_config
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the checkpoint directory to write")
    p.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    p.add_argument("--method", choices=("gptq", "rtn"), default="gptq")
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--bits", type=int, default=4, choices=(4,))
    p.add_argument("--sym", action="store_true", help="symmetric (z = 8); default asymmetric")
    p.add_argument("--act-order", action="store_true", help="round by Hessian diagonal order")
    p.add_argument("--damp", type=float, default=0.01, help="dampening, share of mean diag(H)")
    p.add_argument("--calib-tokens", type=int, default=8192)
    p.add_argument("--calib-offset", type=int, default=16384)
    p.add_argument("--window", type=int, default=512)
    args = p.parse_args(argv)

    model, tok = load_float(args.model)
    t0 = time.perf_counter()
    H = {}
    if args.method == "gptq":
        ids = calibration_ids(tok, args.calib_offset, args.calib_tokens)
        H, _ = input_stats(model, ids, args.window)
    print(f"calibration: {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    def pack(name: str, w: torch.Tensor) -> dict:
        q, z, s = quantize_linear(
            w,
            H.get(name),
            args.group,
            args.bits,
            args.sym,
            args.damp,
            args.act_order,
            rtn=args.method == "rtn",
        )
        g_idx = torch.arange(w.shape[1]) // args.group
        return pack_gptq(q, z, s, g_idx, v1=True, bits=args.bits)

    tensors = checkpoint_tensors(model, pack)
    print(f"quantized in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    quantization_config = {
        "quant_method": "gptq",
        "bits": args.bits,
        "group_size": args.group,
        "sym": args.sym,
        "desc_act": False,  # static groups: g_idx is column // group whatever the rounding order
        "checkpoint_format": "gptq",
    }
    save_checkpoint(args.out, model, tok, tensors, quantization_config)
    print(f"wrote {args.out}: {args.method}, group {args.group}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
